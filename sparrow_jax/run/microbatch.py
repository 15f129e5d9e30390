"""Micro-batches for every phase that processes rollouts: packing, slicing and the driver.

A step's rollouts have long-tailed lengths (RL responses: mean ~half the budget, a few at
the maximum). Padding every row to the longest one wastes about half of the compute, and one
call over the whole batch needs memory for all of it at once. verl answers both with dynamic
batch sizes (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`): sequences sorted by length and
packed into micro-batches by a token budget. This module does the same under JAX's static
shapes:

  plan()          rows of the step batch -> `MicroBatch`es. Rows are sorted by length and
                  packed greedily: either a fixed number of rows per micro-batch
                  (`max_rows`), or as many as fit a per-device token budget (`max_tokens`:
                  padded rows per device x padded length). Each micro-batch is padded only to
                  its own length bucket (`length_bucket`: 8 per octave by default) and its row
                  count to a row bucket (1, 2, 3, 4, 6, 8, 12, ... per device), so the number
                  of compiled shapes stays small while padding stays low.
  gather()        the host arrays of one micro-batch: its rows, the time axis cut or padded to
                  its length, padding rows filled with neutral values (length 1, mask 0).
  run()           the driver: for each micro-batch, gather -> place sharded over the batch axes
                  (data x fsdp) -> a jitted program -> results written back into full host
                  arrays, row for row (in a multi-host run every process holds the whole
                  host batch and reads the results back with a collective). The next micro-batch is dispatched before the previous
                  one's results are fetched, so the host copy overlaps the device.
  padding_frac()  padded / processed tokens of a plan (`batch/padding_frac`).

Loss denominators are those of the whole (mini-)batch, computed by the caller before the
micro-batches run, so micro-batched losses and gradients sum to the one-piece result.

Axis legend: B rows of the step batch, T its longest sequence, R rows of a micro-batch,
L its padded length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

# Values of padding rows / padded positions, by key (default 0). A padding row is one token
# long with nothing to train on; a top-k log-prob pad is "impossible".
PAD_VALUES = {"lengths": 1, "prompt_lens": 1, "prompt_lengths": 1,
              "rollout_topk_logp": -1e9}


def length_bucket(n: int, *, per_octave: int = 8, minimum: int = 16,
                  max_length: int | None = None) -> int:
  """Smallest bucket >= n: `per_octave` evenly spaced sizes per power of two (multiples of
  16 above `minimum`), so a sequence is padded by at most 1/per_octave of its length; never
  more than `max_length` (the longest sequence a run can have), never less than n."""
  n = int(n)
  if per_octave < 1 or per_octave & (per_octave - 1):
    raise ValueError(f"length_bucket: per_octave={per_octave!r}; expected a power of two")
  if n <= minimum:
    return int(minimum)
  octave = 1 << ((n - 1).bit_length() - 1)  # largest power of two < n
  step = max(octave // per_octave, 16)
  bucket = -(-n // step) * step
  return bucket if max_length is None else max(n, min(bucket, int(max_length)))


def rows_bucket(n: int) -> int:
  """Smallest row count >= n among 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two per octave)."""
  n = max(int(n), 1)
  if n <= 2:
    return n
  p = 1 << ((n - 1).bit_length() - 1)  # largest power of two < n
  return p + p // 2 if n <= p + p // 2 else 2 * p


@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """One micro-batch: `index` [r] rows of the step batch (real rows, in packing order),
  padded to `rows` rows (a multiple of the batch divisor) of `length` tokens."""

  index: np.ndarray
  rows: int
  length: int

  @property
  def tokens(self) -> int:
    """Tokens processed (padding included)."""
    return self.rows * self.length


def plan(lengths: Sequence[int], *, divisor: int = 1, max_rows: int | None = None,
         max_tokens: int | None = None, per_octave: int = 8, min_length: int = 16,
         max_length: int | None = None) -> list[MicroBatch]:
  """Pack rows of `lengths` [B] into micro-batches (see the module docstring).

  Args:
    divisor: devices the batch axis is split over (data x fsdp); every micro-batch has a
      multiple of it rows.
    max_rows: global rows per micro-batch (fixed-size micro-batches; the last one is padded).
    max_tokens: per-device token budget (padded rows per device x padded length); a row
      longer than the budget gets a micro-batch of its own. Exactly one of max_rows /
      max_tokens is given.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
    raise ValueError(f"microbatch.plan: lengths {lengths.tolist()[:8]}...: expected [B] ints "
                     ">= 1")
  if (max_rows is None) == (max_tokens is None):
    raise ValueError(f"microbatch.plan: max_rows={max_rows!r}, max_tokens={max_tokens!r}: "
                     "expected exactly one")
  if not isinstance(divisor, int) or divisor < 1:
    raise ValueError(f"microbatch.plan: divisor={divisor!r}; expected a positive int")
  if max_rows is not None and (max_rows < 1 or max_rows % divisor):
    raise ValueError(f"microbatch.plan: max_rows={max_rows} must be a positive multiple of "
                     f"the batch divisor (data x fsdp) {divisor}")
  if max_tokens is not None and max_tokens < 1:
    raise ValueError(f"microbatch.plan: max_tokens={max_tokens!r}; expected > 0")
  bucket = lambda n: length_bucket(n, per_octave=per_octave, minimum=min_length,
                                   max_length=max_length)
  per_dev = lambda n: rows_bucket(-(-n // divisor))  # padded rows per device

  def rows_of(n):
    return max_rows if max_rows is not None else divisor * per_dev(n)

  def fits(n, longest):
    if max_rows is not None:
      return n <= max_rows
    return per_dev(n) * bucket(longest) <= max_tokens

  out, cur = [], []
  for i in np.argsort(lengths, kind="stable"):  # ascending: the newest row is the longest
    if cur and not fits(len(cur) + 1, lengths[i]):
      out.append(MicroBatch(np.asarray(cur), rows_of(len(cur)), bucket(lengths[cur[-1]])))
      cur = []
    cur.append(int(i))
  if cur:
    out.append(MicroBatch(np.asarray(cur), rows_of(len(cur)), bucket(lengths[cur[-1]])))
  return out


def padding_frac(micro: Sequence[MicroBatch], lengths: Sequence[int]) -> float:
  """Padded / processed tokens of a plan (0 for an empty plan)."""
  lengths = np.asarray(lengths)
  processed = sum(m.tokens for m in micro)
  real = sum(int(lengths[m.index].sum()) for m in micro)
  return 1.0 - real / processed if processed else 0.0


def gather(arrays: Mapping[str, np.ndarray], mb: MicroBatch,
           keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
  """Host arrays of one micro-batch: rows `mb.index` (+ padding rows), time axis of every
  [B, T, ...] array cut or padded to `mb.length`; [B] arrays keep their one axis."""
  out = {}
  n = len(mb.index)
  for k in (keys if keys is not None else arrays):
    x = np.asarray(arrays[k])
    pad_value = PAD_VALUES.get(k, 0)
    if x.ndim == 1:
      shape = (mb.rows,)
    else:
      shape = (mb.rows, mb.length) + x.shape[2:]
    buf = np.full(shape, pad_value, x.dtype)
    rows = x[mb.index]
    if x.ndim == 1:
      buf[:n] = rows
    else:
      t = min(mb.length, x.shape[1])
      buf[:n, :t] = rows[:, :t]
    out[k] = buf
  return out


def scatter(full: dict[str, np.ndarray], mb: MicroBatch, result: Mapping[str, Any],
            batch_rows: int, time_len: int) -> None:
  """Write one micro-batch's results (host arrays [R, L, ...] or [R]) into `full`
  ([B, T, ...] / [B], allocated on first use), real rows only."""
  n = len(mb.index)
  for k, v in result.items():
    v = np.asarray(v)
    if k not in full:
      shape = (batch_rows,) if v.ndim == 1 else (batch_rows, time_len) + v.shape[2:]
      full[k] = np.full(shape, PAD_VALUES.get(k, 0), v.dtype)
    if v.ndim == 1:
      full[k][mb.index] = v[:n]
    else:
      t = min(time_len, v.shape[1])
      full[k][mb.index, :t] = v[:n, :t]


def run(fn: Callable[[dict], Mapping[str, jax.Array]], arrays: Mapping[str, np.ndarray],
        micro: Sequence[MicroBatch], *, place: Callable[[dict], dict],
        keys: Sequence[str] | None = None, prepare: Callable[[dict, MicroBatch], dict] | None
        = None, fetch: Callable[[Any], Any] = jax.device_get) -> dict[str, np.ndarray]:
  """Run `fn` (a jitted program of one placed micro-batch -> dict of [R, L, ...] / [R]
  arrays) over every micro-batch of `micro` and return the results as full host arrays
  [B, T, ...] / [B] (B, T: those of `arrays["tokens"]`). `place` puts a host micro-batch on
  the devices (sharded over the batch axes); `prepare(inputs, mb)` may add inputs computed on
  the host per micro-batch (e.g. page budgets). `fetch` reads results back to the host (a
  multi-host run all-gathers them: `distributed.fetch`)."""
  b, t = np.shape(arrays["tokens"])[:2]
  full: dict[str, np.ndarray] = {}
  pending = None
  for mb in micro:
    inputs = gather(arrays, mb, keys)
    if prepare is not None:
      inputs = prepare(inputs, mb)
    res = fn(place(inputs))
    if pending is not None:  # fetch the previous micro-batch while this one runs
      scatter(full, pending[0], fetch(pending[1]), b, t)
    pending = (mb, res)
  if pending is not None:
    scatter(full, pending[0], fetch(pending[1]), b, t)
  return full
