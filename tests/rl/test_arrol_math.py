"""ARRoL's math: calibration and survival probabilities against hand computations, the keep
rate of the bisection, seeded draws, and the rho_hat / accuracy / AUC metrics."""

import json
from fractions import Fraction as F

import numpy as np
import pytest

from sparrow_jax.rl.arrol_math import (BinnedCalibrator, head_accuracy, head_auc, keep_draws,
                                       key_uniform, rho_hat_stats, survival_probabilities)

PAPER = dict(keep_rate=0.5, target=0.5, lam=0.5, p_min=0.25, p_max=0.75)

# A fixed history on 4 bins: bins are [0, .25), [.25, .5), [.5, .75), [.75, 1].
POS = [0.9, 0.8, 0.6]  # bins 3, 3, 2
NEG = [0.1, 0.3, 0.6, 0.2]  # bins 0, 1, 2, 0


def _fed_calibrator():
  cal = BinnedCalibrator(num_bins=4, alpha=1.0)
  cal.update(POS + NEG, [1] * len(POS) + [0] * len(NEG))
  return cal


# ----------------------------------------------------------------------------- calibration


def test_calibration_equals_hand_computation():
  cal = _fed_calibrator()
  # Counts: pos [0, 0, 1, 2] of 3, neg [2, 1, 1, 0] of 4; Laplace alpha = 1 over 4 bins.
  p_pos = [F(c + 1, 3 + 4) for c in (0, 0, 1, 2)]  # [1, 1, 2, 3] / 7
  p_neg = [F(c + 1, 4 + 4) for c in (2, 1, 1, 0)]  # [3, 2, 2, 1] / 8
  pi = F(3, 7)
  q = [pi * a / (pi * a + (1 - pi) * b) for a, b in zip(p_pos, p_neg)]
  assert q == [F(2, 9), F(3, 10), F(6, 13), F(18, 25)]  # worked out by hand as well
  assert cal.prior == pytest.approx(3 / 7, abs=1e-15)
  np.testing.assert_allclose(cal.bin_posteriors(), [float(x) for x in q], rtol=1e-14)
  # s = 1 belongs to the last bin, s = 0 to the first; bin edges are half-open.
  np.testing.assert_allclose(cal.posterior([0.0, 0.25, 0.5, 0.7499, 1.0]),
                             [2 / 9, 3 / 10, 6 / 13, 6 / 13, 18 / 25], rtol=1e-14)


def test_calibrator_before_any_label_is_uninformative():
  cal = BinnedCalibrator(num_bins=8)
  assert cal.prior == 0.5 and cal.num_seen == 0
  np.testing.assert_array_equal(cal.bin_posteriors(), np.full(8, 0.5))
  # Only positives seen: pi = 1, so every bin says "success" whatever the histogram.
  cal.update([0.1, 0.9], [True, True])
  np.testing.assert_array_equal(cal.bin_posteriors(), np.ones(8))


def test_calibrator_state_round_trips_through_json_exactly():
  cal = _fed_calibrator()
  state = json.loads(json.dumps(cal.state_dict()))
  other = BinnedCalibrator(num_bins=4)
  other.load_state_dict(state)
  np.testing.assert_array_equal(other.bin_posteriors(), cal.bin_posteriors())
  assert other.state_dict() == cal.state_dict()
  with pytest.raises(ValueError, match="num_bins=4: expected 8"):
    BinnedCalibrator(num_bins=8).load_state_dict(state)
  with pytest.raises(ValueError, match=r"score\[1\]=1.5"):
    cal.update([0.5, 1.5], [1, 0])
  with pytest.raises(ValueError, match="labels must be bool or 0/1"):
    cal.update([0.5], [0.7])
  with pytest.raises(ValueError, match="2 labels for 1 scores"):
    cal.update([0.5], [1, 0])


# ----------------------------------------------------------------------------- survival


def test_survival_equals_hand_computation_unclipped():
  cal = _fed_calibrator()
  q = cal.posterior([0.05, 0.3, 0.55, 0.95])  # one score per bin
  p, delta = survival_probabilities(q, **PAPER)
  qf = [F(2, 9), F(3, 10), F(6, 13), F(18, 25)]
  base = [F(1, 2) + F(1, 2) * (F(1, 2) - x) for x in qf]  # kappa + lam (rho - q)
  d = F(1, 2) - sum(base) / 4  # no p is clipped (checked below), so mean(base + d) = kappa
  want = [b + d for b in base]
  assert all(F(1, 4) <= x <= F(3, 4) for x in want)
  assert delta == pytest.approx(float(d), abs=1e-9)
  np.testing.assert_allclose(p, [float(x) for x in want], atol=1e-9)
  # Smaller q (less likely correct) survives more often when rho = 0.5.
  assert np.all(np.diff(p) < 0)


