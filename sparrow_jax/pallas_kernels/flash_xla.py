"""Causal flash attention in XLA for training and prefill: key blocks up to the query chunk only.

Queries are cut into chunks of C; the keys into blocks of the same C. Chunk i visits key blocks
0..i and nothing after it (causal block skipping): blocks j < i need no mask, block i gets the
causal triangle. A running max / sum / output (online softmax, float32) replaces the [C, T]
logits of a chunk, so no [T, T] (or [C, T]) scores are ever built and the work is
n (n + 1) / 2 blocks of C x C instead of the n^2 of full-key chunks. Operands stay in their
dtype (bfloat16 stays bfloat16) with float32 accumulation (`preferred_element_type`); the
probabilities are rounded to the value dtype before the P.V product, as flash attention does.

The gradient is a `jax.custom_vjp` (FlashAttention-2's backward): the forward saves only the
output and the float32 log-sum-exp of every row; the backward revisits the same blocks,
recomputes P from the log-sum-exp, accumulates dQ per chunk and dK / dV per block in float32.
Nothing of size [C, T] is kept between blocks, under `jax.grad` as in the forward.

Block-sparse (teacher-forced Sparrow) attention passes `pages`: the logical pages every
(query, kv head) selected (`page_idx`, `valid`) and which queries attend densely (`dense_q`,
the prompt). A key is attended when its page is selected (or the query is dense) and it is at
or before the query; a key block that no query of the chunk attends is skipped (`lax.cond`),
in the forward and the backward. The selection is an input, not differentiated: top-k indices
carry no gradient.

Every row must attend at least one key (causal: the query's own position; sparse: the newest
page is always selected), which keeps the log-sum-exp finite.

Axis legend: B batch, T sequence length (padded to n * C), n query chunks = key blocks,
C chunk / block size, H query heads, K kv heads, G = H // K, D head dim, S page size,
N selected page slots, Pb = C // S pages per key block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparrow_jax.pallas_kernels.reference import MASK_VALUE

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static parameters of one call (hashable: the custom_vjp's non-differentiable args)."""
  block: int  # C
  sm_scale: float
  page_size: int  # S (sparse only; 0 = dense)


def _split_heads(x, n, c, kvh):
  """[B, n*C, K*G, D] -> [n, B, K, G, C, D] (chunk-major: chunk i is one leading index)."""
  b, _, h, d = x.shape
  return x.reshape(b, n, c, kvh, h // kvh, d).transpose(1, 0, 3, 4, 2, 5)


def _merge_heads(x):
  """[n, B, K, G, C, D] -> [B, n*C, K*G, D]."""
  n, b, kvh, g, c, d = x.shape
  return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * c, kvh * g, d)


def _chunk_pages(pages, i, st: _Static, n_pages):
  """Selected-page mask of query chunk i: [B, K, C, n_pages] bool (dense queries: all)."""
  page_idx, valid, dense_q = pages  # [n, B, C, K, N], [n, B, C, K, N], [n, B, C]
  idx, ok, dense = page_idx[i], valid[i], dense_q[i]
  b, c, kvh, nsel = idx.shape
  rows = jnp.arange(b)[:, None, None, None]
  heads = jnp.arange(kvh)[None, None, :, None]
  qpos = jnp.arange(c)[None, :, None, None]
  hit = jnp.zeros((b, c, kvh, n_pages), jnp.int32).at[rows, qpos, heads, idx].add(
      ok.astype(jnp.int32))  # [B, C, K, Mp] times selected
  sel = (hit > 0) | dense[:, :, None, None]
  return jnp.swapaxes(sel, 1, 2)  # [B, K, C, Mp]


def _block_mask(sel, j, st: _Static, diagonal: bool):
  """Key mask of (chunk, block j): [B, K, 1, C, C] bool, or None (everything attended)."""
  c = st.block
  mask = None
  if sel is not None:
    pb = c // st.page_size
    blk = lax.dynamic_slice_in_dim(sel, j * pb, pb, axis=3)  # [B, K, C, Pb]
    mask = jnp.repeat(blk, st.page_size, axis=3)[:, :, None]  # [B, K, 1, C, C]
  if diagonal:
    tri = (jnp.arange(c)[None, :] <= jnp.arange(c)[:, None])[None, None, None]  # [1,1,1,C,C]
    mask = tri if mask is None else mask & tri
  return mask


def _scores(q_i, k_j, st: _Static, mask):
  s = jnp.einsum("bkgcd,bkjd->bkgcj", q_i, k_j, preferred_element_type=_F32) * st.sm_scale
  return s if mask is None else jnp.where(mask, s, MASK_VALUE)  # [B, K, G, C, C]


