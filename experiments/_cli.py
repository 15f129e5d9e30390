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


def at_least(kind, low):
  """`type=at_least(int, 0)`: a number >= low (e.g. 0 = off)."""
  def conv(s):
    try:
      v = kind(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r}: expected a {kind.__name__} >= {low}") from None
    if not v >= low:
      raise argparse.ArgumentTypeError(f"{s!r}: expected a {kind.__name__} >= {low}")
    return v
  return conv


def unit_interval(s: str) -> float:
  """`type=unit_interval`: a probability mass in (0, 1] (top-p)."""
  try:
    v = float(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected a number in (0, 1]") from None
  if not 0 < v <= 1:
    raise argparse.ArgumentTypeError(f"{s!r}: expected a number in (0, 1]")
  return v


def power_of_two(s: str) -> int:
  """`type=power_of_two`: a positive power of two (page sizes)."""
  v = positive(int)(s)
  if v & (v - 1):
    raise argparse.ArgumentTypeError(f"{s!r}: expected a power of two")
  return v


def show_defaults(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Every option's help ends with its default (`(default: 4)`), unless the help already
  says it or there is none to show (flags, optional paths). Goes with
  `RawDescriptionHelpFormatter`, which keeps the examples' line breaks."""
  for a in ap._actions:
    if (not a.option_strings or a.help == argparse.SUPPRESS or a.default is None
        or a.default is False or a.default in ([], "", argparse.SUPPRESS)):
      continue
    text = a.help or ""
    if "default" not in text:
      a.help = (text + " " if text else "") + "(default: %(default)s)"
  return ap


def training_presets_text() -> str:
  """`--help` epilog: the training presets `--config NAME` takes, one line each."""
  from sparrow_jax.run.config_help import presets_text
  return ("training presets (--config NAME, or a YAML/JSON config file):\n"
          + presets_text())


def model_presets_text() -> str:
  """`--help` epilog: the model presets (architectures) `--config NAME` takes."""
  from sparrow_jax.models.config import PRESETS
  return "model presets (--config NAME): " + ", ".join(PRESETS)
