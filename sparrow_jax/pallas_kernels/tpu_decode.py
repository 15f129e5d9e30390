"""Pallas Mosaic TPU decode attention: a block-sparse kernel, and dense through jax's own.

`sparse_decode_tpu` is the TPU twin of `sparse_decode.py` (same contract as
`reference.sparse_decode_reference`). One program per (sequence b, kv head k), both grid axes
"parallel" (a megacore chip splits them over its cores). Before the call XLA resolves every
selected slot to its physical page and to the number of tokens it holds (0 for an invalid slot,
< S for the partial newest page), and counts the blocks up to the last attended slot; these
small int32 arrays are scalar-prefetched into SMEM (page and token count packed in one int32:
4 B K N + 4 B K bytes, 540 KB at batch 64 x 8 kv heads x 264 slots). The K/V pools stay in HBM
(`memory_space=pl.ANY`): the kernel walks the active blocks of `pages_per_block` selected pages
in a loop, copying block t + 1's pages HBM -> VMEM (one async copy per page, two buffers and
two DMA semaphores per pool) while it computes on block t. The G query heads of kv head k are one
[G, D] operand (no padding: the MXU takes any row count), the dots accumulate in float32 and
the running max / sum / output are float32 loop carries (online softmax); masked logits are
`MASK_VALUE` (finite) and masked probabilities exactly 0, so an empty selection returns 0.
No split-K: a TPU has one or two TensorCores, and B x K programs already cover them.

`dense_decode_tpu` is the dense baseline: jax's `pallas.ops.tpu.paged_attention` (DESIGN.md
§6: where jax ships the kernel, call it) for 16-bit caches. It applies no softmax scale (folded
into q here), needs a page-table width divisible by its compute block (padded here with the null
page, masked by the lengths) and leaves an empty slot's output unwritten (set to 0 here). It
rounds K and V to bf16 whatever the cache dtype, so a float32 cache runs the block kernel above
over every page of the sequence instead (the dense selection: logical pages 0..ceil(len/S)-1),
which keeps float32 operands.

`interpret=True` runs both in TPU interpret mode on CPU (`pltpu.InterpretParams`: simulated
HBM / VMEM, DMAs and semaphores; it raises on out-of-bounds reads and can detect races), which
is how the tests run them. Interpret mode checks indexing, DMA/semaphore pairing and numerics;
only a TPU checks Mosaic's layout rules (tile-aligned shapes, the [ppb, S, D] -> [ppb*S, D]
reshape), VMEM capacity and speed. `jax.export(..., platforms=["tpu"])` on this CPU runs the
Pallas -> Mosaic lowering (a `tpu_custom_call`), which the tests also check.

Axis legend: B batch, H query heads, K kv heads, G = H // K, P physical pages, M logical pages
per sequence, S page size, D head dim, N selection slots (padded to a multiple of
pages_per_block), T = N / pages_per_block blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparrow_jax.pallas_kernels.reference import MASK_VALUE, check_decode_inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuDecodeConfig:
  """Static parameters of the TPU decode kernels.

  pages_per_block: pages copied to VMEM and attended per step (sparse kernel), and jax's
    `pages_per_compute_block` (dense kernel). 8 pages of 16 x 128 bf16 = 32 KiB per pool and
    buffer: 128 KiB of VMEM double-buffered for K and V.
  """
  pages_per_block: int = 8

  def __post_init__(self):
    v = self.pages_per_block
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"TpuDecodeConfig.pages_per_block={v!r}: expected a positive int")

  def slot_multiple(self) -> int:
    """Number of slots the selection is padded to a multiple of (whole blocks)."""
    return self.pages_per_block


def _interpret_arg(interpret: bool):
  return pltpu.InterpretParams() if interpret else False


def _block_copies(pool_hbm, buf, sem, slot_ref, base, head, slot, ppb, page_size):
  """The async copies of one block: page p of the block (physical id of slot base + p) of kv
  head `head` -> buf[slot, p]; all signal sem[slot]."""
  # The page id through lax.div (see `page_of` in the kernel).
  return [pltpu.make_async_copy(pool_hbm.at[head, lax.div(slot_ref[base + p], page_size + 1)],
                                buf.at[slot, p], sem.at[slot]) for p in range(ppb)]


def _sparse_kernel(
    slot_ref,   # SMEM [B*K*N] int32 phys * (S + 1) + tokens attended (0 = invalid/padding)
    active_ref,  # SMEM [B*K] int32 blocks up to and including the last attended slot
    q_ref,      # VMEM [G, D] queries of the group, cache dtype
    k_hbm,      # HBM [K, P, S, D] key pool
    v_hbm,      # HBM [K, P, S, D] value pool
    o_ref,      # VMEM [G, D] float32 output
    k_buf,      # VMEM [2, ppb, S, D] double buffer
    v_buf,      # VMEM [2, ppb, S, D]
    k_sem,      # DMA semaphores [2]
    v_sem,      # DMA semaphores [2]
    *, sm_scale: float, pages_per_block: int, num_slots: int, kv_heads: int,
):
  b, h = pl.program_id(0), pl.program_id(1)
  ppb = pages_per_block
  rows, head_dim = q_ref.shape
  page_size = k_buf.shape[2]
  block_k = ppb * page_size
  first = (b * kv_heads + h) * num_slots  # flat index of this (sequence, kv head)'s slot 0
  active = active_ref[b * kv_heads + h]

  def copies(t, slot):
    base = first + t * ppb
    return (_block_copies(k_hbm, k_buf, k_sem, slot_ref, base, h, slot, ppb, page_size) +
            _block_copies(v_hbm, v_buf, v_sem, slot_ref, base, h, slot, ppb, page_size))

  @pl.when(active > 0)
  def _():
    for c in copies(0, 0):
      c.start()

  q = q_ref[...]  # [G, D]
  tok = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, ppb*S] row of the block
  # lax.div / lax.rem (truncating; all values are >= 0): `//` and `%` lower through a sign op
  # whose Mosaic rule asks for the TPU generation, which an export from a CPU cannot give.
  page_of, offset = lax.div(tok, page_size), lax.rem(tok, page_size)

  def body(t, carry):
    o_prev, m_prev, l_prev = carry  # [G, D], [G, 1], [G, 1] float32
    slot = t % 2

    @pl.when(t + 1 < active)
    def _():
      for c in copies(t + 1, 1 - slot):
        c.start()

    for c in copies(t, slot):
      c.wait()
    k = k_buf[slot].reshape(block_k, head_dim)  # [ppb*S, D] cache dtype
    v = v_buf[slot].reshape(block_k, head_dim)
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * sm_scale  # [G, ppb*S]
    base = first + t * ppb
    limit = jnp.zeros((1, block_k), jnp.int32)  # tokens attended in each row's page
    for p in range(ppb):
      limit = jnp.where(page_of == p, lax.rem(slot_ref[base + p], page_size + 1), limit)
    tok_ok = offset < limit  # [1, ppb*S]
    logits = jnp.where(tok_ok, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1, keepdims=True))  # [G, 1]
    corr = jnp.exp(m_prev - m_next)
    p_blk = jnp.where(tok_ok, jnp.exp(logits - m_next), 0.0)  # [G, ppb*S]
    l_next = corr * l_prev + p_blk.sum(axis=-1, keepdims=True)
    pv = lax.dot_general(p_blk.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)  # [G, D]
    return corr * o_prev + pv, m_next, l_next

  o0 = jnp.zeros((rows, head_dim), jnp.float32)
  m0 = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((rows, 1), jnp.float32)
  o, _, l = lax.fori_loop(0, active, body, (o0, m0, l0))
  o_ref[...] = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)


def _config(config) -> TpuDecodeConfig:
  config = TpuDecodeConfig() if config is None else config
  if not isinstance(config, TpuDecodeConfig):
    raise ValueError(f"config={config!r}: expected a TpuDecodeConfig")
  return config


def sparse_decode_tpu(q, k_pages, v_pages, page_table, lengths, page_idx, valid, *,
                      sm_scale=None, config: TpuDecodeConfig | None = None,
                      interpret: bool = False):
  """Sparse paged decode attention with the Pallas TPU kernel (the contract of
  `reference.sparse_decode_reference`; an empty selection gives 0).

  Args:
    q: [B, H, D] queries of the current token.
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer.
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 tokens in the cache including the current one.
    page_idx: [B, K, N] int32 selected logical page ids; valid: [B, K, N] bool.
    sm_scale: softmax scale, default 1/sqrt(D).
    config: TpuDecodeConfig (static).
    interpret: run in TPU interpret mode (CPU).
  Returns:
    [B, H, D] in q.dtype.
  """
  check_decode_inputs(q, k_pages, v_pages, page_table, lengths, page_idx, valid)
  config = _config(config)
  b, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  g = h // kvh
  ppb = config.pages_per_block
  if sm_scale is None:
    sm_scale = d ** -0.5
  n = page_idx.shape[-1]
  n_pad = -(-n // ppb) * ppb
  page_idx = page_idx.astype(jnp.int32)
  # Physical page and attended tokens of every slot: the kernel needs no page table.
  phys = jnp.take_along_axis(page_table.astype(jnp.int32)[:, None, :], page_idx,
                             axis=2)  # [B, K, N]
  tokens = jnp.clip(lengths.astype(jnp.int32)[:, None, None] - page_idx * s, 0, s)
  count = jnp.where(valid, tokens, 0)  # [B, K, N]
  # One int32 per slot in SMEM: physical page and attended tokens packed together.
  packed = phys * (s + 1) + count  # [B, K, N]
  if n_pad != n:
    pad = ((0, 0), (0, 0), (0, n_pad - n))
    packed, count = jnp.pad(packed, pad), jnp.pad(count, pad)
  last = jnp.max((count > 0) * (jnp.arange(n_pad, dtype=jnp.int32) + 1), axis=-1)  # [B, K]
  active = (last + ppb - 1) // ppb  # [B, K] blocks to visit
  qg = q.astype(k_pages.dtype).reshape(b, kvh, g, d)  # [B, K, G, D] one dtype per dot

  kernel = functools.partial(_sparse_kernel, sm_scale=float(sm_scale), pages_per_block=ppb,
                             num_slots=n_pad, kv_heads=kvh)
  group_spec = pl.BlockSpec((None, None, g, d), lambda i, j, *_: (i, j, 0, 0))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kvh),
          in_specs=[group_spec, pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=group_spec,
          scratch_shapes=[pltpu.VMEM((2, ppb, s, d), k_pages.dtype),
                          pltpu.VMEM((2, ppb, s, d), v_pages.dtype),
                          pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))]),
      out_shape=jax.ShapeDtypeStruct((b, kvh, g, d), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=_interpret_arg(interpret),
      name="sparse_paged_decode_tpu",
  )(packed.reshape(-1), active.reshape(-1), qg, k_pages, v_pages)
  return out.reshape(b, h, d).astype(q.dtype)


def dense_decode_tpu(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None,
                     config: TpuDecodeConfig | None = None, interpret: bool = False):
  """Dense paged decode attention on TPU (the contract of `reference.dense_decode_reference`;
  an empty slot gives 0): jax's `pallas.ops.tpu.paged_attention` for 16-bit caches, the block
  kernel over every page of the sequence for float32 ones.

  Args:
    q: [B, H, D]; k_pages, v_pages: [K, P, S, D]; page_table: [B, M] int32 (padded here to a
    multiple of pages_per_block with the null page); lengths: [B] int32 (clamped to M * S);
    sm_scale: default 1/sqrt(D); config: TpuDecodeConfig; interpret: TPU interpret mode.
  Returns:
    [B, H, D] in q.dtype.
  """
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  check_decode_inputs(q, k_pages, v_pages, page_table, lengths)
  config = _config(config)
  b, _, d = q.shape
  kvh, _, s, _ = k_pages.shape
  if sm_scale is None:
    sm_scale = d ** -0.5
  m = page_table.shape[1]
  lengths = jnp.minimum(lengths.astype(jnp.int32), m * s)
  if jnp.dtype(k_pages.dtype).itemsize > 2:
    # jax's kernel would round float32 pages to bf16: attend every page with the block kernel.
    pages = jnp.arange(m, dtype=jnp.int32)
    page_idx = jnp.broadcast_to(pages, (b, kvh, m))  # [B, K, M]
    valid = page_idx < ((lengths + s - 1) // s)[:, None, None]
    return sparse_decode_tpu(q, k_pages, v_pages, page_table, lengths, page_idx, valid,
                             sm_scale=sm_scale, config=config, interpret=interpret)
  ppb = config.pages_per_block
  width = -(-m // ppb) * ppb
  table = page_table.astype(jnp.int32)
  if width != m:
    table = jnp.pad(table, ((0, 0), (0, width - m)))  # null page, past every length
  # jax's kernel applies no scale and reads q in float32 for G % 8 != 0: scale in float32.
  q_scaled = q.astype(jnp.float32) * jnp.float32(sm_scale)
  call = functools.partial(paged_attention, pages_per_compute_block=ppb,
                           mask_value=MASK_VALUE)
  if interpret:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      out = call(q_scaled, k_pages, v_pages, lengths, table)
  else:
    out = call(q_scaled, k_pages, v_pages, lengths, table)
  out = jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)
  return out.astype(q.dtype)
