"""Which task can this model half do? Sample a preset's synthetic problems and score the
samples several ways before choosing an RL task (issue 20's pre-check).

    python experiments/task_precheck.py --config smollm2_135m_study --prompts 16 --k 4
    python experiments/task_precheck.py --config smollm2_135m_study arith_max_digits=2 \
        --temperature 1.0

It prints, over prompts x k samples, the fraction scored 1 by `boxed_exact`, the fraction with
any `\\boxed{}`, the fraction whose boxed-or-last number is right (`boxed_or_last_number`),
the mean response length and a few samples. GRPO needs a start where the reward is neither 0
nor 1 for most groups: aim for 0.2-0.6.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments._cli import at_least, positive  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m_study")
  ap.add_argument("--prompts", type=positive(int), default=16)
  ap.add_argument("--k", type=positive(int), default=4, help="samples per prompt")
  ap.add_argument("--temperature", type=at_least(float, 0), default=None,
                  help="default: the preset's")
  ap.add_argument("--show", type=at_least(int, 0), default=6, help="samples to print")
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = ap.parse_intermixed_args(argv)

  from sparrow_jax.engine.engine import Request
  from sparrow_jax.engine.sampling import SamplingParams
  from sparrow_jax.rl import rewards as R
  from sparrow_jax.run.builders import encode_prompt
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.builders import build_examples, fit_prompts
  from sparrow_jax.run.trainer import Trainer
  try:
    cfg = get_train_config(args.config, list(args.overrides) + [
        "tensorboard=false", "schedule=dense", "distill=false", "arrol=false"])
    temp = cfg.temperature if args.temperature is None else args.temperature
    examples = build_examples(cfg)
    trainer = Trainer(cfg, quiet=True, with_dataset=False)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  examples = fit_prompts(trainer.tokenizer, examples, cfg, "data")[:args.prompts]
  reqs = [Request(encode_prompt(trainer.tokenizer, e, cfg.chat_template),
                  SamplingParams(temperature=temp, max_new_tokens=cfg.max_new_tokens,
                                 seed=7 + i * args.k + j), (i, j))
          for i, e in enumerate(examples) for j in range(args.k)]
  t0 = time.perf_counter()
  comps = trainer.engine.generate(reqs)
  gen_s = time.perf_counter() - t0
  texts = [trainer.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
  gold = [examples[c.request_id[0]].answer for c in comps]
  n = len(comps)
  boxed = sum(R.boxed_exact(t, a) for t, a in zip(texts, gold)) / n
  has_box = sum(R.last_boxed(t) is not None for t in texts) / n
  loose = sum(R.boxed_or_last_number(t, a) for t, a in zip(texts, gold)) / n
  length = sum(len(c.token_ids) for c in comps) / n
  print(f"{args.config} {' '.join(args.overrides)} T={temp:g}: {n} samples "
        f"({len(examples)} prompts x {args.k}) in {gen_s:.0f} s")
  print(f"  boxed_exact {boxed:.3f}  has a box {has_box:.3f}  boxed_or_last_number "
        f"{loose:.3f}  mean length {length:.0f} tokens")
  for c, t in list(zip(comps, texts))[:args.show]:
    e = examples[c.request_id[0]]
    print(f"  --- {e.prompt[:48]!r} (answer {e.answer}): {t[-160:]!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