def _fwd_chunk(q_i, kh, vh, i, sel, st: _Static):
  """Output [B, K, G, C, D] (q dtype) and log-sum-exp [B, K, G, C] of query chunk i."""
  b, kvh, g, c, d = q_i.shape

  def visit(j, carry, mask):
    m, l, acc = carry
    s = _scores(q_i, kh[j], st, mask)
    m_new = jnp.maximum(m, s.max(axis=-1))  # [B, K, G, C]
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgcj,bkjd->bkgcd", p.astype(vh.dtype), vh[j],
                    preferred_element_type=_F32)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

  def maybe(j, carry, diagonal):
    mask = _block_mask(sel, j, st, diagonal)
    if sel is None:
      return visit(j, carry, mask)
    # A block no query of the chunk attends (sparse) adds nothing: skip its dots.
    return lax.cond(jnp.any(mask), lambda cr: visit(j, cr, mask), lambda cr: cr, carry)

  init = (jnp.full((b, kvh, g, c), MASK_VALUE, _F32), jnp.zeros((b, kvh, g, c), _F32),
          jnp.zeros((b, kvh, g, c, d), _F32))
  carry = lax.fori_loop(0, i, lambda j, cr: maybe(j, cr, False), init)
  m, l, acc = maybe(i, carry, True)
  out = acc / l[..., None]
  return out.astype(q_i.dtype), m + jnp.log(l)


def _forward(q, k, v, pages, st: _Static):
  b, t, h, d = q.shape
  kvh = k.shape[2]
  c = st.block
  n = t // c
  qh, kh, vh = (_split_heads(x, n, c, kvh) for x in (q, k, v))
  kh, vh = kh[:, :, :, 0], vh[:, :, :, 0]  # [n, B, K, C, D]
  n_pages = t // st.page_size if pages is not None else 0

  def one(args):
    i, q_i = args
    sel = _chunk_pages(pages, i, st, n_pages) if pages is not None else None
    return _fwd_chunk(q_i, kh, vh, i, sel, st)

  out, lse = lax.map(one, (jnp.arange(n), qh))  # [n, B, K, G, C, D], [n, B, K, G, C]
  return _merge_heads(out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, pages, st: _Static):
  return _forward(q, k, v, pages, st)[0]


def _flash_fwd(q, k, v, pages, st):
  out, lse = _forward(q, k, v, pages, st)
  return out, (q, k, v, pages, out, lse)


