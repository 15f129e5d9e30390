"""Page scores of one decode step from mean landmarks: a Pallas (Triton lowering) kernel.

`selection.select_decode_pages` scores every page of a sequence against the current query
before top-k: score[b, k, j] = <qm[b, k], landmark[k, page_table[b, j]]>, qm the mean of kv head
k's GQA group of queries. In XLA that is a gather of the pages' landmarks and a sum over the
head dim, which XLA:GPU emits as one loop fusion (gather, product, the `tree_sum` adds and the
candidate mask) with one thread per score and 128 serial loads: on an H200 at 16 sequences x
32K tokens of Qwen3-1.7B it took 164 us per layer for 135 MB of float32 landmarks (0.8 TB/s),
36% of the sparse decode step and more than the sparse attention itself (BENCHMARKS.md, GPU
suite run 6). This kernel reads each sequence's landmarks through its page table inside the
kernel: one program per (sequence b, kv head k, block of `pages_per_block` logical pages),
whole 2*D- or 4*D-byte landmark rows per page, nothing materialised.

The sum over the head dim runs in `selection.tree_sum`'s order (pairwise halving: element i
plus element i + D/2, then again on the half), written as reshapes to [rows, 2, D/2] and sums
over the size-2 axis (one add each), so the kernel computes the same float32 operations as the
XLA path; whether a backend contracts a product and an add into one FMA is its own choice, so
scores agree to float32 rounding, not bitwise, across backends (the interpreter on CPU is
tested against `score_pages`).

Blocks past a sequence's last page skip the loads and write zeros; pages j >= num_pages[b]
inside the last block are scored from the last page again (clamped table reads, as the decode
kernels do) and are never selected (`select_pages` masks them). Mean landmarks only (the
default); quest keeps the XLA path.

Axis legend: B batch, K kv heads, P physical pages, M logical pages per sequence (page-table
width), D head dim, BM pages per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparrow_jax.pallas_kernels import split_k

DEFAULT_PAGES_PER_BLOCK = 64
DEFAULT_NUM_WARPS = 4


def _tree_sum_rows(x):
  """[R, D] -> [R]: `selection.tree_sum` over the last axis (D a power of two)."""
  rows, width = x.shape
  while width > 1:
    width //= 2
    x = jnp.sum(x.reshape(rows, 2, width), axis=1)  # x[:, :w] + x[:, w:], one add each
  return x.reshape(rows)


def _page_scores_kernel(q_ref, lm_ref, page_table_ref, num_pages_ref, out_ref, *,
                        pages_per_block: int):
  # q_ref [D] float32 group-mean query; lm_ref [P, D] landmark pool of this kv head;
  # page_table_ref [M] int32 of this sequence; num_pages_ref [] int32; out_ref [BM] float32.
  block = pl.program_id(2)
  table_width = page_table_ref.shape[0]
  num_pages = jnp.minimum(num_pages_ref[()], table_width)
  first = block * pages_per_block

  @pl.when(first < num_pages)
  def _():
    logical = first + jax.lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)  # [BM]
    phys = page_table_ref[jnp.minimum(logical, num_pages - 1)]  # [BM] physical page ids
    lm = lm_ref[phys].astype(jnp.float32)  # [BM, D]
    out_ref[...] = _tree_sum_rows(q_ref[...][None, :] * lm)

  @pl.when(first >= num_pages)
  def _():
    out_ref[...] = jnp.zeros((pages_per_block,), jnp.float32)


def check_page_scores_args(qm, landmarks, page_table, num_pages, pages_per_block):
  if qm.ndim != 3 or landmarks.ndim != 3:
    raise ValueError(f"qm.shape={qm.shape}, landmarks.shape={landmarks.shape}: expected "
                     "[B, K, D] and [K, P, D]")
  b, kvh, d = qm.shape
  if landmarks.shape[0] != kvh or landmarks.shape[2] != d:
    raise ValueError(f"landmarks.shape={landmarks.shape}: expected [{kvh}, P, {d}] for "
                     f"qm.shape={qm.shape}")
  if not split_k.is_pow2(d):
    raise ValueError(f"head dim {d}: the page-score kernel needs a power of two")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table.shape={page_table.shape}: expected [{b}, M]")
  if num_pages.shape != (b,):
    raise ValueError(f"num_pages.shape={num_pages.shape}: expected ({b},)")
  if not isinstance(pages_per_block, int) or not split_k.is_pow2(pages_per_block):
    raise ValueError(f"pages_per_block={pages_per_block!r}: expected a power of two")


def page_scores(qm, landmarks, page_table, num_pages, *,
                pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
                num_warps: int = DEFAULT_NUM_WARPS, interpret: bool = False):
  """Mean-landmark page scores of one decode step with the Pallas kernel.

  Args:
    qm: [B, K, D] float32 mean query of each kv head's GQA group (`score_pages`' `qm`).
    landmarks: [K, P, D] mean landmark pool of one layer (float32 or bfloat16).
    page_table: [B, M] int32 logical -> physical page ids.
    num_pages: [B] int32 pages that exist per sequence (ceil(length / S)).
    pages_per_block: pages per program (a power of two); num_warps: Triton launch.
    interpret: run in the Pallas interpreter (CPU).
  Returns:
    [B, K, M] float32: the score of logical page j < num_pages[b] (as `score_pages` of the
    gathered landmarks, to float32 rounding); 0 or a clamped page's score past it.
  """
  from jax.experimental.pallas import triton as plgpu

  num_pages = jnp.asarray(num_pages, jnp.int32)
  check_page_scores_args(qm, landmarks, page_table, num_pages, pages_per_block)
  b, kvh, d = qm.shape
  m = page_table.shape[1]
  blocks = -(-m // pages_per_block)
  kernel = functools.partial(_page_scores_kernel, pages_per_block=pages_per_block)
  out = pl.pallas_call(
      kernel,
      grid=(b, kvh, blocks),
      in_specs=[
          pl.BlockSpec((None, None, d), lambda i, j, r: (i, j, 0)),  # qm
          pl.BlockSpec((None, *landmarks.shape[1:]), lambda i, j, r: (j, 0, 0)),  # pool
          pl.BlockSpec((None, m), lambda i, j, r: (i, 0)),  # page table
          pl.BlockSpec((None,), lambda i, j, r: (i,)),  # num_pages
      ],
      out_specs=pl.BlockSpec((None, None, pages_per_block), lambda i, j, r: (i, j, r)),
      out_shape=jax.ShapeDtypeStruct((b, kvh, blocks * pages_per_block), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="page_scores",
  )(qm.astype(jnp.float32), landmarks, page_table.astype(jnp.int32), num_pages)
  return out[:, :, :m]
