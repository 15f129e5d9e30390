"""Teacher-forced sparse attention equals incremental sparse decode at every position.

The decode side is emulated honestly: at step t a paged cache (shuffled physical pages, null
page 0) holds only tokens 0..t, its landmarks are recomputed from what is written (the partial
page included), and `select_decode_pages` + `sparse_decode_reference` give the output.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import reference
from sparrow_jax.pallas_kernels import landmarks
from sparrow_jax.pallas_kernels import selection
from sparrow_jax.pallas_kernels import teacher_forced as tf


def random_qkv(rng, b, t, h, kvh, d):
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return mk(b, t, h, d), mk(b, t, kvh, d), mk(b, t, kvh, d)


def decode_step_by_step(q, k, v, budget, *, kind, max_budget, page_size, reserved_bos,
                        reserved_recent, rng):
  b, t, h, d = q.shape
  kvh = k.shape[2]
  s = page_size
  m = -(-t // s)
  p = b * m + 3
  perm = rng.permutation(np.arange(1, p))[:b * m].reshape(b, m)
  table = jnp.asarray(perm, jnp.int32)  # [B, M]
  pad = ((0, 0), (0, m * s - t), (0, 0), (0, 0))
  k_pool = np.zeros((kvh, p, s, d), np.float32)
  v_pool = np.zeros((kvh, p, s, d), np.float32)
  pos = np.full((p, s), 1 << 30)  # token position held by each pool row
  k_seq = np.pad(np.asarray(k), pad).reshape(b, m, s, kvh, d)
  v_seq = np.pad(np.asarray(v), pad).reshape(b, m, s, kvh, d)
  for i in range(b):
    for j in range(m):
      k_pool[:, perm[i, j]] = k_seq[i, j].transpose(1, 0, 2)
      v_pool[:, perm[i, j]] = v_seq[i, j].transpose(1, 0, 2)
      pos[perm[i, j]] = j * s + np.arange(s)
  k_pool, v_pool, pos = jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(pos)

  @jax.jit
  def step(step_t, q_t, budget_t):
    written = (pos <= step_t)[None, :, :, None]  # the cache holds tokens 0..t only
    k_now = jnp.where(written, k_pool, 0.0)
    v_now = jnp.where(written, v_pool, 0.0)
    num_valid = jnp.broadcast_to(jnp.clip(step_t + 1 - pos[:, 0], 0, s), (kvh, p))
    lm = landmarks.compute_landmarks(k_now, num_valid, kind)  # [K, P, D]
    lengths = jnp.full((b,), step_t + 1, jnp.int32)
    page_idx, valid = selection.select_decode_pages(
        q_t, lm, table, lengths, budget_t, kind=kind, max_budget=max_budget, page_size=s,
        reserved_bos=reserved_bos, reserved_recent=reserved_recent)
    return reference.sparse_decode_reference(q_t, k_now, v_now, table, lengths, page_idx,
                                             valid)

  outs = [step(i, q[:, i], budget[:, i]) for i in range(t)]
  assert step._cache_size() == 1
  return jnp.stack(outs, axis=1)  # [B, T, H, D]


@pytest.mark.parametrize("kind,bos,recent,page_size,t,chunk", [
    ("mean", 1, 2, 4, 53, 16),
    ("quest", 1, 2, 4, 53, 16),
    ("mean", 1, 0, 4, 46, 20),   # the newest page competes on its partial landmark
    ("quest", 0, 1, 4, 46, 64),
    ("mean", 1, 2, 16, 150, 64),  # the default page size, partial last page
])
def test_teacher_forced_equals_incremental_decode(kind, bos, recent, page_size, t, chunk):
  rng = np.random.default_rng(t + bos + recent)
  b, h, kvh, d, max_budget = 2, 4, 2, 32, 3
  q, k, v = random_qkv(rng, b, t, h, kvh, d)
  budget = jnp.asarray(rng.integers(0, max_budget + 1, (b, t)), jnp.int32)
  want = decode_step_by_step(q, k, v, budget, kind=kind, max_budget=max_budget,
                             page_size=page_size, reserved_bos=bos, reserved_recent=recent,
                             rng=rng)
  got = jax.jit(lambda q, k, v, bud: tf.sparse_attention_teacher_forced(
      q, k, v, bud, kind=kind, max_budget=max_budget, reserved_bos=bos,
      reserved_recent=recent, page_size=page_size, query_chunk=chunk))(q, k, v, budget)
  chex.assert_shape(got, (b, t, h, d))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  dense = tf.dense_attention_causal(q, k, v)
  assert float(jnp.max(jnp.abs(got - dense))) > 1e-2, "selection should be sparse here"


def numpy_causal(q, k, v):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  out = np.zeros_like(q)
  for i in range(b):
    for hh in range(h):
      logits = q[i, :, hh] @ k[i, :, hh // g].T / np.sqrt(d)  # [T, T]
      logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
      w = np.exp(logits - logits.max(-1, keepdims=True))
      out[i, :, hh] = (w / w.sum(-1, keepdims=True)) @ v[i, :, hh // g]
  return out


def test_dense_attention_causal_matches_numpy_and_lengths():
  rng = np.random.default_rng(0)
  q, k, v = random_qkv(rng, 2, 37, 8, 2, 16)
  got = tf.dense_attention_causal(q, k, v, query_chunk=10)
  np.testing.assert_allclose(got, numpy_causal(q, k, v), atol=1e-5, rtol=1e-5)
  short = tf.dense_attention_causal(q, k, v, lengths=jnp.asarray([37, 20]), query_chunk=16)
  np.testing.assert_allclose(short[:, :20], got[:, :20], atol=1e-6)
  assert float(jnp.abs(short[1, 20:]).max()) == 0.0


@pytest.mark.parametrize("kind", ["mean", "quest"])
def test_full_budget_equals_dense(kind):
  rng = np.random.default_rng(1)
  q, k, v = random_qkv(rng, 2, 70, 4, 1, 16)
  budget = jnp.full((2, 70), 100, jnp.int32)
  got = tf.sparse_attention_teacher_forced(q, k, v, budget, kind=kind, max_budget=18,
                                           page_size=4, query_chunk=32)
  np.testing.assert_allclose(got, tf.dense_attention_causal(q, k, v), atol=1e-5, rtol=1e-5)


def test_query_chunk_and_lengths_do_not_change_valid_positions():
  rng = np.random.default_rng(2)
  q, k, v = random_qkv(rng, 2, 45, 4, 2, 16)
  budget = jnp.asarray(rng.integers(0, 3, (2, 45)), jnp.int32)
  run = lambda **kw: tf.sparse_attention_teacher_forced(
      q, k, v, budget, kind="quest", max_budget=2, page_size=4, **kw)
  base = run(query_chunk=45)
  np.testing.assert_allclose(run(query_chunk=7), base, atol=1e-6)
  padded = run(query_chunk=16, lengths=jnp.asarray([45, 30]))
  np.testing.assert_allclose(padded[1, :30], base[1, :30], atol=1e-6)
  assert float(jnp.abs(padded[1, 30:]).max()) == 0.0


def test_budget_change_does_not_recompile():
  rng = np.random.default_rng(3)
  q, k, v = random_qkv(rng, 1, 40, 4, 2, 16)
  fn = jax.jit(lambda q, k, v, bud: tf.sparse_attention_teacher_forced(
      q, k, v, bud, kind="mean", max_budget=4, page_size=4, query_chunk=16))
  outs = [fn(q, k, v, jnp.full((1, 40), n, jnp.int32)) for n in (0, 2, 4)]
  assert fn._cache_size() == 1
  assert float(jnp.abs(outs[0] - outs[2]).max()) > 1e-3


def test_validation_errors():
  q, k, v = random_qkv(np.random.default_rng(4), 1, 8, 4, 2, 16)
  with pytest.raises(ValueError, match=r"budget.shape=\(1, 7\)"):
    tf.sparse_attention_teacher_forced(q, k, v, jnp.zeros((1, 7), jnp.int32), kind="mean",
                                       max_budget=2)
  with pytest.raises(ValueError, match="k.shape"):
    tf.sparse_attention_teacher_forced(q, k[:, :5], v, jnp.zeros((1, 8), jnp.int32),
                                       kind="mean", max_budget=2)
  with pytest.raises(ValueError, match="query_chunk=0"):
    tf.dense_attention_causal(q, k, v, query_chunk=0)
  with pytest.raises(ValueError, match="kind='dense'"):
    tf.sparse_attention_teacher_forced(q, k, v, jnp.zeros((1, 8), jnp.int32), kind="dense",
                                       max_budget=2)


def test_gradients_with_full_budget_equal_dense():
  rng = np.random.default_rng(6)
  q, k, v = random_qkv(rng, 1, 24, 4, 2, 16)
  budget = jnp.full((1, 24), 8, jnp.int32)
  sparse_loss = lambda q, k, v: jnp.sum(jnp.sin(tf.sparse_attention_teacher_forced(
      q, k, v, budget, kind="mean", max_budget=8, page_size=4, query_chunk=10)))
  dense_loss = lambda q, k, v: jnp.sum(jnp.sin(tf.dense_attention_causal(q, k, v,
                                                                         query_chunk=10)))
  got = jax.grad(sparse_loss, argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_prompt_positions_attend_densely():
  """Prompt positions match dense prefill; generated positions are unchanged by the prompt."""
  rng = np.random.default_rng(7)
  q, k, v = random_qkv(rng, 2, 50, 4, 2, 16)
  budget = jnp.asarray(rng.integers(0, 3, (2, 50)), jnp.int32)
  run = lambda **kw: tf.sparse_attention_teacher_forced(
      q, k, v, budget, kind="mean", max_budget=2, page_size=4, query_chunk=16, **kw)
  sparse = run()
  mixed = run(prompt_lengths=jnp.asarray([30, 28]))
  dense = tf.dense_attention_causal(q, k, v)
  for i, p in enumerate((30, 28)):
    np.testing.assert_allclose(mixed[i, :p], dense[i, :p], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(mixed[i, p:], sparse[i, p:], atol=1e-6)
    assert float(jnp.abs(sparse[i, :p] - dense[i, :p]).max()) > 1e-3
  with pytest.raises(ValueError, match="prompt_lengths.shape"):
    run(prompt_lengths=jnp.asarray([3]))
