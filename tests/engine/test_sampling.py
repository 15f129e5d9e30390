"""Sampling: temperature -> top-k -> top-p against transformers' logits warpers on random
logits, batch invariance of the filter branches, log-prob normalisation, greedy, frequencies,
and the request-seed hierarchy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.engine.sampling import (SamplingParams, filter_branch, filter_logits, row_argmax,
                                         request_seed, sample_tokens, seed_key_data,
                                         topk_logprobs)
from sparrow_jax.pallas_kernels.reference import MASK_VALUE


def _hf_kept(logits, temp, top_k, top_p):
  """Kept set of transformers' warpers, in generate()'s order, in float32 (torch CPU)."""
  import torch
  from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                      TopKLogitsWarper, TopPLogitsWarper)
  scores = torch.tensor(logits[None], dtype=torch.float32)
  ids = torch.zeros((1, 1), dtype=torch.long)
  scores = TemperatureLogitsWarper(float(temp))(ids, scores)
  if top_k > 0:
    scores = TopKLogitsWarper(int(top_k))(ids, scores)
  if top_p < 1:
    scores = TopPLogitsWarper(float(top_p))(ids, scores)
  return torch.isfinite(scores[0]).numpy(), scores[0].double().numpy()


def _grid(v, rng, rows):
  temps = rng.choice([0.6, 1.0, 1.7], rows).astype(np.float32)
  top_ks = rng.choice([0, 1, 2, 5, 20, 50, v + 7], rows).astype(np.int32)
  top_ps = rng.choice([1.0, 0.95, 0.8, 0.5, 0.2], rows).astype(np.float32)
  scale = rng.choice([0.5, 2.0, 6.0], rows)[:, None]  # flat to peaked distributions
  logits = (rng.normal(size=(rows, v)) * scale).astype(np.float32)
  return logits, temps, top_ks, top_ps


def test_filters_match_transformers_warpers_on_random_logits():
  rng = np.random.default_rng(0)
  v, rows = 300, 96
  logits, temps, top_ks, top_ps = _grid(v, rng, rows)
  kcap = int(top_ks.max())
  scaled = jnp.asarray(logits / temps[:, None])
  fn = jax.jit(filter_logits, static_argnums=4)
  out = np.asarray(fn(scaled, jnp.asarray(top_ps), jnp.asarray(np.minimum(top_ks, v)),
                      jnp.ones((rows,), bool), kcap))
  for i in range(rows):
    want, _ = _hf_kept(logits[i], temps[i], top_ks[i], top_ps[i])
    got = out[i] > MASK_VALUE / 2
    np.testing.assert_array_equal(got, want, err_msg=f"row {i}: T={temps[i]} k={top_ks[i]} "
                                                     f"p={top_ps[i]}")
    np.testing.assert_array_equal(out[i][got], np.asarray(scaled)[i][got])


def test_top_p_is_taken_over_the_renormalised_top_k_set():
  # .5/.3/.1/.1 with k=2, p=0.6: the top-k set renormalises to .625/.375, so {0} reaches 0.6
  # alone; a nucleus over the full distribution would keep {0, 1}.
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.1, 0.1]], jnp.float32))
  out = filter_logits(logits, jnp.array([0.6]), jnp.array([2]), jnp.array([True]), 2)
  np.testing.assert_array_equal(np.asarray(out[0]) > MASK_VALUE / 2, [True, False, False, False])
  want, _ = _hf_kept(np.log([0.5, 0.3, 0.1, 0.1]), 1.0, 2, 0.6)
  np.testing.assert_array_equal(want, [True, False, False, False])


def test_branches_give_every_row_the_same_mask_whoever_shares_its_batch():
  rng = np.random.default_rng(1)
  v = 257
  logits = jnp.asarray(rng.normal(size=(6, v)) * 3, jnp.float32)
  top_ks = jnp.array([20, 20, 5, 0, 0, 3], jnp.int32)
  top_ps = jnp.array([0.95, 1.0, 0.7, 1.0, 0.6, 1.0], jnp.float32)
  sampled = jnp.ones((6,), bool)
  # Only top-k rows (with or without top-p): the top-k branch, no full-vocabulary sort.
  assert int(filter_branch(top_ps[:3], top_ks[:3], sampled[:3])) == 1
  assert int(filter_branch(top_ps[3:4], top_ks[3:4], sampled[3:4])) == 0
  # A row with top-p and no top-k: the full sort.
  assert int(filter_branch(top_ps, top_ks, sampled)) == 2
  # ...but a greedy row with top-p does not force it.
  assert int(filter_branch(top_ps, top_ks, sampled.at[4].set(False))) == 1
  mixed = np.asarray(filter_logits(logits, top_ps, top_ks, sampled, 20))
  for rows in ([0], [1], [2], [0, 1, 2], [5, 3]):
    idx = jnp.asarray(rows)
    alone = np.asarray(filter_logits(logits[idx], top_ps[idx], top_ks[idx], sampled[idx], 20))
    np.testing.assert_array_equal(alone, mixed[rows])


def test_sampled_tokens_stay_in_the_reference_set_and_logprobs_match():
  rng = np.random.default_rng(2)
  v, b = 120, 12
  logits, temps, top_ks, top_ps = _grid(v, rng, b)
  top_ks = np.minimum(top_ks, v)
  fn = jax.jit(sample_tokens, static_argnames="max_top_k")
  for trial in range(6):
    seeds = seed_key_data(np.arange(b) + 1000 * trial)
    tok, lp = fn(jnp.asarray(logits), jnp.asarray(seeds), jnp.full((b,), 3, jnp.int32),
                 jnp.asarray(temps), jnp.asarray(top_ps), jnp.asarray(top_ks),
                 max_top_k=int(top_ks.max()))
    for i in range(b):
      kept, z = _hf_kept(logits[i], temps[i], top_ks[i], top_ps[i])
      t = int(tok[i])
      assert kept[t], (i, t)
      zk = z[kept]  # float64 log-softmax over the reference's kept set
      ref = z[t] - zk.max() - np.log(np.sum(np.exp(zk - zk.max())))
      np.testing.assert_allclose(float(lp[i]), ref, atol=2e-5)


def test_sample_frequencies_follow_the_filtered_distribution():
  logits = jnp.log(jnp.array([[0.45, 0.3, 0.15, 0.1]], jnp.float32))

  def one(s, k, p):
    return sample_tokens(logits, seed_key_data([0])[0][None] + jnp.uint32(s),
                         jnp.zeros((1,), jnp.int32), jnp.ones((1,)), jnp.full((1,), p),
                         jnp.full((1,), k, jnp.int32), max_top_k=3)[0][0]

  for k, p, want in ((0, 1.0, [0.45, 0.3, 0.15, 0.1]),
                     (3, 1.0, [0.5, 1 / 3, 1 / 6, 0.0]),
                     (3, 0.8, [0.6, 0.4, 0.0, 0.0])):  # .5 + .333 >= .8 over the top-3 set
    toks = np.asarray(jax.jit(jax.vmap(lambda s: one(s, k, p)))(jnp.arange(4000,
                                                                        dtype=jnp.uint32)))
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / toks.size, want, atol=0.03)


def test_greedy_and_topk_logprobs():
  logits = jnp.array([[0.1, 2.0, -1.0, 1.5]], jnp.float32)
  tok, lp = sample_tokens(logits, jnp.zeros((1, 2), jnp.uint32), jnp.zeros((1,), jnp.int32),
                          jnp.zeros((1,)), jnp.full((1,), 0.5), jnp.full((1,), 1, jnp.int32),
                          max_top_k=1)
  assert int(tok[0]) == 1  # greedy ignores top-k / top-p and reports untempered log-probs
  np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits)[0, 1]), rtol=1e-6)
  ids, vals = topk_logprobs(logits, 2)
  np.testing.assert_array_equal(ids[0], [1, 3])
  assert float(jnp.exp(vals).sum()) <= 1.0


def test_topk_logprobs_are_at_each_rows_temperature():
  """The monitor compares the engine's top-k with the dense side's softmax(logits / T): row b
  at temperature T_b (greedy rows at 1), same ids as the raw logits, float64 reference."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 3, (4, 50)).astype(np.float32)
  temps = np.array([0.7, 1.0, 0.0, 1.6], np.float32)
  ids, vals = topk_logprobs(jnp.asarray(logits), 5, jnp.asarray(temps))
  t = np.where(temps <= 0, 1.0, temps).astype(np.float64)[:, None]
  x = logits.astype(np.float64) / t
  ref = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
  want_ids = np.argsort(-logits, axis=-1)[:, :5]
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(ref, want_ids, -1),
                             rtol=1e-5, atol=1e-5)
  raw_ids, raw = topk_logprobs(jnp.asarray(logits), 5)
  np.testing.assert_allclose(np.asarray(vals)[1:3], np.asarray(raw)[1:3], atol=1e-6)
  assert not np.allclose(np.asarray(vals)[0], np.asarray(raw)[0], atol=1e-3)


