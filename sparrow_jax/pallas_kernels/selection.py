"""Page landmarks, page scores and top-k page selection for block-sparse ("Sparrow") decode.

One selection is made per (sequence, kv head) and shared by the query heads of its GQA group.
The pieces, in the order the decoder runs them at every decode step:

  1. `compute_landmarks`: the cache keeps a summary ("landmark") of every page's keys:
     `mean` (Sparrow/Vortex centroid, meaningful for scoring once the page is full) or `quest`
     (per-channel running min and max, partial page included), kept in float32 or, to halve
     what step 2 gathers, in bfloat16 (`round_landmarks`; scoring upcasts to float32).
  2. `gather_landmarks`: landmarks of one layer, pool layout [K, P, D], gathered through the
     page table into per-sequence order [B, K, M, D].
  3. `score_pages`: one float32 score per (sequence, kv head, logical page).
  4. `select_pages`: the always-attended reserved pages (the first `reserved_bos`, the newest
     `reserved_recent`, partial page included) plus the top-`budget` of the other pages by score.
     `budget` is traced (per sequence) under the static `max_budget`, so changing it never
     recompiles. A sequence with no more pages than `budget + reserved` is attended densely.

`select_decode_pages` chains 2-4 for one layer of the paged cache. Teacher-forced sparse
attention (`teacher_forced.py`) uses the same `score_pages` / `select_pages` so that position t
of a whole-sequence forward selects exactly the pages decode step t selects.

Axis legend: B batch slots, H query heads, K kv heads, G = H // K (query head h uses kv head
h // G), P physical pages, M logical pages per sequence, S page size, D head dim, N selected
slots.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
from jax import lax


class LandmarkKind(enum.Enum):
  """Which page summary scores the pages."""
  MEAN = "mean"    # mean key of the page (Sparrow / Vortex centroid)
  QUEST = "quest"  # per-channel min and max of the page's keys (Quest)


def as_landmark_kind(kind) -> LandmarkKind:
  """`LandmarkKind` from an enum member or its string value ("mean" / "quest")."""
  if isinstance(kind, LandmarkKind):
    return kind
  try:
    return LandmarkKind(kind)
  except ValueError:
    raise ValueError(
        f"kind={kind!r}: expected a LandmarkKind or one of "
        f"{[k.value for k in LandmarkKind]}") from None


def num_selected_slots(max_budget: int, reserved_bos: int = 1, reserved_recent: int = 2,
                       slot_multiple: int = 1) -> int:
  """Static number N of selection slots: max_budget + reserved pages, rounded up."""
  _check_selection_args(max_budget, reserved_bos, reserved_recent, slot_multiple)
  n = max_budget + reserved_bos + reserved_recent
  return -(-n // slot_multiple) * slot_multiple


def _check_selection_args(max_budget, reserved_bos, reserved_recent, slot_multiple):
  for name, value, low in (("max_budget", max_budget, 0), ("reserved_bos", reserved_bos, 0),
                           ("reserved_recent", reserved_recent, 0),
                           ("slot_multiple", slot_multiple, 1)):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"{name}={value!r}: expected a static int >= {low}")
  if max_budget + reserved_bos + reserved_recent < 1:
    raise ValueError(
        f"max_budget + reserved_bos + reserved_recent = "
        f"{max_budget + reserved_bos + reserved_recent}: expected at least one slot")


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


def candidate_scores(scores, num_pages, *, reserved_bos: int, reserved_recent: int):
  """Float32 scores [B, K, M] of the pages top-k chooses among, -inf elsewhere: logical pages
  reserved_bos <= j < num_pages - reserved_recent (`num_pages` [B], already clipped to M)."""
  pages = jnp.arange(scores.shape[-1])
  hi = num_pages - reserved_recent  # [B]
  cand = (pages >= reserved_bos) & (pages < hi[:, None])  # [B, M]
  return jnp.where(cand[:, None, :], scores.astype(jnp.float32), -jnp.inf)


def select_pages(scores, num_pages, budget, *, max_budget: int, reserved_bos: int = 1,
                 reserved_recent: int = 2, slot_multiple: int = 1):
  """Logical pages each (sequence, kv head) attends to: reserved pages + top-`budget`.

  Pages 0..num_pages-1 exist; the first `reserved_bos` and the newest `reserved_recent` (the
  partial page included) are always selected and not counted in the budget. Among the other
  pages ("candidates") the `min(budget, max_budget)` best by score are selected. With
  `num_pages <= budget + reserved_bos + reserved_recent` every page is selected (dense).

  Tie-breaking: equal scores rank the lower logical page index first (`lax.top_k` is stable),
  i.e. the same order as `numpy.argsort(-scores, kind="stable")`. Scores must be > -inf.

  Slot layout (N = round_up(max_budget + reserved_bos + reserved_recent, slot_multiple)):
    [0, bos)                     the bos pages 0..bos-1             (valid if the page exists)
    [bos, bos + recent)          pages num_pages-recent..num_pages-1 (valid unless it does not
                                 exist or is already a bos page)
    [bos + recent, +max_budget)  candidates by decreasing score, the first min(budget, #cand)
                                 valid
    rest                         padding, invalid
  so for long sequences the valid slots form a prefix of length bos + recent + budget (the
  Pallas kernel skips the blocks after the last valid slot). Invalid slots hold page 0.
  Valid slots are distinct pages.

  Args:
    scores: [B, K, M] page scores (only pages < num_pages are read).
    num_pages: [B] int, pages that exist per sequence (ceil(length / S)); clipped to [0, M].
    budget: [B] int, traced per-sequence top-k size; clipped to [0, max_budget].
    max_budget: static maximum budget.
    reserved_bos, reserved_recent: static numbers of reserved pages.
    slot_multiple: static; N is rounded up to a multiple of it (the kernel's block x splits).
  Returns:
    page_idx: [B, K, N] int32 logical page ids; valid: [B, K, N] bool.
  """
  _check_selection_args(max_budget, reserved_bos, reserved_recent, slot_multiple)
  if scores.ndim != 3:
    raise ValueError(f"scores.shape={scores.shape}: expected [B, K, M]")
  b, kvh, m = scores.shape
  num_pages = jnp.asarray(num_pages, jnp.int32)
  budget = jnp.asarray(budget, jnp.int32)
  if num_pages.shape != (b,):
    raise ValueError(f"num_pages.shape={num_pages.shape}: expected ({b},)")
  if budget.shape != (b,):
    raise ValueError(f"budget.shape={budget.shape}: expected ({b},)")
  n_slots = num_selected_slots(max_budget, reserved_bos, reserved_recent, slot_multiple)
  num_pages = jnp.clip(num_pages, 0, m)
  budget = jnp.clip(budget, 0, max_budget)

  parts_idx, parts_ok = [], []
  # Reserved bos pages.
  if reserved_bos:
    bos_idx = jnp.broadcast_to(jnp.arange(reserved_bos, dtype=jnp.int32),
                               (b, kvh, reserved_bos))  # [B, K, bos]
    parts_idx.append(bos_idx)
    parts_ok.append(bos_idx < num_pages[:, None, None])
  # Reserved newest pages (the partial page is the newest).
  if reserved_recent:
    rec = num_pages[:, None] - reserved_recent + jnp.arange(reserved_recent)  # [B, recent]
    rec_ok = rec >= reserved_bos  # below: does not exist, or already a bos slot
    parts_idx.append(jnp.broadcast_to(rec[:, None, :], (b, kvh, reserved_recent)))
    parts_ok.append(jnp.broadcast_to(rec_ok[:, None, :], (b, kvh, reserved_recent)))
  # Top-k among the candidates.
  top_k = min(max_budget, m)
  if top_k:
    masked = candidate_scores(scores, num_pages, reserved_bos=reserved_bos,
                              reserved_recent=reserved_recent)  # [B, K, M]
    _, top = lax.top_k(masked, top_k)  # [B, K, top_k]
    n_cand = jnp.maximum(num_pages - reserved_recent - reserved_bos, 0)  # [B]
    take = jnp.minimum(budget, n_cand)  # [B]
    top_ok = jnp.arange(top_k)[None, None, :] < take[:, None, None]  # [B, 1, top_k]
    parts_idx.append(top.astype(jnp.int32))
    parts_ok.append(jnp.broadcast_to(top_ok, (b, kvh, top_k)))
  used = sum(p.shape[-1] for p in parts_idx)
  if n_slots > used:
    parts_idx.append(jnp.zeros((b, kvh, n_slots - used), jnp.int32))
    parts_ok.append(jnp.zeros((b, kvh, n_slots - used), bool))
  page_idx = jnp.concatenate(parts_idx, axis=-1)  # [B, K, N]
  valid = jnp.concatenate(parts_ok, axis=-1)  # [B, K, N]
  page_idx = jnp.where(valid, page_idx, 0).astype(jnp.int32)
  return page_idx, valid


SCORERS = ("xla", "pallas", "pallas_interpret")


def select_decode_pages(q, landmarks, page_table, lengths, budget, *, kind, max_budget: int,
                        page_size: int, reserved_bos: int = 1, reserved_recent: int = 2,
                        slot_multiple: int = 1, scorer: str = "xla"):
  """Selection for one decode step of one layer: gather, score and select.

  `scorer`: "xla" gathers the pages' landmarks and scores them in XLA (`score_pages`);
  "pallas" / "pallas_interpret" score them with the Triton kernel of `page_scores`
  (compiled / in the interpreter), which reads them through the page table without
  materialising the gather (a head dim that is not a power of two stays on XLA). Scores
  agree to float32 rounding between the two.

  Args:
    q: [B, H, D] queries of the current token.
    landmarks: the layer's pool landmarks: mean [K, P, D]; quest (min, max) each [K, P, D].
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 tokens in the cache including the current one.
    budget: [B] int32 traced top-k size per sequence (<= max_budget).
    kind: LandmarkKind (or its string value); max_budget, page_size, reserved_bos,
      reserved_recent, slot_multiple: static, see `select_pages`.
  Returns:
    page_idx: [B, K, N] int32 logical page ids; valid: [B, K, N] bool.
  """
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size={page_size!r}: expected a positive int")
  if scorer not in SCORERS:
    raise ValueError(f"scorer={scorer!r}: expected one of {SCORERS}")
  num_pages = (jnp.asarray(lengths, jnp.int32) + page_size - 1) // page_size  # [B]
  kind = as_landmark_kind(kind)
  d = q.shape[-1]
  if scorer != "xla" and d & (d - 1) == 0:
    from sparrow_jax.pallas_kernels import page_scores
    scores = page_scores.page_scores(q, landmarks, page_table, num_pages, kind=kind,
                                     interpret=scorer == "pallas_interpret")  # [B, K, M]
  else:
    gathered = gather_landmarks(landmarks, page_table)  # [B, K, M, D] (or a pair)
    scores = score_pages(q, gathered, kind)  # [B, K, M]
  return select_pages(scores, num_pages, budget, max_budget=max_budget,
                      reserved_bos=reserved_bos, reserved_recent=reserved_recent,
                      slot_multiple=slot_multiple)
