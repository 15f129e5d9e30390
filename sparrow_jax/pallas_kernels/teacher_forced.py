"""Teacher-forced block-sparse attention: a whole sequence, each position as decode sees it.

Query t (positions 0..T-1, the sequence starting at position 0) attends exactly as decode step
t would with a cache holding tokens 0..t: n = t + 1 tokens in ceil(n / S) pages, landmarks as
the cache holds them (full pages: over their S keys; the newest page: over the keys written so
far), the same `landmarks.score_pages` and `selection.select_pages` with the budget of that
step, then attention over the selected pages restricted to keys <= t. The result at every
position equals `reference.sparse_decode_reference` run step by step on a cache filled with
the same keys and values. With `prompt_lengths`, prompt positions attend densely, as the
rollout's dense prefill did. Mismatch measurement and DistillSparse run this.

Work and memory: the selection (landmark scores and top-k) runs in query chunks of
`query_chunk` without gradient and gives the pages of every (position, kv head), [B, T, K, N]
int32. The attention is `flash_xla`'s: each query chunk visits only the key blocks up to
itself (causal block skipping) and skips the blocks none of its queries selected, with an
online float32 softmax, so neither [T, T] scores nor a [T, N, S, D] gather is ever built; its
custom VJP keeps only the output and the log-sum-exp per row. Gradients flow through the
attention, not the selection (top-k indices).

`dense_attention_causal` is the same flash attention without a page mask (the dense layers,
the dense recompute, the update and prefill). `*_reference` are the previous full-key chunks
(every chunk attends to all T keys with the future masked, float32 upcasts): the yardstick of
the tests and of `benchmarks/train_attention.py`.

Axis legend: B batch, T sequence length, C query chunk, H query heads, K kv heads,
G = H // K, D head dim, S page size, Mp = ceil(T / S) pages, Tk = Mp * S padded keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sparrow_jax.pallas_kernels import flash_xla
from sparrow_jax.pallas_kernels.reference import MASK_VALUE
from sparrow_jax.pallas_kernels.landmarks import (as_landmark_kind, compute_landmarks,
                                                   round_landmarks, score_pages)
from sparrow_jax.pallas_kernels.selection import select_pages


def check_qkv(q, k, v, lengths):
  if q.ndim != 4:
    raise ValueError(f"q.shape={q.shape}: expected [B, T, H, D]")
  b, t, h, d = q.shape
  if k.ndim != 4 or k.shape[:2] != (b, t) or k.shape[-1] != d:
    raise ValueError(f"k.shape={k.shape}: expected [B={b}, T={t}, K, D={d}]")
  if v.shape != k.shape:
    raise ValueError(f"v.shape={v.shape}: expected k.shape={k.shape}")
  if h % k.shape[2]:
    raise ValueError(f"q has H={h} heads: expected a multiple of K={k.shape[2]} kv heads")
  if lengths is not None and jnp.shape(lengths) != (b,):
    raise ValueError(f"lengths.shape={jnp.shape(lengths)}: expected ({b},)")


def _chunked_attention(q, k, v, lengths, sm_scale, query_chunk, key_mask_fn, extra=None):
  """Causal GQA attention in query chunks; `key_mask_fn(q_chunk, t, extra_chunk)` gives the
  extra [B, C, K, Tk] key mask of each chunk (None = causal only).

  k, v: [B, K, Tk, D] float32 (Tk >= T, zero padded). Returns [B, T, H, D] in q.dtype.
  """
  b, t, h, d = q.shape
  kvh, tk = k.shape[1], k.shape[2]
  g = h // kvh
  if not isinstance(query_chunk, int) or query_chunk < 1:
    raise ValueError(f"query_chunk={query_chunk!r}: expected a positive int")
  if sm_scale is None:
    sm_scale = d ** -0.5
  c = min(query_chunk, t)
  n_chunks = -(-t // c)
  pad = n_chunks * c - t
  q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  q_chunks = jnp.moveaxis(q_chunks.reshape(b, n_chunks, c, h, d), 1, 0)  # [nC, B, C, H, D]
  xs = [q_chunks, jnp.arange(n_chunks, dtype=jnp.int32) * c]
  if extra is not None:
    extra = jnp.pad(extra, ((0, 0), (0, pad)))
    xs.append(jnp.moveaxis(extra.reshape(b, n_chunks, c), 1, 0))  # [nC, B, C]

  def one_chunk(args):
    q_c, t0 = args[0], args[1]  # [B, C, H, D], []
    pos = t0 + jnp.arange(c, dtype=jnp.int32)  # [C] query positions
    mask = (jnp.arange(tk)[None, :] <= pos[:, None])[None, :, None, :]  # [1, C, 1, Tk]
    if key_mask_fn is not None:
      mask = mask & key_mask_fn(q_c, pos, args[2] if extra is not None else None)
    qg = q_c.astype(jnp.float32).reshape(b, c, kvh, g, d)  # [B, C, K, G, D]
    logits = jnp.einsum("bckgd,bktd->bckgt", qg, k) * sm_scale  # [B, C, K, G, Tk]
    logits = jnp.where(mask[:, :, :, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bckgt,bktd->bckgd", probs, v)  # [B, C, K, G, D]
    return out.reshape(b, c, h, d)

  # Rematerialised in the backward pass: only the chunk inputs are saved, never the
  # [B, C, H, Tk] probabilities of every chunk (DistillSparse differentiates through this).
  out = lax.map(jax.checkpoint(one_chunk), xs)  # [nC, B, C, H, D]
  out = jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * c, h, d)[:, :t]  # [B, T, H, D]
  if lengths is not None:
    keep = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]  # [B, T]
    out = jnp.where(keep[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)


def _keys_by_head(x, tk):
  """[B, T, K, D] -> [B, K, Tk, D] float32, zero padded to Tk."""
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, tk - x.shape[1]), (0, 0), (0, 0)))
  return jnp.swapaxes(x, 1, 2)


def dense_attention_causal_reference(q, k, v, *, lengths=None, sm_scale=None,
                                     query_chunk: int = 256):
  """Today's full-key chunks (the reference): every query chunk attends to all T keys with
  the future masked, q/k/v upcast to float32. Same contract as `dense_attention_causal`."""
  check_qkv(q, k, v, lengths)
  t = q.shape[1]
  return _chunked_attention(q, _keys_by_head(k, t), _keys_by_head(v, t), lengths, sm_scale,
                            query_chunk, None)


def dense_attention_causal(q, k, v, *, lengths=None, sm_scale=None, query_chunk: int = 128):
  """Dense causal GQA attention: flash attention over the keys up to each query chunk
  (`flash_xla`), operands in their dtype, float32 softmax statistics and accumulation.

  Args:
    q: [B, T, H, D]; k, v: [B, T, K, D] (query head h uses kv head h // (H // K)).
    lengths: optional [B] valid tokens per sequence; outputs at t >= lengths are 0.
    query_chunk: query chunk = key block size (speed knob; does not change the result).
  Returns:
    [B, T, H, D] in q.dtype.
  """
  check_qkv(q, k, v, lengths)
  _check_chunk(query_chunk)
  out = flash_xla.flash_attention_causal(q, k, v, block=query_chunk, sm_scale=sm_scale)
  return zero_past_lengths(out, lengths)


def _check_chunk(query_chunk):
  if not isinstance(query_chunk, int) or isinstance(query_chunk, bool) or query_chunk < 1:
    raise ValueError(f"query_chunk={query_chunk!r}: expected a positive int")


def zero_past_lengths(out, lengths):
  if lengths is None:
    return out
  keep = jnp.arange(out.shape[1])[None, :] < jnp.asarray(lengths)[:, None]  # [B, T]
  return jnp.where(keep[:, :, None, None], out, jnp.zeros((), out.dtype))


def _check_sparse(q, k, v, budget, lengths, prompt_lengths, page_size, kind):
  check_qkv(q, k, v, lengths)
  kind = as_landmark_kind(kind)
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size={page_size!r}: expected a positive int")
  b, t = q.shape[:2]
  budget = jnp.asarray(budget, jnp.int32)
  if budget.shape != (b, t):
    raise ValueError(f"budget.shape={budget.shape}: expected [B={b}, T={t}]")
  if prompt_lengths is not None:
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if prompt_lengths.shape != (b,):
      raise ValueError(f"prompt_lengths.shape={prompt_lengths.shape}: expected ({b},)")
  return kind, budget, prompt_lengths


def _selector(k_heads, kind, *, page_size, max_budget, reserved_bos, reserved_recent,
              landmark_dtype="float32"):
  """`select(q_c, pos, budget_c) -> (page_idx, valid)` [B, C, K, N]: the pages decode step t
  selects, for a chunk of queries q_c [B, C, H, D] at positions pos [C].

  k_heads: [B, K, Tk, D] float32 keys (Tk = Mp * S, zero padded); landmarks are rounded to
  `landmark_dtype` as the decode cache stores them."""
  b, kvh, tk, d = k_heads.shape
  s = page_size
  mp = tk // s
  k_pages = k_heads.reshape(b, kvh, mp, s, d)  # [B, K, Mp, S, D]
  full_nv = jnp.full((b, kvh, mp), s, jnp.int32)
  # [B, K, Mp, D] (or a pair), rounded as the cache stores them
  full_lm = round_landmarks(compute_landmarks(k_pages, full_nv, kind), landmark_dtype)
  lm_b = jax.tree.map(lambda x: x[:, None], full_lm)  # [B, 1, K, Mp, D]
  pages = jnp.arange(mp, dtype=jnp.int32)

  def select(q_c, pos, budget_c):
    c = pos.shape[0]
    scores = score_pages(q_c, lm_b, kind)  # [B, C, K, Mp]
    cur = pos // s  # [C] newest page of each step
    if reserved_recent == 0:
      # The newest page is scored; its landmark covers the keys written so far.
      cur_c = jnp.minimum(cur, mp - 1)
      cur_keys = k_pages[:, :, cur_c]  # [B, K, C, S, D]
      cur_nv = jnp.broadcast_to(pos % s + 1, (b, kvh, c))  # [B, K, C]
      cur_lm = round_landmarks(compute_landmarks(cur_keys, cur_nv, kind),
                               landmark_dtype)  # [B, K, C, D] (or a pair)
      cur_lm = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2)[:, :, :, None], cur_lm)
      cur_score = score_pages(q_c, cur_lm, kind)  # [B, C, K, 1]
      scores = jnp.where((pages == cur[:, None])[None, :, None, :], cur_score, scores)
    num_pages = jnp.broadcast_to(cur + 1, (b, c)).reshape(b * c)  # [B*C]
    page_idx, valid = select_pages(
        scores.reshape(b * c, kvh, mp), num_pages, budget_c.reshape(b * c),
        max_budget=max_budget, reserved_bos=reserved_bos, reserved_recent=reserved_recent)
    n = page_idx.shape[-1]
    return page_idx.reshape(b, c, kvh, n), valid.reshape(b, c, kvh, n)

  return select


def sparse_attention_teacher_forced_reference(q, k, v, budget, *, lengths=None,
                                              prompt_lengths=None, kind, max_budget: int,
                                              reserved_bos: int = 1, reserved_recent: int = 2,
                                              page_size: int = 16, query_chunk: int = 256,
                                              sm_scale=None, landmark_dtype: str = "float32"):
  """Today's full-key chunks (the reference): the selection of every chunk becomes a
  [B, C, K, T] key mask over all keys, float32 softmax. Same contract as
  `sparse_attention_teacher_forced`."""
  kind, budget, prompt_lengths = _check_sparse(q, k, v, budget, lengths, prompt_lengths,
                                               page_size, kind)
  b, t, h, d = q.shape
  kvh = k.shape[2]
  s = page_size
  mp = -(-t // s)
  tk = mp * s
  k_heads = _keys_by_head(k, tk)  # [B, K, Tk, D]
  v_heads = _keys_by_head(v, tk)
  select = _selector(k_heads, kind, page_size=s, max_budget=max_budget,
                     reserved_bos=reserved_bos, reserved_recent=reserved_recent,
                     landmark_dtype=landmark_dtype)

  def key_mask(q_c, pos, budget_c):
    c = pos.shape[0]
    page_idx, valid = select(q_c, pos, budget_c)  # [B, C, K, N]
    rows = jnp.arange(b)[:, None, None, None]
    qpos = jnp.arange(c)[None, :, None, None]
    heads = jnp.arange(kvh)[None, None, :, None]
    hit = jnp.zeros((b, c, kvh, mp), jnp.int32).at[rows, qpos, heads, page_idx].add(
        valid.astype(jnp.int32))  # [B, C, K, Mp] times selected
    sel = (hit > 0)[..., None]
    if prompt_lengths is not None:  # prompt positions: dense prefill
      in_prompt = pos[None, :] < prompt_lengths[:, None]  # [B, C]
      sel = sel | in_prompt[:, :, None, None, None]
    return jnp.broadcast_to(sel, (b, c, kvh, mp, s)).reshape(b, c, kvh, tk)  # [B, C, K, Tk]

  return _chunked_attention(q, k_heads, v_heads, lengths, sm_scale, query_chunk, key_mask,
                            extra=budget)


def sparse_attention_teacher_forced(q, k, v, budget, *, lengths=None, prompt_lengths=None,
                                    kind, max_budget: int, reserved_bos: int = 1,
                                    reserved_recent: int = 2, page_size: int = 16,
                                    query_chunk: int = 128, sm_scale=None,
                                    landmark_dtype: str = "float32"):
  """Block-sparse attention of a whole sequence, position t selecting as decode step t.

  The selection (landmark scores, top-k) runs per query chunk without gradient and yields
  the pages of every (position, kv head); the attention is `flash_xla` over those pages:
  each chunk visits only the key blocks up to itself, and skips blocks none of its queries
  selected.

  Args:
    q: [B, T, H, D] queries; k, v: [B, T, K, D] keys / values of positions 0..T-1.
    budget: [B, T] int32 top-k budget of each step (traced; clipped to [0, max_budget]).
    lengths: optional [B] valid tokens per sequence; outputs at t >= lengths are 0 (keys past
      a query are never seen, so padding does not change valid positions).
    prompt_lengths: optional [B]; queries at t < prompt_lengths[b] attend densely, as the
      prompt's dense prefill did in the rollout; later positions select as decode steps.
    kind: LandmarkKind or "mean" / "quest".
    max_budget, reserved_bos, reserved_recent: static, as in `selection.select_pages`.
    page_size: S, tokens per page (as the paged cache).
    query_chunk: queries per chunk (speed / memory knob; does not change the result),
      rounded up to a multiple of the page size.
    sm_scale: softmax scale, default 1/sqrt(D).
    landmark_dtype: the dtype the decode cache keeps landmarks in; they are rounded to it.
  Returns:
    [B, T, H, D] in q.dtype.
  """
  kind, budget, prompt_lengths = _check_sparse(q, k, v, budget, lengths, prompt_lengths,
                                               page_size, kind)
  _check_chunk(query_chunk)
  if page_size & (page_size - 1):
    raise ValueError(f"page_size={page_size}: expected a power of two")
  b, t, h, d = q.shape
  s = page_size
  mp = -(-t // s)
  # The selection carries no gradient (top-k indices): its inputs are cut from the graph.
  k_heads = _keys_by_head(lax.stop_gradient(k), mp * s)  # [B, K, Tk, D] float32
  select = _selector(k_heads, kind, page_size=s, max_budget=max_budget,
                     reserved_bos=reserved_bos, reserved_recent=reserved_recent,
                     landmark_dtype=landmark_dtype)
  c = -(-min(query_chunk, mp * s) // s) * s
  n_chunks = -(-t // c)
  pad = n_chunks * c - t
  q_sel = jnp.pad(lax.stop_gradient(q), ((0, 0), (0, pad), (0, 0), (0, 0)))
  q_sel = jnp.moveaxis(q_sel.reshape(b, n_chunks, c, h, d), 1, 0)  # [nC, B, C, H, D]
  bud = jnp.moveaxis(jnp.pad(budget, ((0, 0), (0, pad))).reshape(b, n_chunks, c), 1, 0)
  starts = jnp.arange(n_chunks, dtype=jnp.int32) * c
  page_idx, valid = lax.map(
      lambda a: select(a[0], a[1] + jnp.arange(c, dtype=jnp.int32), a[2]),
      (q_sel, starts, bud))  # [nC, B, C, K, N] each
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n_chunks * c, *x.shape[3:])[:, :t]
  page_idx, valid = unchunk(page_idx), unchunk(valid)  # [B, T, K, N]
  dense_q = None
  if prompt_lengths is not None:  # prompt positions: dense prefill
    dense_q = jnp.arange(t)[None, :] < prompt_lengths[:, None]  # [B, T]
  out = flash_xla.flash_attention_causal(q, k, v, block=c, sm_scale=sm_scale,
                                         page_idx=page_idx, valid=valid, dense_q=dense_q,
                                         page_size=s)
  return zero_past_lengths(out, lengths)
