"""Dense paged decode attention in XLA without a materialised K/V gather (the CPU path).

`paged_decode.dense_decode_xla` gathers every page-table column of the batch into a
[B, K, M*S, D] copy of K and of V before its two dots: at 4K tokens the gather writes and the
dots re-read as many bytes again as the pages hold, and on a CPU the step streams ~3 GB/s
of useful bytes. Here a `lax.while_loop` walks the page table in blocks of
`pages_per_block` pages: each iteration gathers one block of pages ([B, K, Pb*S, D], small
enough to stay in cache), scores it and folds it into a running max / sum / output (online
softmax, float32), so every K/V byte comes from memory once. The trip count is
ceil(max(lengths) / (Pb*S)) (traced): blocks past the longest sequence are never visited.

Same contract and numerics as `paged_decode.dense_decode_xla` (and `paged_decode`): K/V in
the cache dtype, the query rounded to it, float32 scores and accumulation, the unnormalised
probabilities rounded to the value dtype before P.V; `reference.dense_decode_reference` is
the float32 yardstick. A slot with lengths[b] = 0 gets output 0.

Axis legend: B batch, H query heads, K kv heads, G = H // K, P physical pages, M logical
pages (page-table width), S page size, D head dim, Pb pages per block.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sparrow_jax.pallas_kernels.reference import MASK_VALUE

_F32 = jnp.float32


def dense_decode_blocked(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None,
                         pages_per_block: int = 16):
  """Dense decode attention of one token per sequence, page block by page block.

  Args:
    q: [B, H, D] queries of the current token (already written into the cache).
    k_pages, v_pages: [K, P, S, D] paged key / value pool of one layer (cache dtype).
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 tokens in the cache including the current one (0 = empty slot).
    sm_scale: softmax scale, default 1/sqrt(D).
    pages_per_block: Pb, pages per loop iteration (speed knob; same result).
  Returns:
    [B, H, D] in q.dtype.
  """
  if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
    raise ValueError(f"q.shape={q.shape}, k_pages.shape={k_pages.shape}, v_pages.shape="
                     f"{v_pages.shape}: expected [B, H, D] and [K, P, S, D] twice")
  b, h, d = q.shape
  kvh, _, s, dk = k_pages.shape
  if dk != d or h % kvh:
    raise ValueError(f"q.shape={q.shape} does not fit k_pages.shape={k_pages.shape}: "
                     "expected the same D and H a multiple of K")
  if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"page_table.shape={page_table.shape}, lengths.shape={lengths.shape}: "
                     f"expected [B={b}, M] and [B={b}]")
  if not isinstance(pages_per_block, int) or pages_per_block < 1:
    raise ValueError(f"pages_per_block={pages_per_block!r}: expected a positive int")
  g = h // kvh
  m = page_table.shape[1]
  pb = min(pages_per_block, m)
  nb = -(-m // pb)
  if sm_scale is None:
    sm_scale = d ** -0.5
  table = page_table.astype(jnp.int32)
  if nb * pb != m:  # padded columns point at page 0 and lie past every length: masked
    table = jnp.pad(table, ((0, 0), (0, nb * pb - m)))
  lengths = lengths.astype(jnp.int32)
  qg = q.reshape(b, kvh, g, d).astype(k_pages.dtype)  # [B, K, G, D]
  heads = jnp.arange(kvh)[None, :, None]  # [1, K, 1]
  offs = jnp.arange(pb * s, dtype=jnp.int32)  # [Pb*S] key offsets inside a block
  trips = jnp.minimum((jnp.max(lengths) + pb * s - 1) // (pb * s), nb)

  def body(carry):
    j, m_run, l_run, acc = carry
    cols = lax.dynamic_slice_in_dim(table, j * pb, pb, axis=1)[:, None, :]  # [B, 1, Pb]
    kb = k_pages[heads, cols].reshape(b, kvh, pb * s, d)  # [B, K, Pb*S, D] one block
    vb = v_pages[heads, cols].reshape(b, kvh, pb * s, d)
    # Scores as [Pb*S, G] per (b, k): the keys are the dot's tall left operand. On XLA:CPU this
    # runs ~1.5x faster than the [G, D] x [Pb*S, D]^T form (measured at G=2, D=128, 256 keys),
    # and the softmax and P.V below stay in the same layout (no transpose).
    sc = jnp.einsum("bktd,bkgd->bktg", kb, qg, preferred_element_type=_F32) * sm_scale
    ok = ((j * pb * s + offs)[None, :] < lengths[:, None])[:, None, :, None]  # [B,1,Pb*S,1]
    sc = jnp.where(ok, sc, MASK_VALUE)
    m_new = jnp.maximum(m_run, sc.max(axis=-2))  # [B, K, G]
    p = jnp.where(ok, jnp.exp(sc - m_new[..., None, :]), 0.0)  # [B, K, Pb*S, G]
    alpha = jnp.exp(m_run - m_new)
    pv = jnp.einsum("bktg,bktd->bkgd", p.astype(vb.dtype), vb, preferred_element_type=_F32)
    return j + 1, m_new, alpha * l_run + p.sum(axis=-2), alpha[..., None] * acc + pv

  init = (jnp.int32(0), jnp.full((b, kvh, g), MASK_VALUE, _F32), jnp.zeros((b, kvh, g), _F32),
          jnp.zeros((b, kvh, g, d), _F32))
  _, _, l_run, acc = lax.while_loop(lambda c: c[0] < trips, body, init)
  out = jnp.where(l_run[..., None] > 0, acc / jnp.where(l_run > 0, l_run, 1.0)[..., None], 0.0)
  return out.reshape(b, h, d).astype(q.dtype)