def test_survival_equals_hand_computation_with_clipping():
  # q = [0, 0, 0, 1], lam = 1: base = [1, 1, 1, 0]. With delta < -1/4 the last p sits at
  # p_min = 1/4 and the others at 1 + delta: 3 (1 + delta) + 1/4 = 4 kappa = 2.
  p, delta = survival_probabilities([0, 0, 0, 1], keep_rate=0.5, target=0.5, lam=1.0,
                                    p_min=0.25, p_max=0.75)
  assert delta == pytest.approx(-1.25 / 3, abs=1e-9)
  np.testing.assert_allclose(p, [1 - 1.25 / 3] * 3 + [0.25], atol=1e-9)
  # Three q's: base = [0.65, 0.5, 0.3]; delta = 1/60.
  p, delta = survival_probabilities([0.2, 0.5, 0.9], **PAPER)
  assert delta == pytest.approx(1 / 60, abs=1e-9)
  np.testing.assert_allclose(p, [0.65 + 1 / 60, 0.5 + 1 / 60, 0.3 + 1 / 60], atol=1e-9)


def test_bisection_meets_keep_rate_to_1e6():
  rng = np.random.default_rng(0)
  for trial in range(300):
    n = int(rng.integers(1, 33))
    q = rng.beta(0.3, 0.3, n) if trial % 2 else rng.random(n)  # extremes pile up at 0 and 1
    lam = float(rng.choice([0.0, 0.5, 2.0, 10.0]))
    p_min = float(rng.uniform(0, 0.5))
    p_max = float(rng.uniform(0.5, 1.0))
    kappa = float(rng.uniform(p_min, p_max))
    p, _ = survival_probabilities(q, keep_rate=kappa, target=float(rng.random()), lam=lam,
                                  p_min=p_min, p_max=p_max)
    assert abs(p.mean() - kappa) <= 1e-6, (trial, q, kappa)
    assert np.all((p >= p_min) & (p <= p_max))
  # kappa on the boundary is feasible (everything clipped to it).
  p, _ = survival_probabilities([0.1, 0.9], keep_rate=0.25, target=0.5, lam=0.5, p_min=0.25,
                                p_max=0.75)
  np.testing.assert_allclose(p, [0.25, 0.25], atol=1e-9)
  p, delta = survival_probabilities([], **PAPER)
  assert p.shape == (0,) and delta == 0.0


def test_survival_rejects_infeasible_and_bad_input():
  with pytest.raises(ValueError, match=r"keep_rate=0.8 is outside \[p_min, p_max\].*infeasible"):
    survival_probabilities([0.5], keep_rate=0.8, target=0.5, lam=0.5, p_min=0.25, p_max=0.75)
  with pytest.raises(ValueError, match=r"q\[1\]=nan"):
    survival_probabilities([0.5, float("nan")], **PAPER)
  with pytest.raises(ValueError, match="p_min=0.8, p_max=0.2"):
    survival_probabilities([0.5], keep_rate=0.5, target=0.5, lam=0.5, p_min=0.8, p_max=0.2)


def test_signed_steering_hand_computation():
  # Hard group, mean q = 0.3 < rho: paper base = 0.75 - q/2 = [0.7, 0.65, 0.45], delta = -0.1;
  # signed uses -lam: base = 0.25 + q/2 = [0.3, 0.35, 0.55], delta = +0.1.
  p, delta = survival_probabilities([0.1, 0.2, 0.6], **PAPER)
  np.testing.assert_allclose(p, [0.6, 0.55, 0.35], atol=1e-9)
  assert delta == pytest.approx(-0.1, abs=1e-9)
  p, delta = survival_probabilities([0.1, 0.2, 0.6], **PAPER, steer="signed")
  np.testing.assert_allclose(p, [0.4, 0.45, 0.65], atol=1e-9)
  assert delta == pytest.approx(0.1, abs=1e-9)
  # Easy group (mean q above rho): both rules agree.
  np.testing.assert_array_equal(survival_probabilities([0.2, 0.5, 0.9], **PAPER)[0],
                                survival_probabilities([0.2, 0.5, 0.9], **PAPER,
                                                       steer="signed")[0])


def _kept_balance(a, b, steer, groups=2000, size=8):
  """Groups with accurate q (q = the true success probability, drawn from Beta(a, b)):
  (E[rho_hat], E[rho_hat (1 - rho_hat)]) kept by random pruning and by the survival rule,
  with the same uniforms (common random numbers)."""
  rng = np.random.default_rng(1)
  rewards, gid, keep_rand, keep_rule = [], [], [], []
  for g in range(groups):
    q = rng.beta(a, b, size)
    p, _ = survival_probabilities(q, **PAPER, steer=steer)
    u = np.array([key_uniform((7, g, i)) for i in range(size)])
    rewards += list((rng.random(size) < q).astype(float))
    gid += [g] * size
    keep_rand += list(u < 0.5)
    keep_rule += list(u < p)
  return rho_hat_stats(rewards, gid, keep_rand), rho_hat_stats(rewards, gid, keep_rule)


