"""Page scores of one decode step from the landmark pool: a Pallas (Triton lowering) kernel.

`selection.select_decode_pages` scores every page of a sequence against the current query
before top-k. Mean landmarks: score[b, k, j] = <qm[b, k], landmark[k, page_table[b, j]]>, qm
the mean of kv head k's GQA group of queries; quest: the max over the group's heads of
sum_c max(q_c * kmax_c, q_c * kmin_c). In XLA that is a gather of the pages' landmarks and a
sum over the head dim, which XLA:GPU emits as one loop fusion (gather, product, the `tree_sum`
adds and the candidate mask) with one thread per score and 128 serial loads: on an H200 at 16
sequences x 32K tokens of Qwen3-1.7B it took 164 us per layer for 135 MB of float32 mean
landmarks (0.8 TB/s), 36% of the sparse decode step and more than the sparse attention itself
(BENCHMARKS.md, GPU suite run 6). This kernel reads each sequence's landmarks through its page
table inside the kernel: one program per (sequence b, kv head k, block of `pages_per_block`
logical pages), whole landmark rows per page, nothing materialised.

The sum over the head dim runs in `landmarks.tree_sum`'s order (pairwise halving: element i
plus element i + D/2, then again on the half), written as reshapes to [rows, 2, D/2] and sums
over the size-2 axis (one add each), so the kernel computes the same float32 operations as the
XLA path; whether a backend contracts a product and an add into one FMA is its own choice, so
scores agree to float32 rounding, not bitwise, across backends (the interpreter on CPU is
tested against `score_pages`).

Blocks past a sequence's last page skip the loads and write zeros; pages j >= num_pages[b]
inside the last block are scored from the last page again (clamped table reads, as the decode
kernels do) and are never selected (`select_pages` masks them).

Axis legend: B batch, H query heads, K kv heads, G = H // K, P physical pages, M logical pages
per sequence (page-table width), D head dim, BM pages per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparrow_jax.pallas_kernels import split_k
from sparrow_jax.pallas_kernels.landmarks import (LandmarkKind, as_landmark_kind,
                                                 group_mean_queries, landmark_arrays, materialize)

DEFAULT_PAGES_PER_BLOCK = 64  # mean: one [64, D] float32 tile of landmark rows
QUEST_PAGES_PER_BLOCK = 32  # quest: two tiles (min, max); 64 rows took 238-255 registers
DEFAULT_NUM_WARPS = 4


def _tree_sum_rows(x):
  """[R, D] -> [R]: `landmarks.tree_sum` over the last axis (D a power of two)."""
  rows, width = x.shape
  while width > 1:
    width //= 2
    x = jnp.sum(x.reshape(rows, 2, width), axis=1)  # x[:, :w] + x[:, w:], one add each
  return x.reshape(rows)


def _page_scores_kernel(q_ref, *refs, kind: str, group: int, pages_per_block: int):
  # q_ref: mean [D] float32 group-mean query; quest [G*D] float32 queries of the group.
  # refs: the landmark pool(s) of this kv head, [P, D] each (mean: one; quest: min, max), then
  # page_table_ref [M] int32 of this sequence, num_pages_ref [] int32 and out_ref [BM] float32.
  *lm_refs, page_table_ref, num_pages_ref, out_ref = refs
  block = pl.program_id(2)
  table_width = page_table_ref.shape[0]
  num_pages = jnp.minimum(num_pages_ref[()], table_width)
  first = block * pages_per_block

  @pl.when(first < num_pages)
  def _():
    logical = first + jax.lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)  # [BM]
    phys = page_table_ref[jnp.minimum(logical, num_pages - 1)]  # [BM] physical page ids
    lms = [ref[phys].astype(jnp.float32) for ref in lm_refs]  # [BM, D] each
    if kind == "mean":
      out_ref[...] = _tree_sum_rows(q_ref[...][None, :] * lms[0])
      return
    kmin, kmax = lms
    d = kmin.shape[1]
    score = None
    for g in range(group):  # max over the group's heads of sum_c max(q_c kmax_c, q_c kmin_c)
      qg = q_ref[pl.ds(g * d, d)][None, :]  # [1, D]
      s = _tree_sum_rows(jnp.maximum(qg * kmax, qg * kmin))
      score = s if score is None else jnp.maximum(score, s)
    out_ref[...] = score

  @pl.when(first >= num_pages)
  def _():
    out_ref[...] = jnp.zeros((pages_per_block,), jnp.float32)


def check_page_scores_args(q, landmarks, page_table, num_pages, pages_per_block):
  if q.ndim != 3:
    raise ValueError(f"q.shape={q.shape}: expected [B, H, D]")
  b, h, d = q.shape
  for lm in landmarks:
    if lm.ndim != 3 or lm.shape[2] != d or lm.shape != landmarks[0].shape:
      raise ValueError(f"landmarks shapes {[x.shape for x in landmarks]}: expected [K, P, {d}] "
                       f"each for q.shape={q.shape}")
  kvh = landmarks[0].shape[0]
  if h % kvh:
    raise ValueError(f"q has H={h} heads: expected a multiple of the K={kvh} kv heads")
  if not split_k.is_pow2(d):
    raise ValueError(f"head dim {d}: the page-score kernel needs a power of two")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table.shape={page_table.shape}: expected [{b}, M]")
  if num_pages.shape != (b,):
    raise ValueError(f"num_pages.shape={num_pages.shape}: expected ({b},)")
  if not isinstance(pages_per_block, int) or not split_k.is_pow2(pages_per_block):
    raise ValueError(f"pages_per_block={pages_per_block!r}: expected a power of two")


def page_scores(q, landmarks, page_table, num_pages, *, kind="mean",
                pages_per_block: int | None = None,
                num_warps: int = DEFAULT_NUM_WARPS, interpret: bool = False):
  """Page scores of one decode step with the Pallas kernel (`landmarks.score_pages` of the
  gathered landmarks, to float32 rounding).

  Args:
    q: [B, H, D] queries of the current token.
    landmarks: the layer's pool: mean [K, P, D]; quest (min, max), each [K, P, D] (float32 or
      bfloat16).
    page_table: [B, M] int32 logical -> physical page ids.
    num_pages: [B] int32 pages that exist per sequence (ceil(length / S)).
    kind: "mean" or "quest" (a `landmarks.LandmarkKind`).
    pages_per_block: pages per program (a power of two; default 64 for mean, 32 for quest
      landmarks); num_warps: Triton launch.
    interpret: run in the Pallas interpreter (CPU).
  Returns:
    [B, K, M] float32: the score of logical page j < num_pages[b]; 0 or a clamped page's
    score past it.
  """
  from jax.experimental.pallas import triton as plgpu

  kind = as_landmark_kind(kind)
  quest = kind is LandmarkKind.QUEST
  lms = landmark_arrays(landmarks, kind, "[K, P, D]")
  if pages_per_block is None:
    pages_per_block = QUEST_PAGES_PER_BLOCK if quest else DEFAULT_PAGES_PER_BLOCK
  num_pages = jnp.asarray(num_pages, jnp.int32)
  check_page_scores_args(q, lms, page_table, num_pages, pages_per_block)
  b, h, d = q.shape
  kvh = lms[0].shape[0]
  group = h // kvh
  m = page_table.shape[1]
  blocks = -(-m // pages_per_block)
  if quest:  # the group's queries, float32, materialised as the XLA path does
    qk = materialize(q.astype(jnp.float32)).reshape(b, kvh, group * d)
  else:
    qk = group_mean_queries(q, kvh)  # [B, K, D]
  kernel = functools.partial(_page_scores_kernel, kind=kind.value, group=group,
                             pages_per_block=pages_per_block)
  lm_spec = pl.BlockSpec((None, *lms[0].shape[1:]), lambda i, j, r: (j, 0, 0))
  out = pl.pallas_call(
      kernel,
      grid=(b, kvh, blocks),
      in_specs=[
          pl.BlockSpec((None, None, qk.shape[2]), lambda i, j, r: (i, j, 0)),  # queries
          *[lm_spec] * len(lms),  # landmark pool(s)
          pl.BlockSpec((None, m), lambda i, j, r: (i, 0)),  # page table
          pl.BlockSpec((None,), lambda i, j, r: (i,)),  # num_pages
      ],
      out_specs=pl.BlockSpec((None, None, pages_per_block), lambda i, j, r: (i, j, r)),
      out_shape=jax.ShapeDtypeStruct((b, kvh, blocks * pages_per_block), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="page_scores",
  )(qk, *lms, page_table.astype(jnp.int32), num_pages)
  return out[:, :, :m]
