"""Pallas (Triton lowering) kernel: block-sparse paged decode attention over selected pages.

Flash-decoding over the pages chosen by `selection.select_pages`: one program per
(sequence b, kv head k, split s). The N selection slots are cut into blocks of
`pages_per_block` pages (a compute block of pages_per_block * S key rows); split s processes
blocks s, s + R, s + 2 R, ... (block-cyclic, so a short valid prefix still spreads over all
splits) and stops after the last block holding a valid slot. The number of splits R is sized to
the work (`split_k.num_splits`: batch x kv heads x blocks of slots) unless the config fixes it.
Inside a block the pages are gathered straight from the paged pool by physical id. The
selection is resolved before the launch, in XLA (one small [B, K, N] gather): each slot's
physical page (page table at the selected logical id) and the number of its tokens attended
(0 for an invalid slot, else the page's tokens below lengths[b]). The kernel reads those two
arrays directly, so each block's K/V addresses are one load away, as in the dense kernel;
before (2026-12-05) it loaded the logical ids, then the page-table entries they index, then
K/V: two dependent global round trips per block of 64 keys, serialised in front of every K/V
load (docs/gpu/sparse_kernel_ptx.md has the compiled PTX / TTGIR of both). The query is cast to the cache dtype (one
operand dtype per dot) and the GQA group (G query heads of kv head k) padded to 16 rows for
`plgpu.dot`; only the first Gr = next_pow2(G) rows of the float32 partials (running max / sum /
unnormalised output) are written, and the splits are merged in XLA. Masked logits are
`MASK_VALUE` (finite) and masked probabilities exactly 0, so a split that sees no valid token
merges without NaN.

The pure-jnp reference with the same contract is `reference.sparse_decode_reference`;
`dispatch.sparse_decode_attention` chooses between them. `interpret=True` runs the kernel on CPU.
The TPU twin is `tpu_decode.py`.

Triton rules kept by construction (interpret mode would not catch them): every array loaded,
stored or computed has power-of-two dims (head_dim and page size are checked, the GQA group is
padded, pages_per_block is a power of two); no sort inside the kernel; the pipelined K/V blocks
fit in shared memory (`split_k.check_call_shapes`).

Axis legend: B batch, H query heads, K kv heads, G = H // K, Gp padded dot rows, Gr partial
rows, P physical pages, M logical pages per sequence, S page size, D head dim, N selection slots
(padded to a multiple of pages_per_block), R = splits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparrow_jax.pallas_kernels import split_k
from sparrow_jax.pallas_kernels.reference import check_decode_inputs
from sparrow_jax.pallas_kernels.split_k import merge_partials


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseDecodeConfig(split_k.LaunchConfig):
  """Static launch parameters of the sparse decode kernel (fields: `split_k.LaunchConfig`).

  The keys a split takes are blocks of the selection slots (never more splits than blocks of
  slots); 4 pages per block by default.
  """
  pages_per_block: int = 4

  def slot_multiple(self) -> int:
    """Number of slots the selection is padded to a multiple of (whole compute blocks)."""
    return self.pages_per_block


def _sparse_decode_kernel(
    q_ref,           # [Gp, D] queries of the group (rows >= G are zero padding)
    k_ref,           # [P, S, D] key pool of this kv head
    v_ref,           # [P, S, D] value pool of this kv head
    page_table_ref,  # [M] int32 (unread: the slots come resolved, `resolve_slots`)
    length_ref,      # [] int32 (unread: folded into the slots' token counts)
    phys_ref,        # [N] int32 physical page of each selected slot of (sequence, kv head)
    count_ref,       # [N] int32 tokens of the slot's page attended (0: slot not attended)
    active_ref,      # [] int32 blocks up to and including the last valid slot
    *refs,           # (aliased poison inputs,) then outputs o [Gr, D], l [Gr], m [Gr]
    sm_scale: float,
    pages_per_block: int,
    k_splits: int,
):
  del page_table_ref, length_ref
  o_ref, l_ref, m_ref = refs[-3:]
  split = pl.program_id(2)
  rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  q = q_ref[...]  # [Gp, D]

  def body(t, carry):
    start = pl.multiple_of((t * k_splits + split) * pages_per_block, pages_per_block)
    phys = phys_ref[pl.ds(start, pages_per_block)]  # [ppb] physical page ids
    count = count_ref[pl.ds(start, pages_per_block)]  # [ppb] tokens attended per page
    k = k_ref[phys].reshape(block_k, head_dim)  # [ppb*S, D]
    v = v_ref[phys].reshape(block_k, head_dim)  # [ppb*S, D]
    row = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)  # [ppb, S]
    tok_ok = (row < count[:, None]).reshape(1, block_k)  # [1, ppb*S]
    return split_k.online_softmax_block(carry, q, k, v, tok_ok, sm_scale)

  # Blocks of this split: split, split + k_splits, ... below the active block count.
  trips = jnp.maximum(active_ref[()] - split + k_splits - 1, 0) // k_splits
  split_k.accumulate_blocks(body, trips, o_ref, l_ref, m_ref, rows=rows, head_dim=head_dim)


def resolve_slots(page_table, lengths, page_idx, valid, page_size: int):
  """The selection as the kernel reads it: per slot [B, K, N] int32 its physical page
  (`page_table[b, page_idx]`; an index past the table is clipped: such a slot can only be
  invalid or past the length, and attends nothing) and the number of its page's tokens
  attended, `clip(lengths[b] - page_idx * S, 0, S)`, 0 where the slot is not valid."""
  page_idx = page_idx.astype(jnp.int32)
  table = page_table.astype(jnp.int32)[:, None, :]  # [B, 1, M]
  phys = jnp.take_along_axis(table, page_idx, axis=-1, mode="clip")  # [B, K, N]
  left = lengths.astype(jnp.int32)[:, None, None] - page_idx * page_size
  count = jnp.where(valid, jnp.clip(left, 0, page_size), 0).astype(jnp.int32)
  return phys, count


def sparse_decode_partials(q, k_pages, v_pages, page_table, lengths, page_idx, valid, *,
                           sm_scale=None, config: SparseDecodeConfig | None = None,
                           interpret: bool = False, poison=None):
  """Runs the kernel; returns the per-split partial results before the merge.

  `poison`: optional (o, l, m) buffers of the output shapes, aliased to the outputs, so a
  test can fill them with NaN and check every element gets written.

  Returns:
    o: [B, K, R, Gp, D] float32 unnormalised outputs; l, m: [B, K, R, Gp] float32 running
    sum and max per split.
  """
  check_decode_inputs(q, k_pages, v_pages, page_table, lengths, page_idx, valid)
  call = split_k.prepare_call(config, SparseDecodeConfig, q, k_pages, v_pages, page_table,
                             lengths, sm_scale)
  b, kvh, d = q.shape[0], k_pages.shape[0], q.shape[2]
  ppb = call.config.pages_per_block

  # Pad the slots to whole blocks; padded slots are invalid and hold page 0.
  n = page_idx.shape[-1]
  n_pad = -(-n // ppb) * ppb
  splits = split_k.num_splits(call.config.k_splits, batch=b, kv_heads=kvh,
                              num_blocks=n_pad // ppb,
                              resident_programs=call.config.resident_programs)
  phys, count = resolve_slots(page_table, lengths, page_idx, valid, k_pages.shape[2])
  valid = valid.astype(jnp.int32)
  if n_pad != n:  # padded slots: page 0, nothing attended
    phys, count, valid = (jnp.pad(x, ((0, 0), (0, 0), (0, n_pad - n)))
                          for x in (phys, count, valid))  # [B, K, N]
  # Blocks up to the last valid slot: later blocks are skipped, not loaded.
  last = jnp.max(valid * (jnp.arange(n_pad, dtype=jnp.int32) + 1), axis=-1)  # [B, K]
  active = (last + ppb - 1) // ppb  # [B, K]

  out_shape, out_specs = split_k.partial_outputs(b, kvh, splits, call.rows, d)
  in_specs = call.in_specs + [
      pl.BlockSpec((None, None, n_pad), lambda i, j, r: (i, j, 0)),  # physical pages
      pl.BlockSpec((None, None, n_pad), lambda i, j, r: (i, j, 0)),  # tokens attended
      pl.BlockSpec((None, None), lambda i, j, r: (i, j)),  # active blocks
  ]
  args = call.args + [phys, count, active]
  kernel = functools.partial(_sparse_decode_kernel, sm_scale=call.sm_scale,
                             pages_per_block=ppb, k_splits=splits)
  return split_k.launch(kernel, name="sparse_paged_decode", grid=(b, kvh, splits), args=args,
                        in_specs=in_specs, out_shape=out_shape, out_specs=out_specs,
                        poison=poison, config=call.config, interpret=interpret)


def sparse_decode(q, k_pages, v_pages, page_table, lengths, page_idx, valid, *, sm_scale=None,
                  config: SparseDecodeConfig | None = None, interpret: bool = False):
  """Sparse paged decode attention with the Pallas kernel (same contract as
  `reference.sparse_decode_reference`).

  Args:
    q: [B, H, D] queries of the current token.
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer (D, S powers of two).
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 tokens in the cache including the current one.
    page_idx: [B, K, N] int32 selected logical page ids; valid: [B, K, N] bool.
    sm_scale: softmax scale, default 1/sqrt(D).
    config: SparseDecodeConfig (static).
    interpret: run the kernel in the Pallas interpreter (CPU).
  Returns:
    [B, H, D] in q.dtype.
  """
  o, l, m = sparse_decode_partials(q, k_pages, v_pages, page_table, lengths, page_idx, valid,
                                   sm_scale=sm_scale, config=config, interpret=interpret)
  return merge_partials(o, l, m, q.shape[1]).astype(q.dtype)
