"""Sampling: top-k/top-p filtering against numpy, greedy, log-prob normalisation."""

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.engine.sampling import sample_tokens, topk_logprobs


def _np_allowed(logits, temp, top_p, top_k):
  z = logits / temp
  order = np.argsort(-z, kind="stable")
  allowed = np.ones_like(z, bool)
  if top_k > 0:
    allowed[order[top_k:]] = False
  p = np.exp(z - z.max()); p /= p.sum()
  cum = np.cumsum(p[order])
  n_keep = max(1, int(np.sum(cum - p[order] < top_p)))
  allowed[order[n_keep:]] = False
  return allowed, z


def test_sampled_tokens_stay_in_filtered_set_and_logprobs_match():
  rng = np.random.default_rng(0)
  b, v = 6, 40
  logits = rng.normal(size=(b, v)).astype(np.float32) * 2
  temps = np.array([1.0, 0.7, 1.3, 1.0, 0.5, 1.0], np.float32)
  top_ps = np.array([1.0, 0.8, 0.5, 1.0, 0.95, 0.3], np.float32)
  top_ks = np.array([0, 0, 10, 5, 3, 0], np.int32)
  fn = jax.jit(sample_tokens)
  for trial in range(20):
    tok, lp = fn(jnp.asarray(logits), jnp.arange(b, dtype=jnp.int32) + 100 * trial,
                 jnp.full((b,), 3, jnp.int32), jnp.asarray(temps), jnp.asarray(top_ps),
                 jnp.asarray(top_ks))
    for i in range(b):
      allowed, z = _np_allowed(logits[i].astype(np.float64), temps[i], top_ps[i], top_ks[i])
      assert allowed[int(tok[i])]
      zz = np.where(allowed, z, -np.inf)
      ref = zz[int(tok[i])] - np.log(np.sum(np.exp(zz[allowed] - zz.max()))) - zz.max()
      np.testing.assert_allclose(float(lp[i]), ref, atol=1e-5)


def test_sample_frequencies_follow_the_distribution():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]], jnp.float32))
  fn = jax.jit(jax.vmap(lambda s: sample_tokens(logits, s[None], jnp.zeros((1,), jnp.int32),
                                                jnp.ones((1,)), jnp.ones((1,)),
                                                jnp.zeros((1,), jnp.int32))[0][0]))
  toks = np.asarray(fn(jnp.arange(4000, dtype=jnp.int32)))
  freq = np.bincount(toks, minlength=3) / toks.size
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.03)


def test_greedy_and_topk_logprobs():
  logits = jnp.array([[0.1, 2.0, -1.0, 1.5]], jnp.float32)
  tok, lp = sample_tokens(logits, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                          jnp.zeros((1,)), jnp.ones((1,)), jnp.zeros((1,), jnp.int32))
  assert int(tok[0]) == 1
  np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits)[0, 1]), rtol=1e-6)
  ids, vals = topk_logprobs(logits, 2)
  np.testing.assert_array_equal(ids[0], [1, 3])
  np.testing.assert_allclose(np.exp(vals).sum() <= 1.0, True)
