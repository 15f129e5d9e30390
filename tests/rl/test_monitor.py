"""Live mismatch monitor: top-k lower bound vs exact alpha, per-bin tails and warnings."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import monitor
from sparrow_jax.rl.monitor import MismatchMonitor, MonitorConfig
from sparrow_jax.schedule import mismatch


def _pair_logits(rng, b, t, v, sharpness):
  """Dense logits p and a perturbed sparse q, [B, T, V], sharper for larger `sharpness`."""
  p = rng.normal(0, 1, (b, t, v)) * sharpness[None, :, None]
  q = p + rng.normal(0, 0.7, (b, t, v)) * sharpness[None, :, None]
  return p.astype(np.float32), q.astype(np.float32)


def _topk(logits, k):
  ids, lp = mismatch.topk_logprobs(jnp.asarray(logits), k)
  return np.asarray(ids), np.asarray(lp)


@pytest.mark.parametrize("k", [1, 4, 20])
def test_lower_bound_below_exact_alpha(k):
  rng = np.random.default_rng(k)
  b, t, v = 3, 40, 64
  p, q = _pair_logits(rng, b, t, v, np.linspace(0.3, 4.0, t))
  exact = monitor.exact_alpha(p, q)
  bound = monitor.lower_bound_alpha(*_topk(q, k), *_topk(p, k))
  assert bound.shape == exact.shape == (b, t)
  assert np.all(bound <= exact + 1e-6), (bound - exact).max()
  assert np.all(bound >= 0) and np.all(exact <= 1 + 1e-6)
  # float64 numpy agrees with the exact jax value.
  np.testing.assert_allclose(exact, mismatch.acceptance_rate_numpy(p, q), atol=1e-5)
  if k == 20:
    assert np.mean(exact - bound) < 0.25  # sharp rows are nearly covered by 20 entries


def test_full_topk_bound_is_exact_and_chunking_is_invisible(monkeypatch):
  rng = np.random.default_rng(0)
  p, q = _pair_logits(rng, 2, 30, 16, np.full(30, 1.5))
  exact = monitor.exact_alpha(p, q)
  full = monitor.lower_bound_alpha(*_topk(q, 16), *_topk(p, 16))
  np.testing.assert_allclose(full, exact, atol=1e-5)
  monkeypatch.setattr(monitor, "_CHUNK_ROWS", 8)  # 60 tokens -> 8 padded chunks
  chunked = monitor.lower_bound_alpha(*_topk(q, 5), *_topk(p, 5))
  direct = mismatch.topk_acceptance_lower_bound(*_topk(p, 5), *_topk(q, 5))
  np.testing.assert_allclose(chunked, np.asarray(direct), atol=1e-7)


def test_bins_percentiles_and_warning(caplog):
  cfg = MonitorConfig(tau=0.86, bin_size=10, min_count=5)
  rng = np.random.default_rng(1)
  t = 30
  alpha = np.concatenate([rng.uniform(0.95, 1.0, (4, 10)),   # bin 0: healthy
                          rng.uniform(0.50, 0.9, (4, 10)),   # bin 1: tail below tau
                          rng.uniform(0.90, 1.0, (4, 10))], axis=1)
  mask = np.ones((4, t))
  mask[:, :3] = 0  # prompt
  metrics, below = monitor.tail_metrics(alpha, mask, None, cfg)
  assert below == [1]
  for bn, sl in ((0, slice(3, 10)), (1, slice(10, 20)), (2, slice(20, 30))):
    x = alpha[:, sl].ravel()
    assert metrics[f"mismatch/p5_bin_{bn}"] == pytest.approx(np.percentile(x, 5))
    assert metrics[f"mismatch/count_bin_{bn}"] == x.size
    assert metrics[f"mismatch/mean_bin_{bn}"] == pytest.approx(x.mean())
  assert metrics["mismatch/p5_overall"] == pytest.approx(np.percentile(alpha[:, 3:], 5))
  assert metrics["mismatch/tokens"] == 4 * 27
  assert metrics["mismatch/bins_below_tau"] == 1.0
  assert metrics["mismatch/min_p5_bin"] == metrics["mismatch/p5_bin_1"]
  assert all(isinstance(v, float) for v in metrics.values())

  # Through the monitor: top-k sets built so that the bound equals `alpha` exactly (one shared
  # token with probability alpha on both sides), the warning names bin 1 and its positions.
  ids = np.zeros((4, t, 2), np.int32)
  ids[..., 1] = 1
  lp = np.stack([np.log(alpha), np.log1p(-alpha + 1e-12)], -1).astype(np.float32)
  other = np.stack([np.log(alpha), np.full_like(alpha, -30.0)], -1).astype(np.float32)
  other_ids = ids.copy()
  other_ids[..., 1] = 7  # a token the sparse side never proposes
  mon = MismatchMonitor(cfg)
  with caplog.at_level(logging.WARNING, logger="sparrow_jax.rl.monitor"):
    out = mon.update(ids, lp, other_ids, other, mask, step=12)
  assert out["mismatch/p5_bin_1"] == pytest.approx(metrics["mismatch/p5_bin_1"], abs=1e-5)
  assert mon.num_warnings == 1
  assert "step 12" in caplog.text and "bin 1 (positions 10-19" in caplog.text
  assert "bin 0" not in caplog.text and "bin 2" not in caplog.text

  # A bin below tau with fewer than min_count tokens does not warn.
  caplog.clear()
  small = MismatchMonitor(MonitorConfig(tau=0.86, bin_size=10, min_count=100))
  with caplog.at_level(logging.WARNING, logger="sparrow_jax.rl.monitor"):
    out = small.update(ids, lp, other_ids, other, mask)
  assert out["mismatch/bins_below_tau"] == 0.0 and not caplog.text


def test_exact_sample_metrics_and_positions():
  rng = np.random.default_rng(2)
  b, t, v = 2, 24, 32
  p, q = _pair_logits(rng, b, t, v, np.linspace(0.5, 3.0, t))
  mask = np.ones((b, t))
  positions = np.broadcast_to(np.arange(100, 100 + t), (b, t))  # a later window of a sequence
  mon = MismatchMonitor(MonitorConfig(bin_size=8, min_count=1, tau=0.5))
  out = mon.update(*_topk(q, 3), *_topk(p, 3), mask, positions, dense_logits=p,
                   sparse_logits=q)
  assert {"mismatch/p5_bin_12", "mismatch/p5_bin_13", "mismatch/p5_bin_15"} <= set(out)
  assert "mismatch/p5_bin_0" not in out
  assert out["mismatch/exact_p5_overall"] >= out["mismatch/p5_overall"]
  assert out["mismatch/exact_mean"] >= out["mismatch/mean"]
  assert out["mismatch/exact_bound_gap"] > 0
  with pytest.raises(ValueError, match="both dense_logits and sparse_logits"):
    mon.update(*_topk(q, 3), *_topk(p, 3), mask, dense_logits=p)
  with pytest.raises(ValueError, match=r"positions.shape=\(3,\)"):
    mon.update(*_topk(q, 3), *_topk(p, 3), mask, np.arange(3))


def test_config_validation():
  with pytest.raises(ValueError, match="tau=1.5"):
    MonitorConfig(tau=1.5)
  with pytest.raises(ValueError, match="bin_size=0"):
    MonitorConfig(bin_size=0)
  with pytest.raises(ValueError, match="expected the same tokens"):
    monitor.lower_bound_alpha(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((3, 3)),
                              np.zeros((3, 3)))


def test_warns_once_then_summarises(caplog):
  """37 of 60 steps below tau used to print 37 warnings: now the first one warns (and says
  the rest are counted), later ones go to DEBUG, and summary_line() counts them."""
  cfg = MonitorConfig(tau=0.86, bin_size=10, min_count=5)
  good = np.full((2, 10), 0.99)
  bad = np.full((2, 10), 0.5)

  def feed(mon, alpha, step):
    ids = np.zeros(alpha.shape + (1,), np.int32)
    lp = np.log(alpha)[..., None].astype(np.float32)  # one shared token: bound = alpha
    return mon.update(ids, lp, ids, lp * 0, np.ones(alpha.shape), step=step)

  mon = MismatchMonitor(cfg)
  assert mon.summary_line() is None  # nothing monitored yet
  with caplog.at_level(logging.DEBUG, logger="sparrow_jax.rl.monitor"):
    for step in range(1, 7):
      feed(mon, bad if step in (2, 3, 5) else good, step)
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
  assert len(warnings) == 1 and "step 2" in warnings[0].getMessage()
  assert "later steps below tau are counted" in warnings[0].getMessage()
  assert [("step 3" in r.getMessage(), "step 5" in r.getMessage()) for r in debug] == [
      (True, False), (False, True)]
  assert mon.num_warnings == 1 and mon.below_steps == [2, 3, 5]
  assert mon.summary_line() == ("mismatch monitor: p5 below tau=0.860 in 3 of 6 steps (steps "
                                "1-6; bin 0 in 3), lowest p5 0.5000 (bin 0, step 2)")
  every = MismatchMonitor(cfg, warn="every")
  with caplog.at_level(logging.WARNING, logger="sparrow_jax.rl.monitor"):
    caplog.clear()
    feed(every, bad, 1)
    feed(every, bad, 2)
  assert len(caplog.records) == 2 and every.num_warnings == 2
  clean = MismatchMonitor(cfg)
  feed(clean, good, 4)
  assert clean.summary_line() == ("mismatch monitor: p5 at or above tau=0.860 in all 1 steps "
                                  "(steps 4-4)")
  with pytest.raises(ValueError, match="warn='sometimes'"):
    MismatchMonitor(cfg, warn="sometimes")
