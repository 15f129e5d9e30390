"""Pure-jnp reference implementations of paged decode attention (float32 accumulation).

These are both the CPU execution path and the references the Pallas kernels are tested against:
`dense_decode_reference` attends to every cached token, `sparse_decode_reference` only to the
pages chosen by `selection.select_pages` (the contract of the Pallas kernel in
`sparse_decode.py`).

Axis legend: B batch (sequence slots), H query heads, K kv heads, G = H // K query heads per
kv head (GQA group; query head h uses kv head h // G), P physical pages in the pool,
M logical pages per sequence (page-table width), S page size (tokens per page), D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Large negative finite mask value: a fully masked row stays finite (no NaN from -inf - -inf).
MASK_VALUE = 0.7 * float(jnp.finfo(jnp.float32).min)


def check_decode_inputs(q, k_pages, v_pages, page_table, lengths, page_idx=None, valid=None):
  """Shape checks of the paged decode contract every decode backend shares (dense: q, pools,
  table, lengths; sparse: also the selection `page_idx` / `valid`); the ValueError names the
  array and the shape it expected."""
  if q.ndim != 3:
    raise ValueError(f"q.shape={q.shape}: expected [B, H, D]")
  b, h, d = q.shape
  if k_pages.ndim != 4 or k_pages.shape[-1] != d:
    raise ValueError(f"k_pages.shape={k_pages.shape}: expected [K, P, S, D={d}]")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages.shape={v_pages.shape}: expected k_pages.shape={k_pages.shape}")
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages.dtype={v_pages.dtype}: expected k_pages.dtype={k_pages.dtype}")
  kvh = k_pages.shape[0]
  if h % kvh:
    raise ValueError(f"q has H={h} heads: expected a multiple of K={kvh} kv heads")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table.shape={page_table.shape}: expected [B={b}, M]")
  if lengths.shape != (b,):
    raise ValueError(f"lengths.shape={lengths.shape}: expected ({b},)")
  if page_idx is None and valid is None:
    return
  if page_idx is None or page_idx.ndim != 3 or page_idx.shape[:2] != (b, kvh):
    shape = None if page_idx is None else page_idx.shape
    raise ValueError(f"page_idx.shape={shape}: expected [B={b}, K={kvh}, N]")
  if valid is None or valid.shape != page_idx.shape:
    raise ValueError(f"valid.shape={None if valid is None else valid.shape}: expected "
                     f"page_idx.shape={page_idx.shape}")


def dense_decode_reference(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None):
  """Attention of one query token per sequence over all of its cached tokens.

  Args:
    q: [B, H, D] queries of the current token (already written into the cache).
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer.
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 number of valid tokens per sequence (including the current one).
    sm_scale: softmax scale, default 1/sqrt(D).
  Returns:
    [B, H, D] in q.dtype.
  """
  b, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  g = h // kvh
  m = page_table.shape[1]
  if sm_scale is None:
    sm_scale = d ** -0.5
  k = k_pages[:, page_table].reshape(kvh, b, m * s, d)  # [K, B, M*S, D]
  v = v_pages[:, page_table].reshape(kvh, b, m * s, d)
  qg = q.reshape(b, kvh, g, d).astype(jnp.float32)
  logits = jnp.einsum("bkgd,kbtd->bkgt", qg, k.astype(jnp.float32)) * sm_scale
  valid = jnp.arange(m * s)[None, :] < lengths[:, None]  # [B, M*S]
  logits = jnp.where(valid[:, None, None, :], logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgt,kbtd->bkgd", probs, v.astype(jnp.float32))
  return out.reshape(b, h, d).astype(q.dtype)


def gather_selected_pages(pages, page_table, page_idx):
  """Selected pages of every (sequence, kv head) from the pool.

  Args:
    pages: [K, P, S, D] key or value pool of one layer.
    page_table: [B, M] int32 logical -> physical page ids.
    page_idx: [B, K, N] int32 selected logical page ids.
  Returns:
    [B, K, N, S, D] in pages.dtype.
  """
  kvh = pages.shape[0]
  phys = jnp.take_along_axis(page_table[:, None, :], page_idx, axis=2)  # [B, K, N]
  return pages[jnp.arange(kvh)[None, :, None], phys]  # [B, K, N, S, D]


def sparse_decode_reference(q, k_pages, v_pages, page_table, lengths, page_idx, valid, *,
                            sm_scale=None):
  """Attention of one query token per sequence over the selected pages only.

  Every kv head attends to its own selection (shared by the query heads of its GQA group).
  Tokens at positions >= lengths and tokens of invalid slots are masked; the softmax runs in
  float32. Valid slots must name distinct pages (`selection.select_pages` guarantees it). A row
  with no valid token at all is degenerate (uniform weights over the masked tokens).

  Args:
    q: [B, H, D] queries of the current token.
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer.
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 number of valid tokens per sequence (including the current one).
    page_idx: [B, K, N] int32 selected logical page ids.
    valid: [B, K, N] bool, whether each slot is attended.
    sm_scale: softmax scale, default 1/sqrt(D).
  Returns:
    [B, H, D] in q.dtype.
  """
  b, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  g = h // kvh
  if sm_scale is None:
    sm_scale = d ** -0.5
  n = page_idx.shape[-1]
  k = gather_selected_pages(k_pages, page_table, page_idx).astype(jnp.float32)  # [B,K,N,S,D]
  v = gather_selected_pages(v_pages, page_table, page_idx).astype(jnp.float32)
  k = k.reshape(b, kvh, n * s, d)  # [B, K, N*S, D]; flat token axis: a faster einsum on CPU
  v = v.reshape(b, kvh, n * s, d)
  qg = q.reshape(b, kvh, g, d).astype(jnp.float32)  # [B, K, G, D]
  logits = jnp.einsum("bkgd,bktd->bkgt", qg, k) * sm_scale  # [B, K, G, N*S]
  pos = page_idx[..., None] * s + jnp.arange(s)  # [B, K, N, S]
  ok = valid[..., None] & (pos < lengths[:, None, None, None])  # [B, K, N, S]
  logits = jnp.where(ok.reshape(b, kvh, 1, n * s), logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)  # [B, K, G, N*S]
  out = jnp.einsum("bkgt,bktd->bkgd", probs, v)  # [B, K, G, D]
  return out.reshape(b, h, d).astype(q.dtype)