def test_request_seeds_are_distinct_over_1000_steps_of_the_largest_preset():
  from sparrow_jax.run.config import PRESETS
  big = max(PRESETS.values(), key=lambda c: c.batch_size)
  steps, rounds = np.arange(1000), np.arange(2)  # the first rollout and one refill round
  p, g = np.arange(big.prompts_per_step), np.arange(big.group_size)
  grid = np.meshgrid(steps, rounds, p, g, indexing="ij")
  seeds = request_seed(big.seed, *grid)
  assert seeds.size == 1000 * 2 * big.batch_size >= 1000 * 256
  assert np.unique(seeds).size == seeds.size
  assert request_seed(big.seed, 7, 1, 3, 5) == int(seeds[7, 1, 3, 5])  # scalar form
  assert request_seed(big.seed + 1, 7, 1, 3, 5) != request_seed(big.seed, 7, 1, 3, 5)
  # The linear formula it replaces collides once prompts x G exceeds 9,176.
  old = lambda step, i, gg, G=8: 0 * 1_000_003 + step * 9_176 + i * G + gg
  assert old(0, 9_176 // 8, 0) == old(1, 0, 0)
  for bad in ({"step": -1}, {"sample": 1.5}, {"prompt": True}):
    args = {**dict(step=0, round_=0, prompt=0, sample=0), **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
      request_seed(0, **args)


def test_seed_key_words_are_prngkey_for_32_bit_seeds_and_use_all_64_bits():
  for s in (0, 5, 2**31 - 1, 2**32 - 1):
    np.testing.assert_array_equal(seed_key_data([s])[0], np.asarray(jax.random.PRNGKey(s)))
  words = seed_key_data([2**63 + 12345, 12345])
  assert words[0, 0] == 2**31 and words[0, 1] == words[1, 1] == 12345
  with pytest.raises(ValueError, match="SamplingParams.seed"):
    SamplingParams(seed=-1)
  with pytest.raises(ValueError, match="SamplingParams.seed"):
    SamplingParams(seed=2**64)


def test_row_argmax_is_jnp_argmax_with_ties_infinities_and_nan():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((12, 1000)).astype(np.float32)
  x[1, [3, 700]] = 9.0  # a tie: the first wins
  x[2] = -np.inf  # a fully masked row
  x[3, ::2] = -np.inf
  x[4, [5, 10]] = np.nan  # NaN counts as the maximum, its first one
  x[5, 999] = np.inf
  x[6, [0, 999]] = np.inf
  x[7] = 0.0
  x[7, 500] = -0.0
  x[8] = np.round(x[8])  # many ties
  x[9, 20] = np.nan
  x[9, 10] = np.inf
  got = np.asarray(jax.jit(row_argmax)(jnp.asarray(x)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  np.testing.assert_array_equal(got[[1, 2, 4, 9]], [3, 0, 5, 20])
