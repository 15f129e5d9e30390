"""argparse types shared by the experiment scripts (bad values exit with status 2)."""

from __future__ import annotations

import argparse


def positive(kind):
  """`type=positive(int)` / `positive(float)`: a number > 0."""
  def conv(s):
    try:
      v = kind(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r}: expected a positive {kind.__name__}") from None
    if not v > 0:
      raise argparse.ArgumentTypeError(f"{s!r}: expected a positive {kind.__name__}")
    return v
  return conv


def int_list(s: str) -> list[int]:
  """`type=int_list`: comma-separated positive ints, e.g. `8,16,32`."""
  try:
    vals = [int(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated positive ints") from None
  if not vals or min(vals) <= 0:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated positive ints")
  return vals
