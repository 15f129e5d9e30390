"""Dynamic sparsity schedules: a frozen `SparsitySchedule` and its pure budget lookup.

Sparrow (§3.2, "sparsity scheduling") grows the block-sparse attention budget with sequence
length so that the tail acceptance rate (5th percentile of alpha_t per position bin) stays at
a target tau. A schedule is a table of per-bin page budgets; this module holds that table and
the jit/vmap-safe lookup the generation engine and the teacher-forced path use.

Paper / release symbols carried by the names here:
  budgets[i]        the release's "value i": number of top-k selected pages (K / page_size in
                    the paper's cost model) while the sequence holds fewer than
                    bin_size * (i + 1) tokens; the last value applies to every longer length.
  reserved_bos      pages always attended at the start ("bos", 1 in the release).
  reserved_recent   newest pages always attended, including the partial page being written
                    ("eos", 2 in the release). Reserved pages are NOT counted in `budgets`.
  dense_layers      layers that always attend densely (0 and 1 in the release).
  tau               the tail target the schedule was calibrated for (5th-percentile alpha).
  landmark          page summary used to score pages: "mean" (centroid of the page's keys,
                    the release default) or "quest" (per-channel min/max of the keys).
  calibrated_to     (calibrated schedules) positions below this were measured when the table
                    was made; beyond it the last budget applies without a measurement. None =
                    not recorded (presets, `constant:K`, tables written by hand). The trainer
                    warns when its rollouts can reach past it and logs the share of tokens
                    that did (`schedule/beyond_calibrated_frac`).

Definition of "position". Everywhere in this package a *position* is the number of tokens
held in the KV cache for the query being computed, the query's own token included. In
incremental decode that is the sequence length after the new token's K/V are written; in a
teacher-forced forward over a sequence, the query at 0-based index i has position i + 1.
The budget bin is `position // bin_size`, clamped to the last bin, i.e. value i applies while
the sequence holds fewer than bin_size * (i + 1) tokens, as in the release. (The release keys
the bucket on cached pages, `cached_pages // 125` with 16-token pages, so near a boundary its
switch can come up to one page earlier than ours; bins here are in tokens, so bin_size need
not be a multiple of page_size.) Positions <= 0 fall into bin 0.

A fully dense schedule (`is_dense=True`, no budgets, no reserved pages) attends to every page
held: `budget_pages` then returns ceil(position / page_size), so `budget + reserved` equals
the pages attended for dense and sparse schedules alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from sparrow_jax.args import is_int

LANDMARKS = ("mean", "quest")
_FORMAT = "sparrow_jax.SparsitySchedule/v1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsitySchedule:
  """Per-bin top-k page budgets for block-sparse attention (see the module docstring)."""

  name: str = "custom"
  page_size: int = 16
  bin_size: int = 2000
  budgets: tuple[int, ...] = ()
  reserved_bos: int = 1
  reserved_recent: int = 2
  dense_layers: tuple[int, ...] = (0, 1)
  tau: float | None = 0.86
  landmark: str = "mean"
  is_dense: bool = False
  calibrated_to: int | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"SparsitySchedule.name={self.name!r}: expected a non-empty string")
    if not is_int(self.page_size) or self.page_size <= 0 or self.page_size & (self.page_size - 1):
      raise ValueError(f"SparsitySchedule.page_size={self.page_size!r}: expected a positive "
                       "power of two (kernel blocks are powers of two)")
    if not is_int(self.bin_size) or self.bin_size <= 0:
      raise ValueError(f"SparsitySchedule.bin_size={self.bin_size!r}: expected a positive int "
                       "(tokens per position bin)")
    if isinstance(self.budgets, (str, bytes)) or not isinstance(self.budgets, Sequence):
      raise ValueError(f"SparsitySchedule.budgets={self.budgets!r}: expected a sequence of "
                       "positive ints (pages per bin)")
    for i, b in enumerate(self.budgets):
      if not is_int(b) or b <= 0:
        raise ValueError(f"SparsitySchedule.budgets[{i}]={b!r}: expected a positive int "
                         "(top-k pages, reserved pages not included)")
    object.__setattr__(self, "budgets", tuple(int(b) for b in self.budgets))
    if not isinstance(self.is_dense, (bool, np.bool_)):
      raise ValueError(f"SparsitySchedule.is_dense={self.is_dense!r}: expected a bool")
    object.__setattr__(self, "is_dense", bool(self.is_dense))
    if self.is_dense and self.budgets:
      raise ValueError(f"SparsitySchedule.budgets={self.budgets!r} with is_dense=True: expected "
                       "() (a dense schedule attends to every page)")
    if not self.is_dense and not self.budgets:
      raise ValueError("SparsitySchedule.budgets=(): expected at least one per-bin budget "
                       "(or is_dense=True for dense attention)")
    for f in ("reserved_bos", "reserved_recent"):
      v = getattr(self, f)
      if not is_int(v) or v < 0:
        raise ValueError(f"SparsitySchedule.{f}={v!r}: expected an int >= 0")
      if self.is_dense and v != 0:
        raise ValueError(f"SparsitySchedule.{f}={v!r} with is_dense=True: expected 0 (every "
                         "page is attended, none is reserved)")
    if not self.is_dense and self.reserved_recent < 1:
      raise ValueError(f"SparsitySchedule.reserved_recent={self.reserved_recent!r}: expected "
                       ">= 1 (the partial page being written has no landmark and must be kept)")
    if isinstance(self.dense_layers, (str, bytes)) or not isinstance(self.dense_layers, Sequence):
      raise ValueError(f"SparsitySchedule.dense_layers={self.dense_layers!r}: expected a "
                       "sequence of layer indices")
    for v in self.dense_layers:
      if not is_int(v) or v < 0:
        raise ValueError(f"SparsitySchedule.dense_layers={self.dense_layers!r}: expected "
                         "layer indices >= 0")
    if len(set(self.dense_layers)) != len(self.dense_layers):
      raise ValueError(f"SparsitySchedule.dense_layers={self.dense_layers!r}: expected no "
                       "duplicates")
    object.__setattr__(self, "dense_layers", tuple(sorted(int(v) for v in self.dense_layers)))
    if self.tau is not None:
      if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float, np.floating)):
        raise ValueError(f"SparsitySchedule.tau={self.tau!r}: expected a float in (0, 1] "
                         "or None")
      if not 0.0 < float(self.tau) <= 1.0:
        raise ValueError(f"SparsitySchedule.tau={self.tau!r}: expected a float in (0, 1] "
                         "or None")
      object.__setattr__(self, "tau", float(self.tau))
    if self.landmark not in LANDMARKS:
      raise ValueError(f"SparsitySchedule.landmark={self.landmark!r}: expected one of "
                       f"{LANDMARKS}")
    if self.calibrated_to is not None:
      if not is_int(self.calibrated_to) or self.calibrated_to <= 0:
        raise ValueError(f"SparsitySchedule.calibrated_to={self.calibrated_to!r}: expected a "
                         "positive int (positions the calibration measured) or None")
      object.__setattr__(self, "calibrated_to", int(self.calibrated_to))

  @property
  def num_bins(self) -> int:
    """Number of position bins (the last one extends to infinity); 1 for dense."""
    return max(len(self.budgets), 1)

  @property
  def reserved(self) -> int:
    """Pages always attended on top of the budget (bos + recent)."""
    return self.reserved_bos + self.reserved_recent

  def layer_is_dense(self, layer: int) -> bool:
    """True if `layer` attends densely under this schedule (static, Python int)."""
    return self.is_dense or layer in self.dense_layers

  def replace(self, **kw) -> "SparsitySchedule":
    return dataclasses.replace(self, **kw)

  # --- serialisation ----------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["budgets"] = list(self.budgets)
    d["dense_layers"] = list(self.dense_layers)
    return {"format": _FORMAT, **d}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, source: str = "dict") -> "SparsitySchedule":
    if not isinstance(d, Mapping):
      raise ValueError(f"schedule {source}: expected a JSON object, got {type(d).__name__}")
    d = dict(d)
    fmt = d.pop("format", _FORMAT)
    if fmt != _FORMAT:
      raise ValueError(f"schedule {source}: format={fmt!r}, expected {_FORMAT!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"schedule {source}: unknown field(s) {unknown}; expected a subset of "
                       f"{sorted(known)}")
    for f in ("budgets", "dense_layers"):
      if f in d and isinstance(d[f], list):
        d[f] = tuple(d[f])
    try:
      return cls(**d)
    except ValueError as e:
      raise ValueError(f"schedule {source}: {e}") from None

  def to_json(self, path: str | os.PathLike) -> None:
    """Write the schedule as a JSON object to `path` (parent directory must exist)."""
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=2)
      f.write("\n")

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> "SparsitySchedule":
    """Read a schedule written by `to_json`; errors name the file and the bad field."""
    p = os.fspath(path)
    if not os.path.isfile(p):
      raise ValueError(f"schedule file {p!r} does not exist")
    try:
      with open(p) as f:
        d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"schedule file {p!r} is not valid JSON: {e}") from None
    return cls.from_dict(d, source=f"file {p!r}")


# --- pure lookups (traced positions) --------------------------------------------------------

def position_bin(schedule: SparsitySchedule, positions) -> jnp.ndarray:
  """int32 bin index of each position: positions // bin_size, clamped to [0, num_bins-1]."""
  pos = jnp.asarray(positions).astype(jnp.int32)  # [...]
  return jnp.clip(pos // schedule.bin_size, 0, schedule.num_bins - 1)


def pages_held(schedule: SparsitySchedule, positions) -> jnp.ndarray:
  """int32 pages (full or partial) that hold `positions` tokens: ceil(pos / page_size)."""
  pos = jnp.maximum(jnp.asarray(positions).astype(jnp.int32), 0)  # [...]
  return (pos + schedule.page_size - 1) // schedule.page_size


def budget_pages(schedule: SparsitySchedule, positions, table=None) -> jnp.ndarray:
  """int32 top-k page budget (reserved pages excluded) per position, same shape as positions.

  THE budget lookup: the generation engine, the teacher-forced sparse forward, DistillSparse
  and calibration all call it. Pure: `schedule` is static, `positions` may be traced (any
  shape); no Python control flow on values, so it works under jit and vmap. For a dense
  schedule the budget is every page held.

  `table`: optional traced int32 `[num_bins]` copy of `schedule.budgets`. The engine passes
  its device copy so that swapping in a schedule with the same number of bins changes a
  traced value instead of a compiled constant (no recompilation).
  """
  if schedule.is_dense:
    return pages_held(schedule, positions)
  if table is None:
    table = jnp.asarray(schedule.budgets, dtype=jnp.int32)  # [num_bins]
  return jnp.asarray(table, jnp.int32)[position_bin(schedule, positions)]


def teacher_forced_budgets(schedule: SparsitySchedule, seq_len: int, batch: int,
                           table=None) -> jnp.ndarray:
  """int32 `[batch, seq_len]` budgets of a teacher-forced sparse forward: the query at index t
  holds t + 1 tokens, exactly as decode step t does (`budget_pages` at position t + 1)."""
  held = jnp.arange(1, seq_len + 1, dtype=jnp.int32)  # [T]
  return jnp.broadcast_to(budget_pages(schedule, held, table), (batch, seq_len))


def pages_attended(schedule: SparsitySchedule, positions) -> jnp.ndarray:
  """int32 nominal pages attended per query: budget + reserved (bos + recent).

  This is the per-row slot count the selection fills. When a sequence holds no more pages than
  this, attention is dense in practice; `pages_read` gives the distinct pages touched.
  """
  return budget_pages(schedule, positions) + jnp.int32(schedule.reserved)


def pages_read(schedule: SparsitySchedule, positions) -> jnp.ndarray:
  """int32 distinct pages a sparse layer reads: min(budget + reserved, pages held)."""
  return jnp.minimum(pages_attended(schedule, positions), pages_held(schedule, positions))


def max_budget(schedule: SparsitySchedule, max_position: int | None = None) -> int:
  """Static (Python int) maximum budget, for sizing compiled selection buffers.

  With `max_position` only the bins reachable by positions <= max_position count. A dense
  schedule has no finite budget without `max_position` (then ceil(max_position / page_size)).
  """
  if max_position is not None and (not is_int(max_position) or max_position <= 0):
    raise ValueError(f"max_budget: max_position={max_position!r}: expected a positive int")
  if schedule.is_dense:
    if max_position is None:
      raise ValueError(f"max_budget: schedule {schedule.name!r} is dense; pass max_position "
                       "to get the number of pages at that length")
    return -(-max_position // schedule.page_size)
  last = schedule.num_bins - 1
  if max_position is not None:
    last = min(last, max_position // schedule.bin_size)
  return max(schedule.budgets[:last + 1])


def schedule_from_p5(p5: np.ndarray, budgets: Sequence[int], *, tau: float,
                     bin_size: int, page_size: int = 16, name: str = "calibrated",
                     **kw) -> tuple[SparsitySchedule, np.ndarray]:
  """Per bin, the smallest budget whose p5 alpha is >= tau, made non-decreasing along bins.

  Args:
    p5: [num_bins, num_budgets] 5th-percentile acceptance per (bin, budget); NaN = no data.
    budgets: [num_budgets] page budgets (columns of p5), any order.
    tau: target; other keywords go to `SparsitySchedule`.
  Returns:
    (schedule, feasible) where feasible[bin] is False if no budget reached tau in that bin
    (that bin then gets the largest budget). Bins with no data at all inherit the previous bin.
  """
  p5 = np.asarray(p5, dtype=np.float64)
  budgets = np.asarray(budgets, dtype=np.int64)
  if p5.ndim != 2 or p5.shape[1] != budgets.shape[0]:
    raise ValueError(f"schedule_from_p5: p5 shape {p5.shape}: expected [num_bins, "
                     f"{budgets.shape[0]}] (one column per budget)")
  order = np.argsort(budgets)
  budgets, p5 = budgets[order], p5[:, order]
  chosen, feasible = [], []
  for row in p5:
    ok = np.where(row >= tau)[0]  # NaN compares False
    if ok.size:
      chosen.append(int(budgets[ok[0]]))
      feasible.append(True)
    else:
      chosen.append(int(budgets[-1]) if np.isfinite(row).any() else (chosen[-1] if chosen
                                                                      else int(budgets[0])))
      feasible.append(False)
  chosen = list(np.maximum.accumulate(np.asarray(chosen)))
  sched = SparsitySchedule(name=name, page_size=page_size, bin_size=bin_size,
                           budgets=tuple(int(c) for c in chosen), tau=tau, **kw)
  return sched, np.asarray(feasible)


def describe(schedule: SparsitySchedule) -> str:
  """One-line human summary (used by the CLIs)."""
  if schedule.is_dense:
    return f"{schedule.name}: dense attention"
  bins = ", ".join(str(b) for b in schedule.budgets)
  return (f"{schedule.name}: page {schedule.page_size}, bins of {schedule.bin_size} tokens, "
          f"top-k pages [{bins}] + {schedule.reserved_bos} bos + {schedule.reserved_recent} "
          f"recent, dense layers {list(schedule.dense_layers)}, landmark {schedule.landmark}, "
          f"tau {schedule.tau}"
          + (f", calibrated below position {schedule.calibrated_to}"
             if schedule.calibrated_to is not None else ""))


def uncalibrated_positions(schedule: SparsitySchedule, max_tokens: int) -> str | None:
  """A warning if sequences of up to `max_tokens` tokens generate at positions >=
  `schedule.calibrated_to` (the last budget then applies where the calibration measured
  nothing); None otherwise. The last token of such a sequence has position max_tokens - 1."""
  if schedule.is_dense or schedule.calibrated_to is None or max_tokens <= schedule.calibrated_to:
    return None
  return (f"schedule {schedule.name!r} was calibrated below position {schedule.calibrated_to}, "
          f"but rollouts can hold {max_tokens} tokens (max_prompt_len + max_new_tokens): "
          f"positions {schedule.calibrated_to}-{max_tokens - 1} run at the last bin's budget "
          f"({schedule.budgets[-1]} pages), which no calibration measured there. Calibrate "
          "with trajectories that reach those positions (experiments/calibrate.py "
          "--max-new-tokens; --ignore-eos forces the length), or watch the monitor's bins "
          "there; the share of tokens past it is logged as schedule/beyond_calibrated_frac")


def beyond_calibrated_frac(schedule: SparsitySchedule, prompt_lens, lengths) -> float | None:
  """Share of generated tokens at positions >= `schedule.calibrated_to` (None when the
  schedule records no calibrated range or is dense). Row b's generated tokens sit at 0-based
  indices prompt_lens[b] .. lengths[b] - 1, and the token at index j has position j."""
  if schedule.is_dense or schedule.calibrated_to is None:
    return None
  p = np.asarray(prompt_lens, np.int64)
  n = np.asarray(lengths, np.int64)
  total = int(np.maximum(n - p, 0).sum())
  if total == 0:
    return 0.0
  past = np.maximum(n - np.maximum(p, schedule.calibrated_to), 0).sum()
  return float(past) / total



def attention_spec(schedule: SparsitySchedule, *, max_position: int | None = None,
                   backend: str = "auto", **overrides):
  """The attention strategy a schedule implies: `Dense()` or a `BlockSparse` spec whose static
  `max_budget` covers the schedule up to `max_position` tokens (all bins when None)."""
  from sparrow_jax.models import attention as attn_lib  # models do not import schedules

  if schedule.is_dense:
    return attn_lib.Dense(backend=backend)
  kw = dict(max_budget=max_budget(schedule, max_position), page_size=schedule.page_size,
            landmark=schedule.landmark, reserved_bos=schedule.reserved_bos,
            reserved_recent=schedule.reserved_recent, dense_layers=schedule.dense_layers,
            backend=backend)
  kw.update(overrides)
  return attn_lib.BlockSparse(**kw)
