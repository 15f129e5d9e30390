"""Published Sparrow sparsity schedules, plus `constant(k)` and `dense()`, loadable by name.

Every table below is copied verbatim from the Sparrow public release (see
`shared/papers/sparrow_release_facts.md`): 20 values, one per 2000-token position bin; value i
is the number of top-k selected pages (the paper's K / page_size) while the sequence holds
fewer than 2000 * (i + 1) tokens, the last value applying to every longer length. All use page
size 16, 1 bos + 2 recent reserved pages on top of the value (pages attended = value + 3),
dense layers 0 and 1 and mean ("centroid") landmarks. The name ends in the tail target tau
the schedule was calibrated for (5th-percentile acceptance rate, paper §3.2), e.g.
`qwen3-1.7b-0.86` holds p5 alpha at 0.86 for Qwen3-1.7B.

Schedules by name: `parse_schedule` reads a command-line spec (a preset name, `constant:K`,
`dense` or a schedule .json file) and `as_schedule` takes a schedule or a constant int
budget. They live here, above `schedule.py`, because they build the schedules of this module.
"""

from __future__ import annotations

import os

from sparrow_jax.args import is_int
from sparrow_jax.schedule.schedule import SparsitySchedule

PUBLISHED_BIN_SIZE = 2000  # tokens per bin (125 pages of 16)
PUBLISHED_PAGE_SIZE = 16

# name -> 20 per-bin top-k page budgets, verbatim from the release.
_PUBLISHED: dict[str, str] = {
  "qwen3-1.7b-0.75":
      "29 29 45 45 61 61 77 77 93 93 93 93 93 93 93 93 93 93 93 93",
  "qwen3-1.7b-0.80":
      "29 45 61 77 93 93 125 125 125 157 157 157 157 157 157 157 157 157 157 157",
  "qwen3-1.7b-0.83":
      "29 61 77 93 125 125 157 157 189 189 189 189 189 189 189 189 189 189 189 189",
  "qwen3-1.7b-0.86":
      "29 61 93 93 125 157 189 221 221 253 253 253 253 253 253 253 253 253 253 253",
  "qwen3-1.7b-0.88":
      "45 77 125 157 157 189 221 253 253 317 317 317 317 317 317 317 317 317 317 317",
  "qwen3-1.7b-0.90":
      "45 93 157 189 221 253 317 317 381 381 381 381 381 381 381 381 381 381 381 381",
  "qwen3-1.7b-0.92":
      "61 125 189 221 253 317 381 381 445 509 509 509 509 509 509 509 509 509 509 509",
  "qwen3-1.7b-0.94":
      "77 157 221 317 381 445 509 509 637 765 765 765 765 765 765 765 765 765 765 765",
  "qwen3-4b-0.75":
      "29 29 29 29 45 61 77 93 125 125 125 125 157 157 157 157 157 157 189 189",
  "qwen3-4b-0.80":
      "29 29 45 61 77 93 125 157 157 157 189 221 221 221 221 221 221 221 221 221",
  "qwen3-4b-0.86":
      "29 45 61 77 93 125 157 221 253 253 317 317 317 317 381 381 381 381 509 509",
  "qwen3-4b-0.88":
      "29 61 93 125 157 189 253 317 381 445 445 509 509 509 637 637 637 637 637 637",
  "qwen3-4b-0.90":
      "45 77 125 157 189 253 317 445 637 765 765 765 765 765 765 893 893 893 893 893",
  "qwen3-4b-0.92":
      "45 93 157 189 253 381 445 765 893 1021 1021 1149 1149 1149 1149 1149 1149 1149 1149 1149",
  "qwen3-8b-0.75":
      "29 29 29 45 45 77 77 77 93 93 93 93 125 125 125 125 125 125 157 157",
  "qwen3-8b-0.80":
      "29 29 45 61 77 93 125 125 157 157 189 189 189 221 221 221 221 253 253 253",
  "qwen3-8b-0.86":
      "29 45 61 77 125 157 189 253 253 253 253 317 317 317 317 317 317 385 445 445",
  "qwen3-8b-0.87":
      "29 61 77 93 157 189 221 317 317 317 317 381 381 381 381 381 445 445 509 509",
  "qwen3-8b-0.92":
      "45 93 125 189 253 445 509 637 765 765 765 893 893 893 893 893 1021 1021 1021 1021",
  "qwen3-14b-0.86":
      "29 45 77 125 253 381 381 381 381 381 381 381 381 381 381 509 637 637 893 893",
}


