"""Decoder: cached (paged) decode vs full-sequence logits, dtypes, GQA layouts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.kv_cache import PagedKVCache, page_table_row


def _cache_for(cfg, num_slots, max_len, page_size=16, landmark="none"):
  mp = -(-max_len // page_size)
  cache = PagedKVCache.create(
      num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      num_slots=num_slots, num_pages=num_slots * mp + 1, max_pages_per_seq=mp,
      page_size=page_size, landmark=landmark)
  rows = np.stack([page_table_row(list(range(1 + s * mp, 1 + (s + 1) * mp)), mp)
                   for s in range(num_slots)])
  return cache, rows


@pytest.mark.parametrize("overrides", [
    dict(),  # tiny Qwen3, GQA 2:1, tied
    dict(num_kv_heads=4, tie_word_embeddings=False),  # MHA, untied
    dict(num_kv_heads=1, head_dim=48),  # MQA, head_dim != hidden / heads
    dict(qk_norm=False, attention_bias=True),  # Qwen2-style
])
def test_cached_decode_matches_full_sequence(overrides):
  cfg = get_config("tiny", **overrides)
  model = init_model(cfg, seed=3)
  rng = np.random.default_rng(0)
  total, prompt_lens = 45, [7, 16]
  tokens = rng.integers(0, cfg.vocab_size, (2, total)).astype(np.int32)
  full = model(jnp.asarray(tokens))  # [2, T, V]
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda st, *a: nnx.merge(graphdef, st).prefill(*a))
  decode = jax.jit(lambda st, *a: nnx.merge(graphdef, st).decode(*a))

  cache, rows = _cache_for(cfg, 2, 64)
  t_pad = 16
  ptoks = np.zeros((2, t_pad), np.int32)
  for b, p in enumerate(prompt_lens):
    ptoks[b, :p] = tokens[b, :p]
  cache, last = prefill(state, cache, jnp.asarray(ptoks), jnp.asarray(prompt_lens, jnp.int32),
                              jnp.arange(2, dtype=jnp.int32), jnp.asarray(rows))
  for b, p in enumerate(prompt_lens):
    np.testing.assert_allclose(last[b], full[b, p - 1], atol=1e-5, rtol=1e-5)
  # Teacher-force the rest one token at a time; the shorter prompt goes on alone first.
  pos = np.array(prompt_lens)
  while (pos < total).any():
    active = pos < total
    step_tok = np.where(active, tokens[np.arange(2), np.minimum(pos, total - 1)], 0)
    cache, logits = decode(state, cache, jnp.asarray(step_tok, jnp.int32), jnp.asarray(active))
    for b in np.flatnonzero(active):
      np.testing.assert_allclose(logits[b], full[b, pos[b]], atol=1e-5, rtol=1e-5)
    pos = pos + active
  np.testing.assert_array_equal(np.asarray(cache.lengths), [total, total])


def test_bfloat16_runs_and_logits_are_float32():
  cfg = get_config("tiny", dtype="bfloat16", param_dtype="bfloat16")
  model = init_model(cfg)
  tokens = jnp.arange(20, dtype=jnp.int32)[None]
  logits = model(tokens)
  assert logits.dtype == jnp.float32
  chex.assert_tree_all_finite(logits)
  ref = init_model(get_config("tiny"))(tokens)
  # Same init (bf16-rounded weights) gives close logits.
  assert float(jnp.max(jnp.abs(logits - ref))) < 0.1


def test_padding_does_not_change_valid_positions():
  cfg = get_config("tiny")
  model = init_model(cfg, seed=5)
  tok = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 12)), jnp.int32)
  a = model(tok)
  padded = jnp.concatenate([tok, jnp.zeros((1, 9), jnp.int32)], axis=1)
  b = model(padded, lengths=jnp.array([12], jnp.int32))
  np.testing.assert_allclose(a[0], b[0, :12], atol=1e-5)


def test_chunked_causal_attention_equals_unchunked():
  from sparrow_jax.models.attention import causal_attention
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(2, 70, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 70, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 70, 2, 8)), jnp.float32)
  lengths = jnp.array([70, 50])
  a = causal_attention(q, k, v, lengths, query_chunk=512)
  b = causal_attention(q, k, v, lengths, query_chunk=16)
  np.testing.assert_allclose(a, b, atol=1e-6)
  # float64 numpy reference for row 1
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  for t in range(0, 50, 7):
    for h in range(4):
      s = qn[1, t, h] @ kn[1, :t + 1, h // 2].T / np.sqrt(8)
      p = np.exp(s - s.max()); p /= p.sum()
      np.testing.assert_allclose(a[1, t, h], p @ vn[1, :t + 1, h // 2], atol=1e-5)
