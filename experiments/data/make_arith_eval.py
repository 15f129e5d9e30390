"""Write (or --check) experiments/data/arith_eval.jsonl, the held-out set of the tiny preset.

    python experiments/data/make_arith_eval.py           # rewrite the file
    python experiments/data/make_arith_eval.py --check   # exit 1 if it differs

It holds every single-digit sum `a+b=` (a, b in 0..9) that is not among the `tiny` preset's
training prompts (`data=synthetic:arithmetic` with its settings: `num_examples` problems drawn
with `seed`, 1-digit operands, `+`, the raw template), in (a, b) order, answer `str(a + b)`.
A run with another seed or other arith_* settings draws other training prompts, so the set is
held out for the preset as shipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_eval.jsonl")


def held_out_lines() -> list[str]:
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.builders import build_examples

  cfg = get_train_config("tiny")
  train = {e.prompt for e in build_examples(cfg)}
  return [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
          for a in range(10) for b in range(10) if f"{a}+{b}=" not in train]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--check", action="store_true", help="compare instead of writing")
  args = ap.parse_args(argv)
  text = "".join(held_out_lines())
  if args.check:
    with open(PATH) as f:
      same = f.read() == text
    print(f"{PATH}: {'up to date' if same else 'differs from the generator'}")
    return 0 if same else 1
  with open(PATH, "w") as f:
    f.write(text)
  print(f"wrote {text.count(chr(10))} prompts to {PATH}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