def _published(name: str, values: str) -> SparsitySchedule:
  budgets = tuple(int(v) for v in values.split())
  return SparsitySchedule(name=name, page_size=PUBLISHED_PAGE_SIZE, bin_size=PUBLISHED_BIN_SIZE,
                          budgets=budgets, reserved_bos=1, reserved_recent=2,
                          dense_layers=(0, 1), tau=float(name.rsplit("-", 1)[1]),
                          landmark="mean")


PRESETS: dict[str, SparsitySchedule] = {n: _published(n, v) for n, v in _PUBLISHED.items()}


def names() -> list[str]:
  """Names of the published schedules, in table order."""
  return list(PRESETS)


def get_schedule(name: str) -> SparsitySchedule:
  """Published schedule by name (`dense` and `constant:K` go through `parse_schedule`)."""
  if name not in PRESETS:
    raise ValueError(f"unknown schedule preset {name!r}; valid presets: {', '.join(PRESETS)}")
  return PRESETS[name]


def constant(k: int, **overrides) -> SparsitySchedule:
  """K top-k pages at every length (one bin), release defaults otherwise; tau unknown (None)."""
  kw = dict(name=f"constant-{k}", page_size=PUBLISHED_PAGE_SIZE, bin_size=PUBLISHED_BIN_SIZE,
            budgets=(k,), reserved_bos=1, reserved_recent=2, dense_layers=(0, 1), tau=None,
            landmark="mean")
  kw.update(overrides)
  return SparsitySchedule(**kw)


def dense(**overrides) -> SparsitySchedule:
  """Dense attention in every layer: budget = every page held, nothing reserved."""
  kw = dict(name="dense", page_size=PUBLISHED_PAGE_SIZE, bin_size=PUBLISHED_BIN_SIZE,
            budgets=(), reserved_bos=0, reserved_recent=0, dense_layers=(), tau=None,
            is_dense=True)
  kw.update(overrides)
  return SparsitySchedule(**kw)


def as_schedule(spec, *, page_size: int = 16) -> SparsitySchedule:
  """A `SparsitySchedule` from a schedule or a constant int budget (one unbounded bin)."""
  if isinstance(spec, SparsitySchedule):
    return spec
  if is_int(spec):
    return constant(int(spec), page_size=page_size, bin_size=1 << 30)
  raise ValueError(f"schedule {spec!r}: expected a SparsitySchedule or an int page budget")


def parse_schedule(spec: str) -> SparsitySchedule:
  """Schedule from a CLI spec: a preset name, a JSON file path, `constant:K`, or `dense`."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"schedule spec {spec!r}: expected a non-empty string")
  s = spec.strip()
  if s == "dense":
    return dense()
  if s.startswith("constant:"):
    k = s.split(":", 1)[1]
    try:
      kv = int(k)
    except ValueError:
      kv = -1
    if kv <= 0:
      raise ValueError(f"schedule spec {spec!r}: constant:K needs a positive int K (pages), "
                       f"got {k!r}")
    return constant(kv)
  if s in PRESETS:
    return get_schedule(s)
  if s.endswith(".json") or os.path.sep in s or os.path.isfile(s):
    return SparsitySchedule.from_json(s)
  raise ValueError(
      f"schedule spec {spec!r} not understood; valid forms: a preset name, a path to a "
      f"schedule .json file, 'constant:K' (K pages per query), or 'dense'. Presets: "
      f"{', '.join(names())}")
