"""Evaluate a policy: avg@k, pass@k and maj@k on a JSONL prompt set, with dense, sparse or
sparse+LoRA (DistillSparse) rollouts; sparse modes also report the tail (p5) of the exact
acceptance rate alpha of their rollouts against the dense policy.

    python experiments/eval.py --config tiny --data experiments/data/arith_eval.jsonl --k 4
    python experiments/eval.py --config tiny --checkpoint runs/tiny --mode sparse_lora --k 8
    python experiments/eval.py --config qwen3_1p7b model_path=/ckpt data=aime24.jsonl \
        --k 16 --temperature 1.0 --top-p 0.7 --mode sparse

Remaining key=value arguments override the training config (model, schedule, reward, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--data", default=None, help="JSONL with prompt/question and answer fields")
  ap.add_argument("--checkpoint", default=None,
                  help="a training out_dir: evaluate its latest checkpoint (params and LoRA)")
  ap.add_argument("--mode", default="dense", choices=["dense", "sparse", "sparse_lora"])
  ap.add_argument("--k", type=int, default=4, help="samples per prompt")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--max-prompts", type=int, default=0)
  ap.add_argument("--json", action="store_true", help="print the result as JSON")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args(argv)

  from sparrow_jax.rl.config import get_train_config
  from sparrow_jax.rl.evaluate import evaluate
  from sparrow_jax.rl.trainer import Trainer
  try:
    overrides = list(args.overrides)
    if args.data:
      overrides.append(f"data={args.data}")
    if args.checkpoint:
      overrides.append(f"out_dir={args.checkpoint}")
    if args.mode == "sparse_lora":
      overrides.append("distill=true")
    cfg = get_train_config(args.config, overrides + ["tensorboard=false"])
    if args.k < 1:
      raise ValueError(f"--k={args.k}: expected >= 1")
    trainer = Trainer(cfg, quiet=True)
    if args.checkpoint:
      trainer.resume()
    examples = trainer.examples[:args.max_prompts or None]
    res = evaluate(trainer, examples, k=args.k, mode=args.mode, temperature=args.temperature,
                   top_p=args.top_p)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(res, indent=2))
  else:
    for key, v in res.items():
      print(f"{key:28s} {v:.4f}" if isinstance(v, float) else f"{key:28s} {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
