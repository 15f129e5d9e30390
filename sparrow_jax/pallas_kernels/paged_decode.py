"""Dense paged decode attention: a Pallas (Triton lowering) kernel and an XLA path.

Both implement the contract of `reference.dense_decode_reference`: one query token per sequence
attends to all `lengths[b]` tokens of its own pages. They are the dense baseline every sparse
speedup is measured against, and the attention of the layers the schedule keeps dense, so they
read only what dense attention needs, in the cache dtype, accumulating in float32.

`paged_decode` (the kernel) is flash-decoding over a sequence's own pages: one program per
(sequence b, kv head k, split s). The sequence's n = ceil(lengths[b] / S) logical pages are cut
into blocks of `pages_per_block` pages; split s takes blocks s, s + R, s + 2 R, ...
(block-cyclic, so a short sequence still spreads over every split) and its trip count comes
from lengths[b], never from the page-table width M: cost follows the sequence's length, not M
and not the pool size P. The number of splits R is sized to the work (`split_k.num_splits`:
batch x kv heads x blocks of the M-page table) unless the config fixes it. Inside a block the
physical page ids are read from the page table and the K/V pages gathered from the pool, all
inside the kernel. The GQA group (G query heads of kv head k) is padded to 16 rows for
`plgpu.dot`; K/V stay in the cache dtype, the dots and the running max / sum / output are
float32, and only the first Gr = next_pow2(G) rows of the partials are written; masked logits
are `MASK_VALUE` (finite) and masked probabilities exactly 0. The splits are merged in XLA by
`split_k.merge_partials`.

`dense_decode_xla` is the XLA path (the CPU backend): it gathers only the M page-table columns
it is given (the engine buckets M to the longest active sequence), keeps the gathered K/V in
the cache dtype and runs two grouped-GQA einsums with float32 accumulation
(`preferred_element_type`), no upcast copy and no repeat of K/V.

Both round the query to the cache dtype (a tensor-core dot takes one operand dtype) and the
unnormalised probabilities to it before the P.V product, as flash attention does; the float32
`reference.dense_decode_reference` upcasts everything instead and stays the yardstick.
A sequence with lengths[b] = 0 (an empty slot) gets output 0 from both.

Triton rules kept by construction (interpret mode would not catch them): every array loaded,
stored or computed has power-of-two dims (head dim and page size are checked, the GQA group is
padded, pages_per_block is a power of two); page-table reads past the sequence's last page are
clamped to it, so no load leaves the table (the duplicated page is masked); the pipelined K/V
blocks fit in shared memory (`split_k.check_call_shapes`).

Axis legend: B batch, H query heads, K kv heads, G = H // K, Gp padded group, P physical pages,
M logical pages per sequence (page-table width), S page size, D head dim, R = splits, Gr partial
rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparrow_jax.pallas_kernels import split_k
from sparrow_jax.pallas_kernels.reference import MASK_VALUE, check_decode_inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedDecodeConfig(split_k.LaunchConfig):
  """Static launch parameters of the dense paged decode kernel (fields: `split_k.LaunchConfig`).

  The keys a split takes are blocks of a sequence's own pages (never more splits than blocks of
  the page table); 8 pages of 16 tokens per block = 128 rows, a 128 x 128 bf16 tile.
  """


def _paged_decode_kernel(
    q_ref,           # [Gp, D] queries of the group (rows >= G are zero padding)
    k_ref,           # [P, S, D] key pool of this kv head
    v_ref,           # [P, S, D] value pool of this kv head
    page_table_ref,  # [M] int32 logical -> physical ids of this sequence
    length_ref,      # [] int32 tokens in the cache of this sequence
    *refs,           # (aliased poison inputs,) then outputs o [Gr, D], l [Gr], m [Gr]
    sm_scale: float,
    pages_per_block: int,
    k_splits: int,
):
  o_ref, l_ref, m_ref = refs[-3:]
  split = pl.program_id(2)
  rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  table_width = page_table_ref.shape[0]
  block_k = pages_per_block * page_size
  # Tokens past the page table cannot be attended: clamp (the reference masks them too).
  length = jnp.minimum(length_ref[()], table_width * page_size)
  num_pages = (length + page_size - 1) // page_size
  num_blocks = (num_pages + pages_per_block - 1) // pages_per_block
  q = q_ref[...]  # [Gp, D]

  def body(t, carry):
    first = (t * k_splits + split) * pages_per_block  # first logical page of the block
    logical = first + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)  # [ppb]
    # The last block may run past the sequence's pages: read its last page again (masked
    # below) rather than a table entry that may not exist.
    phys = page_table_ref[jnp.minimum(logical, num_pages - 1)]  # [ppb] physical page ids
    k = k_ref[phys].reshape(block_k, head_dim)  # [ppb*S, D] cache dtype
    v = v_ref[phys].reshape(block_k, head_dim)  # [ppb*S, D]
    pos = first * page_size + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, ppb*S]
    return split_k.online_softmax_block(carry, q, k, v, pos < length, sm_scale)

  # Blocks of this split: split, split + k_splits, ... below the sequence's block count.
  trips = jnp.maximum(num_blocks - split + k_splits - 1, 0) // k_splits
  split_k.accumulate_blocks(body, trips, o_ref, l_ref, m_ref, rows=rows, head_dim=head_dim)


def paged_decode_partials(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None,
                          config: PagedDecodeConfig | None = None, interpret: bool = False,
                          poison=None):
  """Runs the kernel; returns the per-split partial results before the merge.

  `poison`: optional (o, l, m) buffers of the output shapes, aliased to the outputs, so a
  test can fill them with NaN and check every element gets written.

  Returns:
    o: [B, K, R, Gp, D] float32 unnormalised outputs; l, m: [B, K, R, Gp] float32 running
    sum and max per split.
  """
  check_decode_inputs(q, k_pages, v_pages, page_table, lengths)
  call = split_k.prepare_call(config, PagedDecodeConfig, q, k_pages, v_pages, page_table,
                             lengths, sm_scale)
  b, kvh, d = q.shape[0], k_pages.shape[0], q.shape[2]
  ppb = call.config.pages_per_block
  # The longest sequence has at most the table's M pages: no more splits than its blocks.
  splits = split_k.num_splits(call.config.k_splits, batch=b, kv_heads=kvh,
                              num_blocks=-(-page_table.shape[1] // ppb),
                              resident_programs=call.config.resident_programs)
  out_shape, out_specs = split_k.partial_outputs(b, kvh, splits, call.rows, d)
  kernel = functools.partial(_paged_decode_kernel, sm_scale=call.sm_scale,
                             pages_per_block=ppb, k_splits=splits)
  return split_k.launch(kernel, name="dense_paged_decode", grid=(b, kvh, splits),
                        args=call.args, in_specs=call.in_specs, out_shape=out_shape,
                        out_specs=out_specs, poison=poison, config=call.config,
                        interpret=interpret)


def paged_decode(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None,
                 config: PagedDecodeConfig | None = None, interpret: bool = False):
  """Dense paged decode attention with the Pallas kernel (the contract of
  `reference.dense_decode_reference`).

  Args:
    q: [B, H, D] queries of the current token (already written into the cache).
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer (D, S powers of two).
    page_table: [B, M] int32 logical -> physical page ids; entries past a sequence's last
      page are never read.
    lengths: [B] int32 tokens in the cache including the current one.
    sm_scale: softmax scale, default 1/sqrt(D).
    config: PagedDecodeConfig (static).
    interpret: run the kernel in the Pallas interpreter (CPU).
  Returns:
    [B, H, D] in q.dtype.
  """
  o, l, m = paged_decode_partials(q, k_pages, v_pages, page_table, lengths, sm_scale=sm_scale,
                                  config=config, interpret=interpret)
  return split_k.merge_partials(o, l, m, q.shape[1]).astype(q.dtype)


def dense_decode_xla(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None):
  """Dense paged decode attention in XLA (the CPU path; same contract as `paged_decode`).

  Reads the M page-table columns it is given (pass a table bucketed to the longest active
  sequence), gathers K/V in the cache dtype and accumulates both einsums in float32.

  Args:
    q: [B, H, D]; k_pages, v_pages: [K, P, S, D]; page_table: [B, M] int32;
    lengths: [B] int32; sm_scale: default 1/sqrt(D).
  Returns:
    [B, H, D] in q.dtype.
  """
  check_decode_inputs(q, k_pages, v_pages, page_table, lengths)
  b, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  g = h // kvh
  m = page_table.shape[1]
  if sm_scale is None:
    sm_scale = d ** -0.5
  heads = jnp.arange(kvh)[None, :, None]  # [1, K, 1]
  table = page_table.astype(jnp.int32)[:, None, :]  # [B, 1, M]
  k = k_pages[heads, table].reshape(b, kvh, m * s, d)  # [B, K, M*S, D] cache dtype
  v = v_pages[heads, table].reshape(b, kvh, m * s, d)
  qg = q.reshape(b, kvh, g, d).astype(k.dtype)  # [B, K, G, D]
  logits = jnp.einsum("bkgd,bktd->bkgt", qg, k,
                      preferred_element_type=jnp.float32) * sm_scale  # [B, K, G, M*S]
  ok = (jnp.arange(m * s) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, M*S]
  logits = jnp.where(ok, logits, MASK_VALUE)
  m_row = logits.max(axis=-1, keepdims=True)  # [B, K, G, 1]
  p = jnp.where(ok, jnp.exp(logits - m_row), 0.0)  # [B, K, G, M*S] unnormalised
  l_row = p.sum(axis=-1)  # [B, K, G]
  o = jnp.einsum("bkgt,bktd->bkgd", p.astype(v.dtype), v,
                 preferred_element_type=jnp.float32)  # [B, K, G, D]
  out = jnp.where(l_row[..., None] > 0, o / jnp.where(l_row > 0, l_row, 1.0)[..., None], 0.0)
  return out.reshape(b, h, d).astype(q.dtype)
