"""Tests for sparrow_jax.rl.grpo: hand-computed values and float64 numpy references."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from sparrow_jax.rl import grpo

LN2 = math.log(2.0)


def _lp(ratios):
  """Log-probs whose exp ratio against old_logp = 0 is `ratios`."""
  return jnp.log(jnp.asarray(ratios, jnp.float32))


# ----------------------------------------------------------------------------- float64 reference


def _np_aggregate(per_token, mask, mode, norm_len=None):
  x = np.where(mask > 0, per_token, 0.0) * mask
  if mode == "token-mean":
    return x.sum() / max(mask.sum(), 1.0)
  tok = mask.sum(-1)
  if mode == "seq-mean-token-mean":
    seq = x.sum(-1) / np.maximum(tok, 1.0)
  elif mode == "seq-mean-token-sum":
    seq = x.sum(-1)
  else:  # verl: the batch's token sum over a constant horizon, no mean over sequences
    return x.sum() / (norm_len or per_token.shape[-1])
  valid = tok > 0
  return seq[valid].sum() / max(valid.sum(), 1)


def _np_ppo(logp, old, adv, mask, eps_low, eps_high, c, mode, w):
  r = np.exp(logp - old)
  a = np.broadcast_to(adv[:, None], r.shape)
  l = np.maximum(-a * r, -a * np.clip(r, 1 - eps_low, 1 + eps_high))
  if c is not None:
    l = np.where(a < 0, np.minimum(l, -a * c), l)
  return _np_aggregate(l * w, mask, mode)


# ----------------------------------------------------------------------------- advantages


class AdvantageTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_vs_dr_grpo_hand_values(self):
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # [N*G], N=2, G=4
    grpo_adv = self.variant(lambda r: grpo.group_advantages(r, 4))(rewards)
    dr_adv = self.variant(lambda r: grpo.group_advantages(r, 4, normalize_std=False))(rewards)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> 0.5 / 0.57735 = 0.866025
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    chex.assert_trees_all_close(grpo_adv, jnp.array([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-6)
    chex.assert_trees_all_close(dr_adv, jnp.array([.5, -.5, -.5, .5, 0, 0, 0, 0]), atol=1e-7)

  def test_matrix_input_and_float64_reference(self):
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, 5))  # [N, G]
    got = grpo.group_advantages(jnp.asarray(r, jnp.float32), 5, eps=1e-6)
    want = (r - r.mean(-1, keepdims=True)) / (r.std(-1, ddof=1, keepdims=True) + 1e-6)
    chex.assert_shape(got, (3, 5))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    flat = grpo.group_advantages(jnp.asarray(r.reshape(-1), jnp.float32), 5)
    np.testing.assert_allclose(np.asarray(flat), np.asarray(got).reshape(-1), atol=1e-6)

  def test_bad_shapes(self):
    with pytest.raises(ValueError, match="group_size=4"):
      grpo.group_advantages(jnp.zeros((6,)), 4)
    with pytest.raises(ValueError, match="group_size=4"):
      grpo.group_advantages(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="group_size=0"):
      grpo.group_advantages(jnp.zeros((4,)), 0)


# ----------------------------------------------------------------------------- aggregation

# Row 2 is all padding; masked entries hold junk (100, NaN) that must not leak.
PER_TOKEN = jnp.array([[1.0, 2.0, 3.0, 100.0], [5.0, 6.0, jnp.nan, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.int32)


class AggregateTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("token_mean", "token-mean", None, 17.0 / 5.0),  # (1+2+3+5+6) / 5 tokens
      ("seq_mean_token_mean", "seq-mean-token-mean", None, (6.0 / 3 + 11.0 / 2) / 2),
      ("seq_mean_token_sum", "seq-mean-token-sum", None, (6.0 + 11.0) / 2),
      ("dr_grpo_default_T", "seq-mean-token-sum-norm", None, (6.0 + 11.0) / 4),
      ("dr_grpo_norm_8", "seq-mean-token-sum-norm", 8, (6.0 + 11.0) / 8),
  )
  def test_modes_hand_values(self, mode, norm_len, want):
    got = self.variant(lambda x, m: grpo.aggregate_loss(x, m, mode, norm_len))(PER_TOKEN, MASK)
    chex.assert_trees_all_close(got, jnp.float32(want), atol=1e-6)

  def test_micro_batches_with_global_denominators_sum_to_the_whole(self):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, 7))
    mask = (rng.uniform(size=(8, 7)) < 0.5).astype(np.float64)
    mask[2:4] = 0  # a fully masked micro-batch (rows 2, 3) must contribute exactly 0
    mask[4, :] = 1  # uneven token counts across micro-batches
    for mode in grpo.AGG_MODES:
      whole = _np_aggregate(x, mask, mode, 5)
      den = grpo.loss_denominators(jnp.asarray(mask, jnp.float32))
      parts = [grpo.aggregate_loss(jnp.asarray(x[s:s + 2], jnp.float32),
                                   jnp.asarray(mask[s:s + 2], jnp.float32), mode, 5, **den)
               for s in range(0, 8, 2)]
      assert float(parts[1]) == 0.0, mode
      np.testing.assert_allclose(float(sum(parts)), whole, rtol=1e-5, atol=1e-6, err_msg=mode)

  def test_empty_mask_is_zero_and_bad_mode(self):
    z = jnp.zeros((2, 3))
    for mode in grpo.AGG_MODES:
      assert float(grpo.aggregate_loss(z + 5, z, mode)) == 0.0
    with pytest.raises(ValueError, match="mode='sum'"):
      grpo.aggregate_loss(z, z, "sum")
    with pytest.raises(ValueError, match="shape"):
      grpo.aggregate_loss(z, jnp.zeros((2, 4)))


# ----------------------------------------------------------------------------- PPO clip


@pytest.mark.parametrize(
    "ratio, adv, want_loss, want_grad, low, high",
    [
        # A > 0: only the ceiling 1 + ε_high = 1.28 clips.
        (0.79, 1.0, -0.79, -0.79, 0, 0),
        (0.81, 1.0, -0.81, -0.81, 0, 0),
        (1.27, 1.0, -1.27, -1.27, 0, 0),
        (1.29, 1.0, -1.28, 0.0, 0, 1),
        # A < 0: only the floor 1 - ε_low = 0.8 clips.
        (0.79, -1.0, 0.80, 0.0, 1, 0),
        (0.81, -1.0, 0.81, 0.81, 0, 0),
        (1.27, -1.0, 1.27, 1.27, 0, 0),
        (1.29, -1.0, 1.29, 1.29, 0, 0),
        # |A| = 2 scales the loss.
        (1.50, 2.0, -2.56, 0.0, 0, 1),
        (0.50, -2.0, 1.60, 0.0, 1, 0),
    ])
def test_clip_higher_just_inside_outside(ratio, adv, want_loss, want_grad, low, high):
  old = jnp.zeros((1, 1))
  mask = jnp.ones((1, 1))
  advs = jnp.array([adv])

  def f(lp):
    return grpo.ppo_clip_loss(lp, old, advs, mask, eps_low=0.2, eps_high=0.28)

  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(_lp([[ratio]]))
  np.testing.assert_allclose(float(loss), want_loss, atol=1e-5)
  # d(-A rho)/d logp = -A rho where unclipped, 0 where the clip is active.
  np.testing.assert_allclose(float(grad[0, 0]), want_grad, atol=1e-5)
  assert float(m["clip_frac_low"]) == low
  assert float(m["clip_frac_high"]) == high
  assert float(m["dual_clip_frac"]) == 0.0


class PPOTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_dual_clip(self):
    # A = -1: rho = 4 -> max(4, 1.28) = 4 capped at c = 3; rho = 2 -> 2 (< c).
    # A = +1: rho = 4 -> max(-4, -1.28) = -1.28; the dual clip never applies.
    lp = _lp([[4.0, 2.0], [4.0, 1.0]])
    old = jnp.zeros((2, 2))
    adv = jnp.array([-1.0, 1.0])
    mask = jnp.ones((2, 2))

    def f(lp):
      return grpo.ppo_clip_loss(lp, old, adv, mask, dual_clip_c=3.0, agg="token-mean")

    (loss, m), grad = self.variant(jax.value_and_grad(f, has_aux=True))(lp)
    chex.assert_trees_all_close(loss, jnp.float32((3.0 + 2.0 - 1.28 - 1.0) / 4), atol=1e-5)
    chex.assert_trees_all_close(m["dual_clip_frac"], jnp.float32(0.25))
    chex.assert_trees_all_close(m["clip_frac_high"], jnp.float32(0.25))
    # Gradient only where nothing clips: token (0,1): -A rho / 4 = 0.5; token (1,1): -1 / 4.
    chex.assert_trees_all_close(grad, jnp.array([[0.0, 0.5], [0.0, -0.25]]), atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
  def test_aggregations_in_loss(self, mode):
    # rho = 1 everywhere; A per sequence [1, -2]; row 0 has 3 tokens, row 1 has 1 (T = 4).
    want = {"token-mean": (-3.0 + 2.0) / 4, "seq-mean-token-mean": (-1.0 + 2.0) / 2,
            "seq-mean-token-sum-norm": (-3.0 + 2.0) / 4}[mode]
    lp = jnp.full((2, 4), -1.3)
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)
    f = self.variant(lambda lp: grpo.ppo_clip_loss(lp, lp, jnp.array([1.0, -2.0]), mask,
                                                   agg=mode)[0])
    chex.assert_trees_all_close(f(lp), jnp.float32(want), atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_against_float64_reference(self):
    rng = np.random.default_rng(1)
    b, t = 6, 9
    old = np.log(rng.uniform(0.05, 1.0, (b, t)))
    logp = old + rng.normal(0, 0.4, (b, t))
    adv = rng.normal(size=b)
    mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float64)
    mask[:, 0] = 1
    w = rng.uniform(0.2, 2.0, (b, t))
    for mode in grpo.AGG_MODES:
      for c in (None, 2.0):
        f = self.variant(lambda lp, o, a, m, w, mode=mode, c=c: grpo.ppo_clip_loss(
            lp, o, a, m, eps_low=0.2, eps_high=0.28, dual_clip_c=c, agg=mode, is_weights=w)[0])
        got = f(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask, w)))
        want = _np_ppo(logp, old, adv, mask, 0.2, 0.28, c, mode, w)
        np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)

  def test_metrics_kl_and_ratio(self):
    lp = _lp([[1.1, 0.9, 5.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    _, m = grpo.ppo_clip_loss(lp, jnp.zeros((1, 3)), jnp.zeros((1,)), mask)
    np.testing.assert_allclose(float(m["approx_kl"]), -(math.log(1.1) + math.log(0.9)) / 2,
                               atol=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in (1.1, 0.9)) / 2  # k3 of KL(old || new), samples from old
    np.testing.assert_allclose(float(m["approx_kl_k3"]), k3, atol=1e-6)
    np.testing.assert_allclose(float(m["ratio_max"]), 1.1, atol=1e-6)  # 5.0 is masked out
    np.testing.assert_allclose(float(m["ratio_min"]), 0.9, atol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-6)

  def test_bad_arguments(self):
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="dual_clip_c=1.0"):
      grpo.ppo_clip_loss(x, x, jnp.zeros(1), x, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low=1.0"):
      grpo.ppo_clip_loss(x, x, jnp.zeros(1), x, eps_low=1.0)
    with pytest.raises(ValueError, match="advantages shape"):
      grpo.ppo_clip_loss(x, x, jnp.zeros(3), x)


# ----------------------------------------------------------------------------- KL, entropy


class KLEntropyTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_k1_k2_k3_hand_values_and_grads(self):
    logp = jnp.full((1, 2), math.log(0.5))
    ref = jnp.full((1, 2), math.log(0.25))
    want = {"k1": LN2, "k2": 0.5 * LN2**2, "k3": 0.5 + LN2 - 1.0, "low_var_kl": 0.5 + LN2 - 1.0}
    # d/dlogp: k1 -> 1; k2 -> logp - ref = ln 2; k3 -> 1 - exp(ref - logp) = 0.5.
    want_grad = {"k1": 1.0, "k2": LN2, "k3": 0.5, "low_var_kl": 0.5}
    for kind in grpo.KL_KINDS:
      f = self.variant(lambda lp, r, kind=kind: jnp.sum(grpo.kl_penalty(lp, r, kind)))
      val, (g_lp, g_ref) = jax.value_and_grad(f, argnums=(0, 1))(logp, ref)
      np.testing.assert_allclose(float(val), 2 * want[kind], atol=1e-6, err_msg=kind)
      np.testing.assert_allclose(np.asarray(g_lp), want_grad[kind], atol=1e-6, err_msg=kind)
      np.testing.assert_allclose(np.asarray(g_ref), 0.0, err_msg=kind)  # reference is a target

  def test_k3_clamped_like_verl(self):
    got = grpo.kl_penalty(jnp.array([[0.0, 0.0]]), jnp.array([[30.0, -30.0]]), "k3")
    # ref - logp = 30 -> clamp 20 -> exp(20) - 21 -> clamp 10; -30 -> exp(-20) + 19 -> 10.
    chex.assert_trees_all_close(got, jnp.array([[10.0, 10.0]]))
    with pytest.raises(ValueError, match="kind='k4'"):
      grpo.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k4")

  @chex.variants(with_jit=True, without_jit=True)
  def test_entropy(self):
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [math.log(.5), math.log(.25), math.log(.25), -1e4]]],
                       jnp.bfloat16)  # [B=1, T=2, V=4]
    ent = self.variant(grpo.entropy_from_logits)(logits, jnp.array([[1, 1]]))
    chex.assert_type(ent, jnp.float32)
    # uniform over 4: ln 4; (1/2, 1/4, 1/4): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2.
    chex.assert_trees_all_close(ent, jnp.array([[2 * LN2, 1.5 * LN2]]), atol=2e-3)
    masked = grpo.entropy_from_logits(logits, jnp.array([[1, 0]]))
    assert float(masked[0, 1]) == 0.0

  def test_entropy_float64_reference(self):
    x = np.random.default_rng(2).normal(0, 3, (2, 3, 7))
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    got = grpo.entropy_from_logits(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- mismatch


class RolloutCorrectionTest(chex.TestCase):

  # ratio = exp(old - rollout): [0.4, 1.0, 1.5, 3.0, 10.0]; the last token is padding.
  OLD = jnp.log(jnp.array([[0.4, 1.0, 1.5, 3.0, 10.0]]))
  ROLL = jnp.zeros((1, 5))
  MASK = jnp.array([[1, 1, 1, 1, 0]], jnp.int32)

  @chex.variants(with_jit=True, without_jit=True)
  def test_tis_cap(self):
    f = self.variant(lambda o, r, m: grpo.rollout_correction(o, r, m, tis_cap=2.0))
    w, mask, s = f(self.OLD, self.ROLL, self.MASK)
    chex.assert_trees_all_close(w, jnp.array([[0.4, 1.0, 1.5, 2.0, 0.0]]), atol=1e-6)
    chex.assert_trees_all_equal(mask, self.MASK)
    chex.assert_trees_all_close(s["is_frac_truncated"], jnp.float32(0.25))
    chex.assert_trees_all_close(s["is_frac_masked"], jnp.float32(0.0))
    chex.assert_trees_all_close(s["is_ratio_mean"], jnp.float32((0.4 + 1 + 1.5 + 3) / 4),
                                atol=1e-6)
    chex.assert_trees_all_close(s["is_ratio_max"], jnp.float32(3.0), atol=1e-6)
    chex.assert_trees_all_close(s["is_weight_mean"], jnp.float32((0.4 + 1 + 1.5 + 2) / 4),
                                atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_masking(self):
    f = self.variant(lambda o, r, m: grpo.rollout_correction(o, r, m, tis_cap=None,
                                                             mask_threshold=2.0))
    w, mask, s = f(self.OLD, self.ROLL, self.MASK)
    # kept: 1/2 <= ratio <= 2 -> 1.0, 1.5; dropped: 0.4 (below), 3.0 (above).
    chex.assert_trees_all_equal(mask, jnp.array([[0, 1, 1, 0, 0]], jnp.int32))
    chex.assert_trees_all_close(w, jnp.array([[0.0, 1.0, 1.0, 0.0, 0.0]]))
    chex.assert_trees_all_close(s["is_frac_masked"], jnp.float32(0.5))
    # mask_low=0 keeps everything below the threshold; cap and mask combine.
    w2, mask2, _ = grpo.rollout_correction(self.OLD, self.ROLL, self.MASK, tis_cap=1.2,
                                           mask_threshold=2.0, mask_low=0.0)
    chex.assert_trees_all_equal(mask2, jnp.array([[1, 1, 1, 0, 0]], jnp.int32))
    chex.assert_trees_all_close(w2, jnp.array([[0.4, 1.0, 1.2, 0.0, 0.0]]), atol=1e-6)

  def test_bad_arguments(self):
    with pytest.raises(ValueError, match="mask_threshold=0.5"):
      grpo.rollout_correction(self.OLD, self.ROLL, self.MASK, mask_threshold=0.5)
    with pytest.raises(ValueError, match="tis_cap=0"):
      grpo.rollout_correction(self.OLD, self.ROLL, self.MASK, tis_cap=0)


# ----------------------------------------------------------------------------- grpo_loss


class GRPOLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_combined_hand_value(self):
    # rho = 1, A = 1; TIS ratios [0.5, 4] capped at C = 2 -> w = [0.5, 2] -> PG = -1.25.
    # k1 with logp = ln .5, ref = ln .25: ln 2 per token, β = 0.1; entropy [0.5, 1.5] -> 1.0.
    cfg = grpo.GRPOLossConfig(kl_coef=0.1, kl_kind="k1", entropy_coeff=0.01, tis_cap=2.0)
    logp = jnp.full((1, 2), math.log(0.5))
    roll = logp - jnp.log(jnp.array([[0.5, 4.0]]))
    ref = jnp.full((1, 2), math.log(0.25))
    ent = jnp.array([[0.5, 1.5]])
    f = self.variant(lambda lp, e: grpo.grpo_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2)), cfg,
                                                  ref_logp=ref, rollout_logp=roll, entropy=e))
    loss, m = f(logp, ent)
    want = -1.25 + 0.1 * LN2 - 0.01 * 1.0
    chex.assert_trees_all_close(loss, jnp.float32(want), atol=1e-6)
    chex.assert_trees_all_close(m["kl"], jnp.float32(LN2), atol=1e-6)
    chex.assert_trees_all_close(m["entropy"], jnp.float32(1.0))
    chex.assert_trees_all_close(m["is_frac_truncated"], jnp.float32(0.5))
    chex.assert_tree_all_finite(m)

  def test_gradients_flow_only_through_logp_and_entropy(self):
    rng = np.random.default_rng(3)
    b, t = 4, 6
    arrs = [jnp.asarray(rng.normal(-1, 0.3, (b, t)), jnp.float32) for _ in range(4)]
    adv = jnp.asarray(rng.normal(size=b), jnp.float32)
    ent = jnp.asarray(rng.uniform(size=(b, t)), jnp.float32)
    mask = jnp.ones((b, t))
    cfg = grpo.GRPOLossConfig(kl_coef=0.05, entropy_coeff=0.01, tis_cap=2.0,
                              dual_clip_c=3.0)

    def f(logp, old, ref, roll, adv, ent):
      return grpo.grpo_loss(logp, old, adv, mask, cfg, ref_logp=ref, rollout_logp=roll,
                            entropy=ent)[0]

    grads = jax.grad(f, argnums=range(6))(*arrs, adv, ent)
    assert float(jnp.abs(grads[0]).sum()) > 0
    for i in (1, 2, 3, 4):
      chex.assert_trees_all_equal(grads[i], jnp.zeros_like(grads[i]))
    chex.assert_trees_all_close(grads[5], jnp.full((b, t), -0.01 / (b * t)), atol=1e-8)

  def test_missing_inputs_and_config_errors(self):
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="rollout_logp=None"):
      grpo.grpo_loss(x, x, jnp.zeros(1), x + 1, grpo.GRPOLossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="ref_logp=None"):
      grpo.grpo_loss(x, x, jnp.zeros(1), x + 1, grpo.GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy=None"):
      grpo.grpo_loss(x, x, jnp.zeros(1), x + 1, grpo.GRPOLossConfig(entropy_coeff=0.1))
    with pytest.raises(ValueError, match="GRPOLossConfig.agg='mean'"):
      grpo.GRPOLossConfig(agg="mean")
    with pytest.raises(ValueError, match="GRPOLossConfig.kl_coef=-1"):
      grpo.GRPOLossConfig(kl_coef=-1)
    with pytest.raises(ValueError, match="tis_mask_threshold"):
      grpo.GRPOLossConfig(tis_mask_threshold=0.9)


# ----------------------------------------------------------------------------- dynamic sampling


class DynamicSamplingTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_filter_groups(self):
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.50001]])
    keep, n = self.variant(grpo.filter_groups)(r)
    chex.assert_trees_all_equal(keep, jnp.array([False, True, False, True]))
    assert int(n) == 2
    keep, n = grpo.filter_groups(r, atol=1e-3)
    assert keep.tolist() == [False, True, False, False] and int(n) == 1


def test_group_pool_refill():
  pool = grpo.GroupPool(group_size=2)
  # batch 1: groups [1,1] (dropped), [0,1] (kept); arrays carry the sample index.
  kept = pool.add(np.array([1.0, 1.0, 0.0, 1.0]), ids=np.arange(4),
                  tokens=np.arange(8).reshape(4, 2))
  assert kept == 1 and pool.num_groups == 1
  kept = pool.add(np.array([[0.0, 0.5], [2.0, 2.0], [1.0, 0.0]]), ids=np.arange(10, 16),
                  tokens=np.arange(12).reshape(6, 2))
  assert kept == 2 and pool.num_groups == 3 and pool.num_seen == 5
  out = pool.pop(2)
  np.testing.assert_array_equal(out["ids"], [2, 3, 10, 11])
  np.testing.assert_array_equal(out["rewards"], [0.0, 1.0, 0.0, 0.5])
  assert out["tokens"].shape == (4, 2)
  assert pool.num_groups == 1
  np.testing.assert_array_equal(pool.pop(1)["ids"], [14, 15])
  with pytest.raises(ValueError, match="num_groups=1"):
    pool.pop(1)
  with pytest.raises(ValueError, match="leading dimension"):
    pool.add(np.zeros(4), ids=np.arange(3))


def test_group_pool_take_pads_with_dropped_groups():
  pool = grpo.GroupPool(group_size=2, keep_dropped=True)
  pool.add(np.array([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), ids=np.arange(6))  # Z I Z
  pool.add(np.array([3.0, 3.0, 1.0, 0.0]), ids=np.arange(10, 14))  # Z I
  assert (pool.num_groups, pool.num_dropped) == (2, 3)
  out, n_kept = pool.take(4)  # 2 informative (FIFO), then the first 2 zero-variance groups
  assert n_kept == 2
  np.testing.assert_array_equal(out["ids"], [2, 3, 12, 13, 0, 1, 4, 5])
  np.testing.assert_array_equal(out["rewards"], [0, 1, 1, 0, 1, 1, 2, 2])
  assert (pool.num_groups, pool.num_dropped) == (0, 0)  # leftovers are discarded
  with pytest.raises(ValueError, match="keep_dropped=True"):
    grpo.GroupPool(group_size=2).take(1)
  with pytest.raises(ValueError, match="num_groups=1"):
    pool.take(1)


def test_combine_micro_metrics():
  per = {"loss": jnp.array([0.5, 0.25, 0.0]), "num_tokens": jnp.array([2.0, 6.0, 0.0]),
         "clip_frac_high": jnp.array([1.0, 0.0, 0.0]), "ratio_max": jnp.array([1.5, 1.2, 0.0]),
         "ratio_min": jnp.array([0.9, 0.7, 0.0]), "is_frac_masked": jnp.array([0.5, 0.0, 0.0])}
  out = grpo.combine_micro_metrics(per, jnp.array([4.0, 6.0, 0.0]))  # micro 2 is empty
  want = {"loss": 0.75, "num_tokens": 8.0, "clip_frac_high": 2.0 / 8.0, "ratio_max": 1.5,
          "ratio_min": 0.7, "is_frac_masked": 2.0 / 10.0}
  for k, v in want.items():
    np.testing.assert_allclose(float(out[k]), v, rtol=1e-6, err_msg=k)


def test_ragged_group_advantages_equal_the_fixed_size_ones_and_handle_pruned_groups():
  rng = np.random.default_rng(4)
  r = rng.integers(0, 2, 12).astype(np.float32)
  fixed = np.asarray(grpo.group_advantages(jnp.asarray(r), 4))
  ids = np.repeat(np.arange(3), 4)
  perm = rng.permutation(12)  # members need not be contiguous
  rag = grpo.ragged_group_advantages(r[perm], ids[perm])
  np.testing.assert_allclose(rag, fixed[perm], atol=1e-6)
  # Unequal sizes: [1, 0, 1] -> mean 2/3, unbiased std sqrt(1/3); a singleton gets 0.
  adv = grpo.ragged_group_advantages([1.0, 0.0, 1.0, 5.0], ["a", "a", "a", "b"])
  s = np.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
  np.testing.assert_allclose(adv, [(1 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6),
                                   (1 / 3) / (s + 1e-6), 0.0], rtol=1e-5)
  dr = grpo.ragged_group_advantages([1.0, 0.0, 1.0], [0, 0, 0], normalize_std=False)
  np.testing.assert_allclose(dr, [1 / 3, -2 / 3, 1 / 3], rtol=1e-6)
  with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
    grpo.ragged_group_advantages([1.0, 0.0, 1.0], [0, 0])
