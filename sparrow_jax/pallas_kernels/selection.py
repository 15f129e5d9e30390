"""Top-k page selection for block-sparse ("Sparrow") decode, from the page scores of
`landmarks`.

One selection is made per (sequence, kv head) and shared by the query heads of its GQA group.
At every decode step the decoder gathers and scores the pages' landmarks (`landmarks.py`; or
scores them in place with the kernel of `page_scores.py`), then
`select_pages` picks the always-attended reserved pages (the first `reserved_bos`, the newest
`reserved_recent`, partial page included) plus the top-`budget` of the other pages by score.
`budget` is traced (per sequence) under the static `max_budget`, so changing it never
recompiles. A sequence with no more pages than `budget + reserved` is attended densely.

`select_decode_pages` chains gather, score and select for one layer of the paged cache.
Teacher-forced sparse attention (`teacher_forced.py`) uses the same `landmarks.score_pages` /
`select_pages` so that position t of a whole-sequence forward selects exactly the pages decode
step t selects.

Axis legend: B batch slots, H query heads, K kv heads, G = H // K (query head h uses kv head
h // G), P physical pages, M logical pages per sequence, S page size, D head dim, N selected
slots.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sparrow_jax.pallas_kernels import page_scores
from sparrow_jax.pallas_kernels.landmarks import as_landmark_kind, gather_landmarks, score_pages


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
    scores = page_scores.page_scores(q, landmarks, page_table, num_pages, kind=kind,
                                     interpret=scorer == "pallas_interpret")  # [B, K, M]
  else:
    gathered = gather_landmarks(landmarks, page_table)  # [B, K, M, D] (or a pair)
    scores = score_pages(q, gathered, kind)  # [B, K, M]
  return select_pages(scores, num_pages, budget, max_budget=max_budget,
                      reserved_bos=reserved_bos, reserved_recent=reserved_recent,
                      slot_multiple=slot_multiple)