def _flash_bwd(st: _Static, res, dout):
  q, k, v, pages, out, lse = res
  b, t, h, d = q.shape
  kvh = k.shape[2]
  c = st.block
  n = t // c
  qh, kh, vh, doh = (_split_heads(x, n, c, kvh) for x in (q, k, v, dout))
  kh, vh = kh[:, :, :, 0], vh[:, :, :, 0]  # [n, B, K, C, D]
  oh = _split_heads(out, n, c, kvh)
  delta = jnp.sum(doh.astype(_F32) * oh.astype(_F32), axis=-1)  # [n, B, K, G, C]
  n_pages = t // st.page_size if pages is not None else 0

  def chunk(carry, args):
    dk, dv = carry  # [n, B, K, C, D] float32
    i, q_i, do_i, lse_i, delta_i = args
    sel = _chunk_pages(pages, i, st, n_pages) if pages is not None else None

    def visit(j, cr, mask):
      dq_i, dk, dv = cr
      s = _scores(q_i, kh[j], st, mask)
      p = jnp.exp(s - lse_i[..., None])  # [B, K, G, C, C]
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      dv_j = jnp.einsum("bkgcj,bkgcd->bkjd", p.astype(do_i.dtype), do_i,
                        preferred_element_type=_F32)
      dp = jnp.einsum("bkgcd,bkjd->bkgcj", do_i, vh[j], preferred_element_type=_F32)
      ds = p * (dp - delta_i[..., None]) * st.sm_scale  # [B, K, G, C, C] float32
      ds_lo = ds.astype(q_i.dtype)
      dq_i = dq_i + jnp.einsum("bkgcj,bkjd->bkgcd", ds_lo, kh[j], preferred_element_type=_F32)
      dk_j = jnp.einsum("bkgcj,bkgcd->bkjd", ds_lo, q_i, preferred_element_type=_F32)
      dk = lax.dynamic_update_index_in_dim(dk, dk[j] + dk_j, j, 0)
      dv = lax.dynamic_update_index_in_dim(dv, dv[j] + dv_j, j, 0)
      return dq_i, dk, dv

    def maybe(j, cr, diagonal):
      mask = _block_mask(sel, j, st, diagonal)
      if sel is None:
        return visit(j, cr, mask)
      return lax.cond(jnp.any(mask), lambda x: visit(j, x, mask), lambda x: x, cr)

    init = (jnp.zeros(q_i.shape, _F32), dk, dv)
    cr = lax.fori_loop(0, i, lambda j, x: maybe(j, x, False), init)
    dq_i, dk, dv = maybe(i, cr, True)
    return (dk, dv), dq_i

  zeros = jnp.zeros(kh.shape, _F32)
  (dk, dv), dq = lax.scan(chunk, (zeros, zeros),
                          (jnp.arange(n), qh, doh, lse, delta))  # dq [n, B, K, G, C, D]
  dk = _merge_heads(dk[:, :, :, None])  # [B, T, K, D]
  dv = _merge_heads(dv[:, :, :, None])
  dpages = None if pages is None else jax.tree.map(lambda _: None, pages)
  return (_merge_heads(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dpages)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_causal(q, k, v, *, block: int = 256, sm_scale=None, page_idx=None,
                           valid=None, dense_q=None, page_size: int = 0):
  """Causal GQA attention of whole sequences in query chunks over the keys up to each chunk.

  Args:
    q: [B, T, H, D]; k, v: [B, T, K, D] (query head h uses kv head h // (H // K)), any float
      dtype (kept for the dots; float32 softmax statistics and accumulation).
    block: chunk / key block size C (clipped to T rounded up to 8, or to the page size when
      sparse, where it must be a multiple of it); T is zero padded to a multiple of C (padded
      keys come after every real query and are never attended).
    sm_scale: softmax scale, default 1/sqrt(D).
    page_idx, valid: optional [B, T, K, N] selected logical pages of every (query, kv head)
      (block-sparse attention; `selection.select_pages` per position), with
    dense_q: [B, T] bool queries that attend every key before them (default none), and
    page_size: S, tokens per page (a power of two dividing `block`).
  Returns:
    [B, T, H, D] in q.dtype. Differentiable in q, k, v (custom VJP, float32 accumulation).
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  b, t, h, d = q.shape
  if k.shape[:2] != (b, t) or v.shape != k.shape or h % k.shape[2]:
    raise ValueError(f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}: expected "
                     "[B, T, H, D] and [B, T, K, D] with H a multiple of K")
  if not isinstance(block, int) or isinstance(block, bool) or block < 1:
    raise ValueError(f"block={block!r}: expected a positive int")
  sparse = page_idx is not None
  if sparse:
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
      raise ValueError(f"page_size={page_size!r}: expected a power of two")
    if page_idx.shape[:3] != (b, t, k.shape[2]) or valid is None or \
        valid.shape != page_idx.shape:
      raise ValueError(f"page_idx.shape={page_idx.shape}, valid.shape="
                       f"{None if valid is None else valid.shape}: expected "
                       f"[B={b}, T={t}, K={k.shape[2]}, N] both")
  unit = page_size if sparse else 8
  c = min(block, -(-t // unit) * unit)
  c = max(c, unit)
  if sparse and c % page_size:
    raise ValueError(f"block={block} must be a multiple of page_size={page_size}")
  tp = -(-t // c) * c
  pad = tp - t
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
  pages = None
  if sparse:
    if dense_q is None:
      dense_q = jnp.zeros((b, t), bool)
    n = tp // c
    pi = jnp.pad(jnp.asarray(page_idx, jnp.int32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    ok = jnp.pad(jnp.asarray(valid, bool), ((0, 0), (0, pad), (0, 0), (0, 0)))
    # Padded queries attend their own page (the causal triangle keeps their rows finite).
    own = (jnp.arange(tp) // page_size)[None, :, None, None]
    pad_q = (jnp.arange(tp) >= t)[None, :, None, None]
    pi = jnp.where(pad_q & (jnp.arange(pi.shape[-1]) == 0), own, pi)
    ok = ok | (pad_q & (jnp.arange(pi.shape[-1]) == 0))
    dq_ = jnp.pad(jnp.asarray(dense_q, bool), ((0, 0), (0, pad)))
    chunked = lambda x: jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)
    pages = (lax.stop_gradient(chunked(pi)), lax.stop_gradient(chunked(ok)),
             lax.stop_gradient(chunked(dq_)))  # [n, B, C, K, N] x2, [n, B, C]
  st = _Static(block=c, sm_scale=float(d ** -0.5 if sm_scale is None else sm_scale),
               page_size=page_size if sparse else 0)
  return _flash(q, k, v, pages, st)[:, :t]
