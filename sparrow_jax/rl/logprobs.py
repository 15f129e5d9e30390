"""Per-token log-probs, entropies and top-k log-probs of teacher-forced sequences.

The LM head is applied chunk by chunk over time under `jax.checkpoint`, so neither the forward
nor the backward pass ever holds `[B, T, V]` float32 logits: with Qwen3's 151,936-token
vocabulary and 8K-token responses those would be tens of GB. `chunk` counts tokens (rows x
positions): a chunk covers `chunk // B` positions of all B rows (a power of two, at least 1),
so the logits of one chunk stay `[chunk, V]` whether a micro-batch holds two long rows or
hundreds of short ones.

Convention: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])` for t ≥ 1 and 0 at t = 0, so a
response mask over token positions applies to log-probs directly.

Top-k over the vocabulary (`exact_top_k`) runs in two stages: the k blocks of 128 entries
with the largest maxima, then the top k of those k x 128 candidates. That is exactly
`lax.top_k` (same values, same indices, ties to the lower index) and needs one pass over the
row. The direct `lax.top_k` of a whole-vocabulary row is fast on XLA:CPU only while the
compiler turns it into its TopK routine; when a chunk's results are sliced further (one
chunk of a padded or short sequence, e.g. the SmolLM2 preset's 128-token bucket), XLA merges
the slices into the sort and sorts all 49,152 entries of every row instead (~8x the whole
recompute's time without top-k, `benchmarks/recompute.py --length 64`).

`temperature` T: every statistic is of softmax(logits / T), the distribution the rollout
sampled from (verl divides the logits by the rollout temperature in the same way). Top-p is
not applied here: training-side log-probs are of the full tempered distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparrow_jax.models.decoder import Decoder
from sparrow_jax.models.sharding_hints import constrain_batch


@dataclasses.dataclass(frozen=True)
class TokenStats:
  logp: jax.Array  # [B, T] float32
  entropy: jax.Array | None = None  # [B, T] float32
  topk_ids: jax.Array | None = None  # [B, T, k] int32
  topk_logp: jax.Array | None = None  # [B, T, k] float32


jax.tree_util.register_dataclass(TokenStats, data_fields=["logp", "entropy", "topk_ids",
                                                          "topk_logp"], meta_fields=[])


def time_chunk(chunk_tokens: int, rows: int, seq_len: int) -> int:
  """Positions per LM-head chunk: the largest power of two <= chunk_tokens / rows (at least
  1), capped at the sequence length."""
  if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
    raise ValueError(f"logits_to_stats: chunk={chunk_tokens!r}; expected a positive int")
  per_row = max(1, chunk_tokens // max(rows, 1))
  return min(1 << (per_row.bit_length() - 1), seq_len)


_TOPK_BLOCK = 128


def exact_top_k(x, k: int, *, block: int = _TOPK_BLOCK):
  """`lax.top_k(x, k)` over the last axis, in two stages (see the module docstring).

  Exact, ties included: the blocks are contiguous index ranges, ranked by their best entry
  (value, then lower index: `lax.top_k` is stable), so every one of the top k entries lies
  in one of the k best blocks; the candidates keep their original index order, so the final
  stable `lax.top_k` breaks ties as the direct one does.

  Args:
    x: [..., V] float; k: static int.
  Returns:
    (values [..., k], indices [..., k] int32), as `lax.top_k`.
  """
  v = x.shape[-1]
  nb = -(-v // block)
  if nb <= k or v <= 4 * block:  # small rows: the direct form is cheap and safe
    vals, ids = jax.lax.top_k(x, k)
    return vals, ids.astype(jnp.int32)
  pad = nb * block - v
  if pad:  # -inf never beats a real entry; padded entries sit after every real one
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
  xb = x.reshape(*x.shape[:-1], nb, block)  # [..., nb, block]
  _, top_blocks = jax.lax.top_k(jnp.max(xb, axis=-1), k)  # [..., k] best blocks
  top_blocks = jnp.sort(top_blocks, axis=-1)  # candidates in original index order
  cand = jnp.take_along_axis(xb, top_blocks[..., None], axis=-2)  # [..., k, block]
  cand = cand.reshape(*cand.shape[:-2], k * block)
  vals, pos = jax.lax.top_k(cand, k)  # [..., k]
  ids = jnp.take_along_axis(top_blocks, pos // block, axis=-1) * block + pos % block
  return vals, ids.astype(jnp.int32)


def _chunked_stats(model: Decoder, h, tg, *, chunk: int, topk: int, with_entropy: bool,
                   temperature: float) -> list:
  """Per-position stats of hidden states `h [B, S, D]` scoring targets `tg [B, S]`: the LM
  head over about `chunk` tokens at a time -> [logp, (entropy), (topk ids, topk logp)], each
  [B, S, ...]."""
  b, s_len, d = h.shape
  chunk = time_chunk(chunk, b, s_len)
  nc = -(-s_len // chunk)
  pad = nc * chunk - s_len
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, chunk, d).swapaxes(0, 1)
  tg = jnp.pad(tg, ((0, 0), (0, pad))).reshape(b, nc, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    hc, tc = args  # [B, C, D], [B, C]
    logits = constrain_batch(model.logits(hc))  # [B, C, V] float32
    if temperature != 1.0:
      logits = logits / temperature
    lp = jax.nn.log_softmax(logits, axis=-1)  # [B, C, V]
    out = [jnp.take_along_axis(lp, tc[..., None], axis=-1)[..., 0]]
    if with_entropy:
      out.append(-jnp.sum(jnp.exp(lp) * lp, axis=-1))
    if topk:
      vals, ids = exact_top_k(lp, topk)
      out += [ids, vals]
    return tuple(out)

  res = jax.lax.map(one, (h, tg))
  return [x.swapaxes(0, 1).reshape(b, nc * chunk, *x.shape[3:])[:, :s_len] for x in res]


def logits_to_stats(model: Decoder, hidden, tokens, *, chunk: int = 128, topk: int = 0,
                    with_entropy: bool = False, temperature: float = 1.0,
                    window: tuple | None = None) -> TokenStats:
  """Stats from final hidden states `[B, T, D]` (pre final norm) and tokens `[B, T]`, of
  softmax(logits / temperature); the LM head runs over about `chunk` tokens at a time.

  `window = (start [B] int, width: static int)`: stats only of tokens[b, start_b :
  start_b + width] (a response after its prompt); every other position gets 0 (top-k: id
  0, log-prob 0). Training needs log-probs of response tokens only, and on a short response
  after a long prompt the LM head over every position (a fifth of a SmolLM2 forward's
  multiply-adds, plus a log-softmax over 49,152 entries per position) is mostly waste.
  """
  if not temperature > 0:
    raise ValueError(f"logits_to_stats: temperature={temperature!r}; expected > 0")
  b, t, _ = hidden.shape
  kw = dict(chunk=chunk, topk=topk, with_entropy=with_entropy, temperature=temperature)
  if window is None:
    # Position t predicts token t + 1: shift targets left; the last position predicts nothing.
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    res = _chunked_stats(model, hidden, targets, **kw)
    # Shift back so logp[:, t] scores tokens[:, t]; position 0 has no prediction.
    place = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  else:
    start, width = window
    if not isinstance(width, int) or width < 1:
      raise ValueError(f"logits_to_stats: window width={width!r}; expected a positive int")
    width = min(width, t)
    pos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
    src = jnp.clip(pos - 1, 0, t - 1)  # the hidden state that predicts tokens[pos]
    hw = jnp.take_along_axis(hidden, src[..., None], axis=1)  # [B, W, D]
    tw = jnp.take_along_axis(tokens, jnp.clip(pos, 0, t - 1), axis=1)  # [B, W]
    res = _chunked_stats(model, hw, tw, **kw)
    rows = jnp.arange(b)[:, None]
    # Positions past T (a window that overhangs the row) are dropped; position 0 (start 0)
    # has no prediction.
    ok = (pos >= 1)
    place = lambda x: jnp.zeros((b, t) + x.shape[2:], x.dtype).at[rows, pos].set(
        jnp.where(ok.reshape(ok.shape + (1,) * (x.ndim - 2)), x, 0), mode="drop")
  logp = place(res[0])
  i = 1
  entropy = None
  if with_entropy:
    entropy = place(res[i])
    i += 1
  topk_ids = topk_logp = None
  if topk:
    topk_ids, topk_logp = place(res[i]), place(res[i + 1])
  return TokenStats(logp=logp, entropy=entropy, topk_ids=topk_ids, topk_logp=topk_logp)


def token_logprobs(model: Decoder, tokens, *, lengths=None, attention=None, budgets=None,
                   prompt_lengths=None, lora=None, chunk: int = 128, topk: int = 0,
                   with_entropy: bool = False, remat: bool = False,
                   temperature: float = 1.0, window: tuple | None = None) -> TokenStats:
  """Teacher-forced per-token stats of `tokens [B, T]` (dense or block-sparse, ± LoRA) under
  softmax(logits / temperature); `window`: see `logits_to_stats`."""
  hidden = model.hidden_states(tokens, lengths=lengths, attention=attention, budgets=budgets,
                               prompt_lengths=prompt_lengths, lora=lora, remat=remat)
  return logits_to_stats(model, hidden, tokens, chunk=chunk, topk=topk,
                         with_entropy=with_entropy, temperature=temperature, window=window)
