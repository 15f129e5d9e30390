"""Regenerate (or check) the README's sample of the default training run from the code itself.

    python experiments/readme_sample.py --check   # run the default config; exit 1 on drift
    python experiments/readme_sample.py --write   # run it and rewrite the README block

The block sits between `<!-- readme-sample:begin -->` and `<!-- readme-sample:end -->` in
README.md. The run is `experiments/train.py` with the given overrides (none: the `tiny`
default) into a temporary out_dir, in this process; its console lines are kept as printed,
except the wall-clock `step_s=` field, which no two runs share. The first --head and last
--tail step lines are shown with `...` between, then the summary. The run is deterministic on
one kind of machine (same jax/XLA build and CPU): --check passing there is the claim the README
makes; another machine kind may differ in the last digits.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BEGIN, END = "<!-- readme-sample:begin -->", "<!-- readme-sample:end -->"
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
_TIMING = re.compile(r"\s+step_s=\S+")


def render_block(stdout: str, *, head: int = 2, tail: int = 2) -> str:
  """The README block (a fenced code block) from the console output of train.py."""
  warm = [ln for ln in stdout.splitlines() if ln.startswith("warm start:")]
  steps = [_TIMING.sub("", ln).rstrip() for ln in stdout.splitlines()
           if re.match(r"step \d+\s", ln)]
  summary = [ln for ln in stdout.splitlines() if ln.startswith("summary:")]
  if not steps or len(summary) != 1:
    raise ValueError("train.py printed no step lines or no summary line; output was:\n"
                     + stdout[-2000:])
  shown = steps if len(steps) <= head + tail else steps[:head] + ["..."] + steps[-tail:]
  return "```\n" + "\n".join(warm + shown + summary) + "\n```"


def replace_block(readme: str, block: str) -> str:
  """`readme` with the text between the markers replaced by `block`."""
  if readme.count(BEGIN) != 1 or readme.count(END) != 1:
    raise ValueError(f"expected one {BEGIN} and one {END} in the README")
  pre, rest = readme.split(BEGIN)
  _, post = rest.split(END)
  return f"{pre}{BEGIN}\n{block}\n{END}{post}"


def run_default(overrides: list[str]) -> tuple[str, float]:
  """(stdout of `train.py <overrides>` into a temporary out_dir, wall seconds)."""
  import experiments.train as train_cli

  with tempfile.TemporaryDirectory(prefix="readme_sample_") as tmp:
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
      rc = train_cli.main(list(overrides) + [f"out_dir={os.path.join(tmp, 'run')}"])
    seconds = time.perf_counter() - t0
  if rc != 0:
    raise RuntimeError(f"train.py exited with {rc}; output:\n{buf.getvalue()[-2000:]}")
  return buf.getvalue(), seconds


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  mode = ap.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help="rewrite the README block")
  mode.add_argument("--check", action="store_true", help="exit 1 if the block differs")
  ap.add_argument("--readme", default=README)
  ap.add_argument("--head", type=int, default=2, help="first step lines shown")
  ap.add_argument("--tail", type=int, default=2, help="last step lines shown")
  ap.add_argument("overrides", nargs="*", help="train.py key=value overrides (default: none)")
  args = ap.parse_args(argv)
  with open(args.readme) as f:
    readme = f.read()
  try:
    replace_block(readme, "")  # markers present?
    stdout, seconds = run_default(args.overrides)
    block = render_block(stdout, head=args.head, tail=args.tail)
  except (ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  new = replace_block(readme, block)
  print(f"[default run: {seconds:.0f} s wall]", file=sys.stderr)
  if args.write:
    with open(args.readme, "w") as f:
      f.write(new)
    print(f"wrote the sample into {args.readme}")
    return 0
  if new == readme:
    print(f"{args.readme}: the sample matches this run")
    return 0
  sys.stdout.writelines(difflib.unified_diff(readme.splitlines(True), new.splitlines(True),
                                             "README (now)", "this run"))
  print(f"{args.readme}: the sample differs from this run; rerun with --write", file=sys.stderr)
  return 1


if __name__ == "__main__":
  sys.exit(main())
