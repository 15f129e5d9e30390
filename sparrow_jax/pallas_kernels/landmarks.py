"""Page landmarks and page scores for block-sparse ("Sparrow") decode and teacher-forced attention.

The cache keeps a summary ("landmark") of every page's keys; a query scores the pages through
their landmarks, and `selection.select_pages` takes the top-k of those scores. One score is
made per (sequence, kv head) and shared by the query heads of its GQA group:

  1. `compute_landmarks`: `mean` (Sparrow/Vortex centroid, meaningful for scoring once the
     page is full) or `quest` (per-channel running min and max, partial page included), kept
     in float32 or, to halve what step 2 gathers, in bfloat16 (`round_landmarks`; scoring
     upcasts to float32).
  2. `gather_landmarks`: landmarks of one layer, pool layout [K, P, D], gathered through the
     page table into per-sequence order [B, K, M, D].
  3. `score_pages`: one float32 score per (sequence, kv head, logical page), in XLA. The
     Pallas kernel of `page_scores` computes the same scores without the gather of step 2.

Every sum here is a `tree_sum` (a fixed pairwise order), so decode (one query) and the
teacher-forced path (a chunk of queries) get bitwise identical landmarks and scores, hence
identical page selections. This module sits below both `selection` and `page_scores`.

Axis legend: B batch slots, H query heads, K kv heads, G = H // K (query head h uses kv head
h // G), P physical pages, M logical pages per sequence, S page size, D head dim.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
from jax import lax

from sparrow_jax.args import as_member


class LandmarkKind(enum.Enum):
  """Which page summary scores the pages."""
  MEAN = "mean"    # mean key of the page (Sparrow / Vortex centroid)
  QUEST = "quest"  # per-channel min and max of the page's keys (Quest)


def as_landmark_kind(kind) -> LandmarkKind:
  """`LandmarkKind` from an enum member or its string value ("mean" / "quest")."""
  return as_member(LandmarkKind, kind, "kind")


def tree_sum(x, axis: int):
  """Sum over `axis` by pairwise halving (zero padded to a power of two).

  Unlike `jnp.sum`, whose reduction order XLA picks per shape and fusion, the result depends
  only on the values being summed: decode (one query) and teacher-forced scoring (a chunk of
  queries) then get bitwise identical landmarks and scores, hence identical page selections.
  """
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def round_landmarks(landmarks, dtype):
  """Landmarks rounded to the dtype the cache keeps them in (float32 or bfloat16), returned
  as float32: what a decode step reads back. Teacher-forced selection rounds its freshly
  computed landmarks the same way, so both select the same pages."""
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    return landmarks
  rnd = lambda x: x.astype(dtype).astype(jnp.float32)
  return tuple(rnd(x) for x in landmarks) if isinstance(landmarks, tuple) else rnd(landmarks)


def compute_landmarks(keys, num_valid, kind):
  """Landmark of pages from their keys, over the first `num_valid` keys of each page.

  Args:
    keys: [..., S, D] keys of the pages (any float dtype); rows at or past `num_valid` are
      ignored whatever they hold.
    num_valid: [...] int, number of keys written in each page (0..S).
    kind: LandmarkKind (or "mean" / "quest").
  Returns:
    mean: [..., D] float32 mean of the valid keys.
    quest: (min, max), each [..., D] float32, per-channel min / max of the valid keys.
    A page with no valid key gets zeros.
  """
  kind = as_landmark_kind(kind)
  if keys.ndim < 2:
    raise ValueError(f"keys.shape={keys.shape}: expected [..., S, D]")
  s = keys.shape[-2]
  num_valid = jnp.asarray(num_valid, jnp.int32)
  if num_valid.shape != keys.shape[:-2]:
    raise ValueError(
        f"num_valid.shape={num_valid.shape}: expected keys.shape[:-2]={keys.shape[:-2]}")
  keys = keys.astype(jnp.float32)
  row_ok = (jnp.arange(s) < num_valid[..., None])[..., None]  # [..., S, 1]
  has_any = (num_valid > 0)[..., None]  # [..., 1]
  if kind is LandmarkKind.MEAN:
    total = tree_sum(jnp.where(row_ok, keys, 0.0), axis=-2)  # [..., D]
    count = jnp.maximum(num_valid, 1).astype(jnp.float32)[..., None]
    return total / count
  lo = jnp.min(jnp.where(row_ok, keys, jnp.inf), axis=-2)  # [..., D]
  hi = jnp.max(jnp.where(row_ok, keys, -jnp.inf), axis=-2)  # [..., D]
  return jnp.where(has_any, lo, 0.0), jnp.where(has_any, hi, 0.0)


def gather_landmarks(landmarks, page_table):
  """Per-sequence landmarks of one layer from the pool.

  Args:
    landmarks: mean: [K, P, D]; quest: (min, max), each [K, P, D].
    page_table: [B, M] int32 logical -> physical page ids.
  Returns:
    mean: [B, K, M, D]; quest: (min, max), each [B, K, M, D].
  """
  def one(lm):
    if lm.ndim != 3:
      raise ValueError(f"landmarks shape {lm.shape}: expected [K, P, D]")
    return jnp.swapaxes(lm[:, page_table], 0, 1)  # [B, K, M, D]
  if isinstance(landmarks, (tuple, list)):
    return tuple(one(lm) for lm in landmarks)
  return one(landmarks)


def materialize(x):
  """`x` (float32, [..., D]), computed once before its per-page uses.

  XLA:CPU fuses a cheap-looking producer into every consumer and recomputes it per output
  element: the query's RoPE (and, for mean landmarks, the mean over its GQA group) would be
  redone for every page scored, ~3x the scoring time of a layer at 8K tokens in the engine.
  XLA does not fuse a dot into a loop fusion, so `x` goes through a product with the D x D
  identity at full float32 precision: every output is `x_i * 1` plus exact zeros, i.e. `x`
  bit for bit for finite values (a -0.0 becomes +0.0; an infinite entry turns its row NaN,
  where the score would be inf or NaN anyway). Neither `lax.optimization_barrier` (dropped by
  the CPU pipeline) nor a max over two copies (simplified away) stops the fusion.
  """
  eye = jnp.eye(x.shape[-1], dtype=jnp.float32)
  return jnp.einsum("...d,de->...e", x.astype(jnp.float32), eye, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def group_mean_queries(q, kv_heads: int):
  """[..., H, D] queries -> [..., K, D] float32 mean of each kv head's GQA group (a
  `tree_sum`, materialised): what mean landmarks are scored against."""
  h, d = q.shape[-2:]
  g = h // kv_heads
  qg = q.astype(jnp.float32).reshape(*q.shape[:-2], kv_heads, g, d)  # [..., K, G, D]
  return materialize(tree_sum(qg, axis=-2) / g)


def landmark_arrays(landmarks, kind, dims: str) -> tuple:
  """`landmarks` as a tuple of arrays after checking they fit `kind` (a LandmarkKind): one
  array for mean, a (min, max) pair for quest; `dims` names their shape in the error."""
  if kind is LandmarkKind.QUEST:
    if not isinstance(landmarks, (tuple, list)) or len(landmarks) != 2:
      raise ValueError(f"landmarks of type {type(landmarks).__name__}: quest expects a "
                       f"(min, max) pair of {dims} arrays")
    return tuple(landmarks)
  if isinstance(landmarks, (tuple, list)):
    raise ValueError(f"landmarks is a tuple: mean expects one {dims} array")
  return (landmarks,)


def score_pages(q, landmarks, kind):
  """Scores of pages for the current queries, one per kv head (shared by its GQA group).

  mean:  score = <mean of the group's queries, landmark>.
  quest: score = max over the group's heads of sum_c max(q_c * kmax_c, q_c * kmin_c).
  No softmax scale is applied: it does not change the ranking. Sums are `tree_sum`s, so a
  score does not depend on the shape of the batch it is computed in (decode step and
  teacher-forced chunk agree bitwise).

  Args:
    q: [..., H, D] queries.
    landmarks: mean [..., K, M, D]; quest (min, max) each [..., K, M, D]. Leading dims
      broadcast against q's (teacher-forced scoring passes [B, 1, K, M, D] with q [B, C, H, D]).
    kind: LandmarkKind (or its string value).
  Returns:
    [..., K, M] float32 scores.
  """
  kind = as_landmark_kind(kind)
  ref = landmark_arrays(landmarks, kind, "[..., K, M, D]")[0]
  h, d = q.shape[-2:]
  kvh = ref.shape[-3]
  if ref.shape[-1] != d:
    raise ValueError(f"landmarks head dim {ref.shape[-1]}: expected q head dim {d}")
  if h % kvh:
    raise ValueError(f"q has H={h} heads: expected a multiple of the K={kvh} kv heads")
  if kind is LandmarkKind.MEAN:
    qm = group_mean_queries(q, kvh)  # [..., K, D]
    return tree_sum(qm[..., None, :] * landmarks.astype(jnp.float32), axis=-1)  # [..., K, M]
  qg = q.astype(jnp.float32).reshape(*q.shape[:-2], kvh, h // kvh, d)  # [..., K, G, D]
  kmin, kmax = (x.astype(jnp.float32)[..., :, None, :, :] for x in landmarks)  # [..,K,1,M,D]
  qe = materialize(qg)[..., None, :]  # [..., K, G, 1, D]
  per_head = tree_sum(jnp.maximum(qe * kmax, qe * kmin), axis=-1)  # [..., K, G, M]
  return jnp.max(per_head, axis=-2)  # [..., K, M]


