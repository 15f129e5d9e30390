"""Train a Qwen3 policy with GRPO on sparse rollouts.

    python experiments/train.py                        # the embedded `tiny` default (CPU, minutes)
    python experiments/train.py --config qwen3_1p7b model_path=/ckpt/Qwen3-1.7B data=train.jsonl
    python experiments/train.py --config qwen3_14b --dry-run --num-devices 32
    python experiments/train.py --config tiny --resume

Any TrainConfig field can be overridden as key=value; unknown keys and bad values exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny", help="training preset (default: tiny)")
  ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  ap.add_argument("--dry-run", action="store_true",
                  help="abstract shapes only: print per-device memory and exit")
  ap.add_argument("--num-devices", type=int, default=None,
                  help="device count for --dry-run (default: the mesh's or local devices)")
  ap.add_argument("--mean-response-len", type=int, default=None,
                  help="--dry-run: mean response length for the concurrency estimate "
                       "(default max_new_tokens/2)")
  ap.add_argument("--quiet", action="store_true")
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = ap.parse_args(argv)

  from sparrow_jax.rl.config import get_train_config
  try:
    cfg = get_train_config(args.config, args.overrides)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run:
    from sparrow_jax.rl.dry_run import dry_run
    return dry_run(cfg, num_devices=args.num_devices,
                   mean_response_len=args.mean_response_len)

  from sparrow_jax.rl.trainer import Trainer, TrainingStopped
  try:
    trainer = Trainer(cfg, quiet=args.quiet)
    if args.resume:
      trainer.resume()
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    summary = trainer.fit()
  except TrainingStopped as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
