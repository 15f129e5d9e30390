"""Tests of the acceptance-rate metrics against float64 numpy references and hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from sparrow_jax.schedule import mismatch as mm


def _softmax64(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _alpha_ref(p_logits, q_logits):
  """float64 reference: sum_v min(p(v), q(v))."""
  return np.minimum(_softmax64(p_logits), _softmax64(q_logits)).sum(-1)


def _pair(seed, shape, noise=1.0, scale=3.0):
  rng = np.random.default_rng(seed)
  p = (scale * rng.normal(size=shape)).astype(np.float32)
  q = (p + noise * rng.normal(size=shape)).astype(np.float32)
  return p, q


class AcceptanceRateTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_float64_reference(self):
    for shape, noise in (((7, 33), 0.5), ((2, 5, 100), 2.0), ((3, 1, 4, 17), 0.1)):
      p, q = _pair(0, shape, noise)
      got = self.variant(mm.acceptance_rate)(p, q)
      chex.assert_shape(got, shape[:-1])
      assert got.dtype == jnp.float32
      np.testing.assert_allclose(np.asarray(got), _alpha_ref(p, q), atol=2e-6)

  def test_bfloat16_inputs_accumulate_in_float32(self):
    p, q = _pair(1, (4, 9, 300), 1.0)
    pb, qb = jnp.asarray(p, jnp.bfloat16), jnp.asarray(q, jnp.bfloat16)
    got = mm.acceptance_rate(pb, qb)
    assert got.dtype == jnp.float32
    want = _alpha_ref(np.asarray(pb.astype(jnp.float32)), np.asarray(qb.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)

  def test_identical_distributions_give_one(self):
    p, _ = _pair(2, (3, 11, 257))
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, p)), 1.0, atol=1e-6)
    # softmax is shift-invariant: the same distribution from shifted logits
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, p + 5.0)), 1.0, atol=1e-6)
    assert float(jnp.max(mm.acceptance_rate(p, p))) <= 1.0

  def test_one_minus_total_variation(self):
    p, q = _pair(3, (6, 40), 2.0)
    tv = 0.5 * np.abs(_softmax64(p) - _softmax64(q)).sum(-1)
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, q)), 1.0 - tv, atol=2e-6)

  def test_hand_example_and_disjoint_support(self):
    p = np.log(np.array([[0.5, 0.3, 0.2, 1e-30]], np.float32))
    q = np.log(np.array([[0.2, 0.3, 0.5, 1e-30]], np.float32))
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, q)), [0.7], atol=1e-6)
    big = 1e4
    p = np.array([[0.0, 0.0, -big, -big]], np.float32)
    q = np.array([[-big, -big, 0.0, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, q)), [0.0], atol=1e-7)

  def test_chunking_gives_identical_results(self):
    p, q = _pair(4, (3, 13, 50), 1.0)
    ref = np.asarray(mm.acceptance_rate(p, q))  # one chunk
    row_bytes = 50 * 4 * 6
    assert mm.rows_per_chunk(50, row_bytes) == 1
    assert mm.rows_per_chunk(50, 5 * row_bytes) == 5  # 39 rows: 8 chunks, last one padded
    for cb in (1, row_bytes, 5 * row_bytes, 38 * row_bytes, 10**9):
      got = jax.jit(lambda a, b, cb=cb: mm.acceptance_rate(a, b, chunk_bytes=cb))(p, q)
      np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-7)
      np.testing.assert_array_equal(mm.acceptance_rate_numpy(p, q, chunk_bytes=cb),
                                    mm.acceptance_rate_numpy(p, q))

  def test_mask(self):
    p, q = _pair(5, (2, 6, 20), 1.0)
    mask = np.array([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1]], bool)
    got = np.asarray(mm.acceptance_rate(p, q, mask, fill_value=-1.0))
    want = np.where(mask, _alpha_ref(p, q), -1.0)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(mm.acceptance_rate_numpy(p, q, mask, fill_value=-1.0), want,
                               atol=1e-12)

  def test_numpy_version_is_float64(self):
    p, q = _pair(6, (5, 64), 1.0)
    got = mm.acceptance_rate_numpy(p, q)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _alpha_ref(p, q), atol=1e-13)

  def test_errors(self):
    p, q = _pair(7, (4, 10), 1.0)
    with pytest.raises(ValueError, match="q_logits.shape"):
      mm.acceptance_rate(p, q[:, :9])
    with pytest.raises(ValueError, match="mask.shape"):
      mm.acceptance_rate(p, q, np.ones((3,), bool))
    with pytest.raises(ValueError, match="at least 2 dims"):
      mm.acceptance_rate(p[0], q[0])
    with pytest.raises(ValueError, match="chunk_bytes=0"):
      mm.acceptance_rate(p, q, chunk_bytes=0)
    if not jax.config.jax_enable_x64:
      with pytest.raises(ValueError, match="dtype=float64"):
        mm.acceptance_rate(p, q, dtype=jnp.float64)


class TopKTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_topk_logprobs_match_numpy(self):
    rng = np.random.default_rng(8)
    x = (3 * rng.normal(size=(2, 7, 61))).astype(np.float32)
    ids, lps = self.variant(lambda a: mm.topk_logprobs(a, 5, chunk_bytes=61 * 4 * 3 * 4))(x)
    chex.assert_shape([ids, lps], (2, 7, 5))
    assert ids.dtype == jnp.int32 and lps.dtype == jnp.float32
    lsm = np.log(_softmax64(x))
    want_ids = np.argsort(-lsm, axis=-1)[..., :5]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(lps), np.take_along_axis(lsm, want_ids, -1),
                               atol=2e-6)
    assert np.all(np.diff(np.asarray(lps), axis=-1) <= 0)
    with pytest.raises(ValueError, match="k=62"):
      mm.topk_logprobs(x, 62)

  def test_hand_example(self):
    p = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    q = np.log(np.array([[0.2, 0.3, 0.5]], np.float32))
    pi, pl = mm.topk_logprobs(p, 2)  # {0: .5, 1: .3}
    qi, ql = mm.topk_logprobs(q, 2)  # {2: .5, 1: .3}
    bound = mm.topk_acceptance_lower_bound(pi, pl, qi, ql)
    np.testing.assert_allclose(np.asarray(bound), [0.3], atol=1e-6)  # only token 1 is shared
    np.testing.assert_allclose(np.asarray(mm.acceptance_rate(p, q)), [0.7], atol=1e-6)

  def test_bound_below_exact_and_tight_at_full_k(self):
    p, q = _pair(9, (3, 12, 40), 1.5, scale=2.0)
    exact = _alpha_ref(p, q)
    prev = np.zeros_like(exact)

    @jax.jit
    def topk_all(a, b):  # every k in one compiled function
      return [mm.topk_logprobs(a, k) + mm.topk_logprobs(b, k) for k in (1, 3, 10, 20, 39, 40)]

    for k, (pi, pl, qi, ql) in zip((1, 3, 10, 20, 39, 40), topk_all(p, q)):
      b = np.asarray(mm.topk_acceptance_lower_bound(pi, pl, qi, ql))
      assert np.all(b <= exact + 2e-6), k
      assert np.all(b >= prev - 2e-6), k  # larger sets never lower the bound
      prev = b
    np.testing.assert_allclose(prev, exact, atol=2e-6)  # k = V: equality

  def test_tight_when_k_covers_support(self):
    rng = np.random.default_rng(10)
    v, support = 50, 4
    p = np.full((6, v), -1e4, np.float32)
    q = np.full((6, v), -1e4, np.float32)
    for t in range(6):
      s = rng.choice(v, support, replace=False)
      p[t, s] = rng.normal(size=support)
      q[t, s[:3]] = rng.normal(size=3)  # q's support is inside p's
    pi, pl = mm.topk_logprobs(p, support)
    qi, ql = mm.topk_logprobs(q, support)
    np.testing.assert_allclose(np.asarray(mm.topk_acceptance_lower_bound(pi, pl, qi, ql)),
                               _alpha_ref(p, q), atol=2e-6)

  def test_padding_ids_mask_and_different_k(self):
    p_ids = np.array([[3, 1, -1]])
    p_lp = np.log(np.array([[0.6, 0.4, 0.5]]))  # the padded slot must be ignored
    q_ids = np.array([[1, -1]])
    q_lp = np.log(np.array([[0.9, 0.5]]))
    got = mm.topk_acceptance_lower_bound(p_ids, p_lp, q_ids, q_lp)
    np.testing.assert_allclose(np.asarray(got), [0.4], atol=1e-6)
    got = mm.topk_acceptance_lower_bound(p_ids, p_lp, q_ids, q_lp, np.array([False]),
                                         fill_value=9.0)
    np.testing.assert_allclose(np.asarray(got), [9.0])
    with pytest.raises(ValueError, match="q_ids.shape"):
      mm.topk_acceptance_lower_bound(p_ids, p_lp, q_ids[0], q_lp[0])
    with pytest.raises(ValueError, match="equal shape"):
      mm.topk_acceptance_lower_bound(p_ids, p_lp[:, :2], q_ids, q_lp)


class StatsTest(chex.TestCase):

  def test_bin_stats_vs_numpy(self):
    rng = np.random.default_rng(11)
    n = 5000
    pos = rng.integers(1, 1000, size=(5, n // 5))
    alpha = np.where(rng.random(pos.shape) < 0.7, 1.0, rng.beta(2, 3, size=pos.shape))
    mask = rng.random(pos.shape) < 0.9
    st = mm.bin_stats(alpha, pos, mask, bin_size=100)
    assert st.num_bins == 10
    a, b = alpha[mask], pos[mask] // 100
    for i in range(10):
      x = a[b == i]
      assert st.count[i] == x.size
      np.testing.assert_allclose(st.mean[i], x.mean(), rtol=1e-12)
      np.testing.assert_allclose([st.p1[i], st.p5[i], st.p10[i], st.p50[i]],
                                 [np.percentile(x, q) for q in (1, 5, 10, 50)], rtol=1e-12)
      np.testing.assert_allclose(st.frac_accepted[i], np.mean(x >= 0.999), rtol=1e-12)
      assert st.start[i] == 100 * i and st.centre[i] == 100 * i + 50
    rows = st.rows()
    assert len(rows) == 10 and rows[3]["p5"] == st.p5[3]

  def test_bin_stats_empty_bins_and_clamped_tail(self):
    alpha = np.array([0.1, 0.2, 0.3, 0.4, 1.0])
    pos = np.array([0, 5, 25, 40, 99])
    st = mm.bin_stats(alpha, pos, bin_size=10)
    np.testing.assert_array_equal(st.count, [2, 0, 1, 0, 1, 0, 0, 0, 0, 1])
    assert np.isnan(st.p5[1]) and np.isnan(st.mean[3])
    st = mm.bin_stats(alpha, pos, bin_size=10, num_bins=3)  # 25, 40, 99 join bin 2
    np.testing.assert_array_equal(st.count, [2, 0, 3])
    np.testing.assert_allclose(st.mean[2], (0.3 + 0.4 + 1.0) / 3)
    np.testing.assert_allclose(st.p50[0], 0.15)
    np.testing.assert_allclose(st.frac_accepted[2], 1 / 3)
    with pytest.raises(ValueError, match="bin_size=0"):
      mm.bin_stats(alpha, pos, bin_size=0)
    with pytest.raises(ValueError, match="positions.shape"):
      mm.bin_stats(alpha, pos[:3], bin_size=10)
    with pytest.raises(ValueError, match="positions min=-1"):
      mm.bin_stats(alpha, pos - 1, bin_size=10)

  def test_pearson(self):
    rng = np.random.default_rng(12)
    pos = rng.integers(1, 4000, size=3000)
    alpha = np.clip(1.0 - pos / 8000 + 0.2 * rng.normal(size=pos.size), 0, 1)
    r = mm.alpha_position_correlation(alpha, pos)
    np.testing.assert_allclose(r, scipy.stats.pearsonr(alpha, pos)[0], rtol=1e-10)
    assert r < -0.2
    st = mm.bin_stats(alpha, pos, bin_size=500)
    r5 = mm.binned_p5_correlation(st)
    np.testing.assert_allclose(r5, np.corrcoef(st.p5, st.centre)[0, 1], rtol=1e-10)
    assert r5 < -0.9
    assert np.isnan(mm.pearson_r([1.0, 1.0, 1.0], [1, 2, 3]))
    assert np.isnan(mm.pearson_r([1.0], [2.0]))
    mask = pos < 2000
    np.testing.assert_allclose(mm.alpha_position_correlation(alpha, pos, mask),
                               np.corrcoef(alpha[mask], pos[mask])[0, 1], rtol=1e-10)


def _ks_ref(x, a, b):
  """sup |ECDF - CDF| computed by hand on the sorted sample."""
  x = np.sort(x)
  n = x.size
  cdf = scipy.stats.beta.cdf(x, a, b)
  return max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))


class BetaTailTest(chex.TestCase):

  def test_recovers_parameters(self):
    rng = np.random.default_rng(13)
    a_true, b_true, n_tail = 2.0, 5.0, 20_000
    tail = rng.beta(a_true, b_true, size=n_tail) * 0.999
    alpha = np.concatenate([tail, np.ones(4 * n_tail)])  # 80 % perfectly aligned tokens
    fit = mm.fit_beta_tail(alpha)
    assert fit.n_tail == n_tail
    np.testing.assert_allclose(fit.tail_fraction, 0.2)
    np.testing.assert_allclose([fit.a, fit.b], [a_true, b_true], rtol=0.05)
    np.testing.assert_allclose(fit.variance, scipy.stats.beta.var(fit.a, fit.b), rtol=1e-10)
    np.testing.assert_allclose(fit.mean, scipy.stats.beta.mean(fit.a, fit.b), rtol=1e-10)
    np.testing.assert_allclose(fit.ks_statistic, _ks_ref(tail / 0.999, fit.a, fit.b),
                               rtol=1e-6)
    assert fit.ks_statistic < 0.02 and fit.ks_pvalue > 1e-3

  def test_ks_flags_a_non_beta_tail(self):
    rng = np.random.default_rng(14)
    # a two-point-ish mixture is not Beta-shaped: the KS statistic must be large
    tail = np.concatenate([rng.uniform(0.05, 0.1, 3000), rng.uniform(0.9, 0.95, 1000)])
    fit = mm.fit_beta_tail(tail)
    assert fit.ks_statistic > 0.1
    np.testing.assert_allclose(fit.ks_statistic, _ks_ref(tail / 0.999, fit.a, fit.b),
                               rtol=1e-6)

  def test_subsample_mask_and_errors(self):
    rng = np.random.default_rng(15)
    tail = rng.beta(3.0, 1.5, size=5000) * 0.999
    fit = mm.fit_beta_tail(tail, max_samples=2000, seed=1)
    assert fit.n_tail == 5000
    np.testing.assert_allclose([fit.a, fit.b], [3.0, 1.5], rtol=0.15)
    mask = np.zeros(5000, bool)
    mask[:1] = True
    with pytest.raises(ValueError, match="1 token"):
      mm.fit_beta_tail(tail, mask)
    with pytest.raises(ValueError, match="threshold=0"):
      mm.fit_beta_tail(tail, threshold=0.0)

  def test_summary(self):
    rng = np.random.default_rng(16)
    pos = np.arange(1, 4001)
    alpha = np.where(rng.random(4000) < 0.8, 1.0, rng.beta(2, 2, 4000) * 0.999)
    s = mm.mismatch_summary(alpha, pos, bin_size=1000)
    assert s["tokens"] == 4000 and len(s["bins"]) == 5
    np.testing.assert_allclose(s["frac_accepted"], np.mean(alpha >= 0.999))
    np.testing.assert_allclose(s["p5"], np.percentile(alpha, 5))
    assert s["beta_tail"]["n_tail"] == int(np.sum(alpha < 0.999))
