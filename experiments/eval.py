r"""Evaluate a policy on a prompt set: avg@k, pass@k and maj@k, with dense, sparse or
sparse+LoRA (DistillSparse) rollouts; sparse modes also report the tail (p5) of the exact
acceptance rate alpha of their rollouts against the dense policy. Weighted voting side by side
with maj@k: DeepConf trace confidence, and the ARRoL quality head for runs that trained one.

    python experiments/eval.py --checkpoint runs/tiny --data experiments/data/arith_eval.jsonl
    python experiments/eval.py --checkpoint runs/tiny --data experiments/data/arith_eval.jsonl \
        --mode sparse_lora --k 8
    python experiments/eval.py --config tiny --data experiments/data/arith_eval.jsonl  # untrained
    python experiments/eval.py --config qwen3_1p7b model_path=/ckpt data=aime24.jsonl \
        --k 16 --temperature 1.0 --top-p 0.7 --mode sparse

--checkpoint RUN evaluates the newest intact checkpoint of a training out_dir with the run's
own config (model, tokenizer, schedule, reward, max_new_tokens): only the weights are read
(the policy, and the sparse actor's LoRA for --mode sparse_lora), never the optimizer or the
training data position, so any data set of any size can be scored. --data is a JSONL/Parquet
file with a prompt/question field and an answer field (default: the config's data).
experiments/data/arith_eval.jsonl is held out from the tiny preset's training draw.
Remaining key=value arguments override the config (reward=, max_new_tokens=, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments._cli import at_least, positive, unit_interval  # noqa: E402

LEGEND = """\
  avg@k   mean reward of the k samples of a prompt, averaged over prompts (expected accuracy
          of one sample)
  pass@k  chance that at least one of k samples is correct (unbiased estimator from all
          samples), averaged over prompts
  maj@k   the majority answer of k samples is correct, averaged over prompts
  @1      the two @1 figures differ on purpose: avg@1 (and maj@1) read only the FIRST sample
          of each prompt, pass@1 is estimated from ALL k samples (fraction correct). Both
          estimate one sample's accuracy; pass@1 (= avg@k for 0/1 rewards) has less noise
  alpha_p5  5th percentile of the per-token acceptance rate between the sparse actor and the
          dense policy on these rollouts (sparse modes; the run keeps it above tau)
  deepconf_maj@k  votes weighted by DeepConf trace confidence (mean of the lowest 10% of
          windowed token confidences, from the top-k log-probs of each sample)
  head_maj@k  votes weighted by the ARRoL quality head's rank weights (runs with arrol=true:
          the head scores each sample at its detection point)"""


def main(argv=None) -> int:
  from experiments._cli import show_defaults, training_presets_text
  ap = argparse.ArgumentParser(description=__doc__, epilog=training_presets_text(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny",
                  help="training preset or YAML/JSON config file when no --checkpoint is "
                       "given (random or model_path weights; presets listed below)")
  ap.add_argument("--data", default=None,
                  help="JSONL/Parquet with prompt/question and answer fields (default: the "
                       "config's data)")
  ap.add_argument("--checkpoint", default=None,
                  help="a training out_dir: its newest intact checkpoint and saved config")
  ap.add_argument("--mode", default="dense", choices=["dense", "sparse", "sparse_lora"],
                  help="rollouts with full attention (the policy), with the run's sparsity "
                       "schedule (the sparse actor), or the sparse actor with its "
                       "DistillSparse LoRA")
  ap.add_argument("--k", type=positive(int), default=4, help="samples per prompt")
  ap.add_argument("--temperature", type=at_least(float, 0), default=1.0,
                  help="sampling temperature (0 = greedy)")
  ap.add_argument("--top-p", type=unit_interval, default=1.0, help="nucleus mass in (0, 1]")
  ap.add_argument("--top-k", type=at_least(int, 0), default=0,
                  help="0 = off; applied before --top-p")
  ap.add_argument("--max-prompts", type=at_least(int, 0), default=0, help="0 = all")
  ap.add_argument("--json", action="store_true", help="print the result as JSON")
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  show_defaults(ap)
  args = ap.parse_intermixed_args(argv)  # flags may come after key=value overrides

  from sparrow_jax.run import runs
  from sparrow_jax.run.config import get_train_config, parse_overrides
  from sparrow_jax.run.evaluate import evaluate
  from sparrow_jax.run.builders import build_examples, fit_prompts
  from sparrow_jax.run.trainer import Trainer
  try:
    overrides = list(args.overrides) + ["tensorboard=false"]
    if args.mode == "sparse_lora" and not args.checkpoint:
      overrides.append("distill=true")
    if args.checkpoint:
      cfg = runs.run_config(args.checkpoint, parse_overrides(overrides))
    else:
      cfg = get_train_config(args.config, overrides)
    if args.data:
      cfg = cfg.replace(data=args.data)
    examples = build_examples(cfg)  # a bad --data fails here, before the model is built
    trainer = Trainer(cfg, quiet=True, with_dataset=False)
    if args.checkpoint:
      step = trainer.restore_weights(lora=args.mode == "sparse_lora")
      print(f"evaluating {args.checkpoint} at step {step} on {cfg.data}", file=sys.stderr)
    examples = fit_prompts(trainer.tokenizer, examples, cfg, "--data")
    examples = examples[:args.max_prompts or None]
    if not examples:
      raise ValueError(f"--data {cfg.data}: no prompt fits max_prompt_len={cfg.max_prompt_len}")
    res = evaluate(trainer, examples, k=args.k, mode=args.mode, temperature=args.temperature,
                   top_p=args.top_p, top_k=args.top_k)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(res, indent=2))
  else:
    for key, v in res.items():
      print(f"{key:28s} {v:.4f}" if isinstance(v, float) else f"{key:28s} {v}")
    print(LEGEND)
  return 0


if __name__ == "__main__":
  sys.exit(main())
