"""Completions on the wire between processes: fixed-size arrays that a collective can gather.

A multi-host rollout (`run/distributed.py: gather_completions`) packs each process's
completions into arrays of one shape on every process (`pack_completions`: rows padded with
index -1, tokens padded to the longest), all-gathers them and unpacks every process's rows
into one list in request order (`unpack_completions`). `gather_completions` is the exchange
itself, over any `allgather` (the host collective in a job; a stub in the tests).

Packed fields (R = rows, L = tokens, k = top-k width, H = detection hidden size):
index / n / finish / preemptions / pruned / detect_index [R] int32, quality_logit [R]
float32 (NaN: none), tokens [R, L] int32, logprobs [R, L] float32, topk_ids [R, L, k] int32,
topk_logprobs [R, L, k] float32, hidden [R, H] float32, has_hidden [R] int32.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

FINISH = ("stop", "length", "context", "pruned")  # Completion.finish_reason codes


def pack_completions(comps: Sequence[Any], index: Sequence[int], *, rows: int, length: int,
                     topk: int, hidden: int = 0) -> dict[str, np.ndarray]:
  """Completions as fixed-size arrays of `rows` rows of `length` tokens (padding rows have
  index -1). `index`: each completion's position in the global request list. `topk` /
  `hidden`: top-k width / detection hidden size (0: none)."""
  if len(comps) > rows:
    raise ValueError(f"pack_completions: {len(comps)} completions > rows={rows}")
  out = {"index": np.full((rows,), -1, np.int32), "n": np.zeros((rows,), np.int32),
         "finish": np.zeros((rows,), np.int32), "preemptions": np.zeros((rows,), np.int32),
         "pruned": np.zeros((rows,), np.int32), "detect_index": np.full((rows,), -1, np.int32),
         "quality_logit": np.full((rows,), np.nan, np.float32),
         "tokens": np.zeros((rows, length), np.int32),
         "logprobs": np.zeros((rows, length), np.float32),
         "topk_ids": np.zeros((rows, length, topk), np.int32),
         "topk_logprobs": np.zeros((rows, length, topk), np.float32),
         "hidden": np.zeros((rows, hidden), np.float32),
         "has_hidden": np.zeros((rows,), np.int32)}
  for r, (c, j) in enumerate(zip(comps, index)):
    n = len(c.token_ids)
    if n > length:
      raise ValueError(f"pack_completions: completion {c.request_id!r} has {n} tokens > "
                       f"length={length}")
    out["index"][r], out["n"][r] = j, n
    out["finish"][r] = FINISH.index(c.finish_reason)
    out["preemptions"][r], out["pruned"][r] = c.preemptions, int(c.pruned)
    out["tokens"][r, :n], out["logprobs"][r, :n] = c.token_ids, c.logprobs
    if topk and c.topk_ids is not None:
      out["topk_ids"][r, :n], out["topk_logprobs"][r, :n] = c.topk_ids, c.topk_logprobs
    if c.quality_logit is not None:
      out["quality_logit"][r] = c.quality_logit
    out["detect_index"][r] = c.detect_index
    if hidden and c.detect_hidden is not None:
      out["hidden"][r], out["has_hidden"][r] = np.ravel(c.detect_hidden), 1
  return out


def unpack_completions(packed: Mapping[str, np.ndarray], requests: Sequence[Any], *,
                       topk: int, make: Callable[..., Any]) -> list:
  """The inverse of `pack_completions` over stacked packs ([P, rows, ...] or [rows, ...]):
  one completion per request, in request order (`make` = engine.Completion; prompt ids
  come from `requests`). Raises ValueError when a request has no completion or several."""
  stacked = np.ndim(packed["index"]) == 2  # [P, rows]: merge the process axis
  flat = {k: np.asarray(v) for k, v in packed.items()}
  if stacked:
    flat = {k: v.reshape((v.shape[0] * v.shape[1],) + v.shape[2:]) for k, v in flat.items()}
  out: list = [None] * len(requests)
  for r in np.flatnonzero(flat["index"] >= 0):
    j, n = int(flat["index"][r]), int(flat["n"][r])
    if out[j] is not None:
      raise ValueError(f"gathered completions: request {j} came back twice")
    q = float(flat["quality_logit"][r])
    out[j] = make(request_id=requests[j].request_id,
                  prompt_ids=np.asarray(requests[j].prompt_ids, np.int32),
                  token_ids=flat["tokens"][r, :n].copy(), logprobs=flat["logprobs"][r, :n].copy(),
                  finish_reason=FINISH[int(flat["finish"][r])],
                  topk_ids=flat["topk_ids"][r, :n].copy() if topk else None,
                  topk_logprobs=flat["topk_logprobs"][r, :n].copy() if topk else None,
                  preemptions=int(flat["preemptions"][r]), pruned=bool(flat["pruned"][r]),
                  quality_logit=None if np.isnan(q) else q,
                  detect_hidden=(flat["hidden"][r].copy() if flat["has_hidden"][r] else None),
                  detect_index=int(flat["detect_index"][r]))
  missing = [j for j, c in enumerate(out) if c is None]
  if missing:
    raise ValueError(f"gathered completions: no process returned requests {missing[:8]}")
  return out


def gather_completions(local: Sequence[Any], index: Sequence[int], requests: Sequence[Any], *,
                       topk: int, hidden: int = 0, make: Callable[..., Any],
                       allgather: Callable[[Any], Any]) -> list:
  """Every process's completions (`local`, at global request positions `index`) gathered so
  each process holds all of them, in request order: two collectives, the sizes first, then
  the packs padded to the largest. `allgather` stacks every process's host pytree on a
  leading process axis."""
  sizes = allgather(np.asarray([len(local), max([len(c.token_ids) for c in local] or [0])],
                               np.int32))  # [P, 2]
  rows, length = int(np.max(sizes[:, 0])), max(int(np.max(sizes[:, 1])), 1)
  packed = pack_completions(local, index, rows=max(rows, 1), length=length, topk=topk,
                            hidden=hidden)
  return unpack_completions(allgather(packed), requests, topk=topk, make=make)