def test_paper_rule_balances_easy_groups_better_than_random():
  # Mostly-correct groups (mean q ~ 0.76): the rule prunes likely successes, so kept rho_hat
  # moves towards 0.5 and the within-group variance beats random pruning (paper Table 4).
  (r_mean, r_var), (k_mean, k_var) = _kept_balance(2.5, 0.8, "paper")
  assert abs(k_mean - 0.5) < abs(r_mean - 0.5) - 0.03, (r_mean, k_mean)
  assert k_var > r_var + 0.008, (r_var, k_var)


def test_paper_rule_unbalances_hard_groups_and_signed_rule_fixes_it():
  # Mostly-failing groups (mean q ~ 0.24): the paper's rule still favours low q (rho cancels
  # without clipping), so it does WORSE than random; the signed rule keeps likely successes.
  (r_mean, r_var), (p_mean, p_var) = _kept_balance(0.8, 2.5, "paper")
  assert p_mean < r_mean - 0.02 and p_var < r_var - 0.008, (r_mean, p_mean, r_var, p_var)
  (_, _), (s_mean, s_var) = _kept_balance(0.8, 2.5, "signed")
  assert s_mean > r_mean + 0.02 and s_var > r_var + 0.008, (r_mean, s_mean, r_var, s_var)


# ----------------------------------------------------------------------------- draws


def test_draws_depend_on_the_key_only():
  keys = [(0, 3, g, i) for g in range(4) for i in range(5)]
  u = np.array([key_uniform(k) for k in keys])
  assert len(set(u.tolist())) == len(keys) and np.all((u >= 0) & (u < 1))
  p = np.full(len(keys), 0.5)
  full = keep_draws(p, keys)
  # The same rollout, drawn alone, reversed, or in another batch, gets the same decision.
  np.testing.assert_array_equal(full, keep_draws(p[::-1], keys[::-1])[::-1])
  for j in (0, 7, 19):
    assert keep_draws(p[j:j + 1], keys[j:j + 1])[0] == full[j]
  np.testing.assert_array_equal(full, u < 0.5)
  # Changing the run seed or the step changes the uniforms.
  assert key_uniform((1, 3, 0, 0)) != u[0] and key_uniform((0, 4, 0, 0)) != u[0]
  # Roughly uniform: 4000 keys, the mean and the share below 0.3.
  v = np.array([key_uniform((5, i)) for i in range(4000)])
  assert abs(v.mean() - 0.5) < 4 * np.sqrt(1 / 12 / 4000)
  assert abs((v < 0.3).mean() - 0.3) < 4 * np.sqrt(0.21 / 4000)
  with pytest.raises(ValueError, match="non-negative ints"):
    key_uniform((0, -1))
  with pytest.raises(ValueError, match="2 keys for 3 probabilities"):
    keep_draws([0.5] * 3, keys[:2])


# ----------------------------------------------------------------------------- metrics


def test_rho_hat_stats_hand_computation():
  rewards = [1, 0, 0, 0, 1, 1, 0.0, -0.1]
  groups = [0, 0, 0, 0, 1, 1, 2, 2]
  # rho_hat = 1/4, 1, 0 -> mean 5/12; rho(1 - rho) = 3/16, 0, 0 -> mean 1/16.
  assert rho_hat_stats(rewards, groups) == pytest.approx((5 / 12, 1 / 16))
  keep = [1, 1, 0, 0, 1, 0, 0, 0]  # group 2 has no survivor and drops out
  # rho_hat = 1/2, 1 -> mean 3/4; 1/4, 0 -> mean 1/8.
  assert rho_hat_stats(rewards, groups, keep) == pytest.approx((3 / 4, 1 / 8))
  assert all(np.isnan(rho_hat_stats([1.0], [0], [False])))
  with pytest.raises(ValueError, match="expected equal lengths"):
    rho_hat_stats([1, 0], [0])


def test_head_accuracy_and_auc():
  assert head_accuracy([0.9, 0.2, 0.6, 0.4], [1, 0, 0, 0]) == 0.75
  assert np.isnan(head_accuracy([], []))
  # AUC by hand: positives {0.8, 0.5}, negatives {0.5, 0.2}: pairs (0.8>0.5), (0.8>0.2),
  # (0.5=0.5 -> 1/2), (0.5>0.2) -> 3.5 / 4.
  assert head_auc([0.8, 0.5, 0.5, 0.2], [1, 1, 0, 0]) == 0.875
  rng = np.random.default_rng(5)
  for _ in range(20):
    s = rng.integers(0, 5, 30) / 4  # many ties
    y = rng.random(30) < 0.4
    if y.all() or not y.any():
      continue
    pairs = [(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]]
    assert head_auc(s, y) == pytest.approx(np.mean(pairs), abs=1e-12)
  assert np.isnan(head_auc([0.2, 0.9], [1, 1]))  # one class absent: undefined
