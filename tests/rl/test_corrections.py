"""Tests for the rollout-correction family (sparrow_jax.rl.corrections through grpo.grpo_loss):
weights, masks, metrics, the loss and its gradient against float64 numpy references written
from the formulas in docs/rollout_correction.md, with padding and an all-masked row."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import corrections as C
from sparrow_jax.rl import grpo
from sparrow_jax.rl.registry import CORRECTIONS

B, T = 6, 7
EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0


def _batch(seed=0, spread=0.4):
  """old, rollout, current log-probs [B, T] (float32-exact), mask with padding (rows of 7, 5,
  3, 1 tokens, one full row, one all-masked row) and advantages [B]."""
  rng = np.random.default_rng(seed)
  old = rng.normal(-1.5, 0.5, (B, T))
  rollout = old + rng.normal(0.0, spread, (B, T))
  logp = old + rng.normal(0.0, 0.15, (B, T))
  lengths = [7, 5, 3, 1, 7, 0]
  mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
  adv = rng.normal(0.0, 1.0, B)
  f = lambda x: np.asarray(x, np.float32).astype(np.float64)
  return f(old), f(rollout), f(logp), mask.astype(np.float64), f(adv)


# ----------------------------------------------------------------------------- numpy reference


def _np_parse(raw):
  parts = [float(p) for p in str(raw).split("_")]
  return (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def _np_stat(name, lr, valid):
  """An RS statistic from its formula: [B, T] (token) or [B] (sequence)."""
  k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
  n = np.maximum(valid.sum(-1), 1)
  if name == "token":
    return np.exp(lr)
  if name == "sequence":
    return np.exp(np.clip(np.where(valid, lr, 0).sum(-1), -20, 20))
  if name == "geometric":
    return np.exp(np.where(valid, lr, 0).sum(-1) / n)
  kind, which = name.rsplit("_", 1)
  x = np.where(valid, k[which], 0.0)
  if kind == "token":
    return k[which]
  if kind == "seq_sum":
    return x.sum(-1)
  if kind == "seq_mean":
    return x.sum(-1) / n
  return np.where(valid.any(-1), np.where(valid, k[which], -np.inf).max(-1), 0.0)  # seq_max


def _np_correct(kw, target, rollout, mask):
  """(weights [B, T], keep [B, T] bool) of the rollout_* keys `kw`, float64."""
  lr = np.clip(target - rollout, -20, 20)
  valid = mask > 0
  n = np.maximum(valid.sum(-1), 1)
  w = np.ones_like(lr)
  level = kw.get("rollout_is")
  if level is not None:
    if level == "token":
      w = np.exp(lr)
    elif level == "sequence":
      w = np.repeat(np.exp(np.clip(np.where(valid, lr, 0).sum(-1), -20, 20))[:, None], T, 1)
    else:
      w = np.repeat(np.exp(np.where(valid, lr, 0).sum(-1) / n)[:, None], T, 1)
    lo, hi = _np_parse(kw.get("rollout_is_threshold", "2.0"))
    w = np.minimum(w, hi) if lo is None else np.where((w >= lo) & (w <= hi), w, 0.0)
    w = np.where(valid, w, 0.0)
    if kw.get("rollout_is_batch_normalize"):
      if level == "token":
        mean = w[valid].mean()
      else:
        rows = valid.any(-1)
        mean = w[rows, 0].mean()  # one weight per row (every valid row starts at t = 0 here)
      w = w / mean
  keep = valid.copy()
  if kw.get("rollout_rs"):
    names = kw["rollout_rs"].split(",")
    ths = str(kw["rollout_rs_threshold"]).split(",")
    ths = ths * len(names) if len(ths) == 1 else ths
    for name, th in zip(names, ths):
      lo, hi = _np_parse(th)
      x = _np_stat(name, lr, valid)
      if name in ("token", "sequence", "geometric"):
        ok = (x >= (1 / hi if lo is None else lo)) & (x <= hi)
      elif lo is None:
        ok = (np.abs(x) <= hi) if name.endswith("k1") else (x <= hi)
      else:
        ok = (x >= lo) & (x <= hi)
      keep &= ok if ok.ndim == 2 else ok[:, None]
  tau = kw.get("rollout_token_veto_threshold")
  if tau is not None:
    keep &= ~(valid & (np.exp(lr) < tau)).any(-1)[:, None]
  return np.where(valid, w, 0.0), keep & valid


def _np_loss(logp, old, adv, w, keep, den_mask, agg="token-mean"):
  """PPO clip (clip-higher, dual clip) times w, aggregated over `keep` with the denominators
  of `den_mask` (float64)."""
  r = np.exp(logp - old)
  a = np.broadcast_to(adv[:, None], r.shape)
  l = np.maximum(-a * r, -a * np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH))
  l = np.where(a < 0, np.minimum(l, -a * DUAL_C), l) * w
  x = np.where(keep, l, 0.0)
  if agg == "token-mean":
    return x.sum() / max(den_mask.sum(), 1.0)
  seq = x.sum(-1) / np.maximum(keep.sum(-1), 1.0)  # seq-mean-token-mean
  return seq.sum() / max((den_mask.sum(-1) > 0).sum(), 1)


def _np_grad(f, x, h=1e-6):
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (f(xp) - f(xm)) / (2 * h)
  return g


def _jax_loss_grad(cfg, logp, old, adv, mask, rollout, **kw):
  j = lambda x: jnp.asarray(x, jnp.float32)

  def f(lp):
    return grpo.grpo_loss(lp, j(old), j(adv), j(mask), cfg, rollout_logp=j(rollout), **kw)

  (loss, met), g = jax.value_and_grad(f, has_aux=True)(j(logp))
  return float(loss), np.asarray(g, np.float64), met


# ----------------------------------------------------------------------------- thresholds that
# reject part of the batch: midpoints between sorted values of the statistic (never on a value)


def _midpoint(values, q):
  v = np.unique(np.asarray(values, np.float64))
  i = int(np.clip(round(q * (len(v) - 1)), 0, len(v) - 2))
  return float(0.5 * (v[i] + v[i + 1]))


def _band_for(name, lr, valid, kind):
  x = _np_stat(name, lr, valid)
  x = x[valid] if x.ndim == 2 else x[valid.any(-1)]
  if kind == "lo_hi":
    return f"{_midpoint(x, 0.2)!r}_{_midpoint(x, 0.8)!r}"
  if name in ("token", "sequence", "geometric"):
    return repr(_midpoint(np.maximum(x, 1 / x), 0.6))
  return repr(_midpoint(np.abs(x) if name.endswith("k1") else x, 0.6))


def _piece_cases():
  old, rollout, _, mask, _ = _batch()
  lr, valid = np.clip(old - rollout, -20, 20), mask > 0
  cases = []
  for level in C.IS_LEVELS:
    for th in ("1.3", "0.7_1.6"):  # truncate and IcePop
      for norm in (False, True):
        cases.append((f"is-{level}-{th}-{norm}", dict(rollout_is=level, rollout_is_threshold=th,
                                                      rollout_is_batch_normalize=norm)))
  for name in C.RS_NAMES:
    for kind in ("hi", "lo_hi"):
      cases.append((f"rs-{name}-{kind}", dict(rollout_rs=name,
                                              rollout_rs_threshold=_band_for(name, lr, valid,
                                                                             kind))))
  tau = float(np.exp(np.quantile(lr[valid], 0.15)))
  cases.append(("veto", dict(rollout_token_veto_threshold=tau)))
  # the two combinations of the issue, and Sparse-RL's correction
  cases.append(("geo-rs+token-tis", dict(
      rollout_is="token", rollout_is_threshold="1.3", rollout_rs="geometric",
      rollout_rs_threshold=_band_for("geometric", lr, valid, "hi"),
      rollout_token_veto_threshold=tau)))
  cases.append(("seq-is+icepop-token-is", dict(  # sequence IS with an IcePop band
      rollout_is="sequence", rollout_is_threshold="0.3_3.0", rollout_rs="token_k2,seq_max_k3",
      rollout_rs_threshold=(_band_for("token_k2", lr, valid, "hi") + ","
                            + _band_for("seq_max_k3", lr, valid, "hi")))))
  cases.append(("sparse_rl", dict(C.PRESETS["sparse_rl"], rollout_rs_threshold="0.6_1.5",
                                  rollout_token_veto_threshold=tau)))
  return cases


CASES = _piece_cases()


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_piece_weights_mask_loss_and_gradient_vs_float64(name, kw, agg):
  old, rollout, logp, mask, adv = _batch()
  cfg = grpo.GRPOLossConfig(agg=agg, **kw)
  w_ref, keep_ref = _np_correct(kw, old, rollout, mask)
  if kw.get("rollout_rs") or kw.get("rollout_token_veto_threshold"):
    # the thresholds reject part of the batch, not nothing and not everything
    assert 0 < keep_ref.sum() < (mask > 0).sum(), name
  weights, new_mask, met = C.apply(cfg.correction, jnp.asarray(old, jnp.float32),
                                   jnp.asarray(rollout, jnp.float32),
                                   jnp.asarray(mask, jnp.float32))
  valid = mask > 0
  np.testing.assert_array_equal(np.asarray(new_mask) > 0, keep_ref)
  if weights is not None:
    np.testing.assert_allclose(np.asarray(weights)[valid], w_ref[valid], rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(weights)[~valid] == 0)
  np.testing.assert_array_equal(
      np.asarray(grpo.loss_mask(jnp.asarray(mask, jnp.float32), cfg,
                                old_logp=jnp.asarray(old, jnp.float32),
                                rollout_logp=jnp.asarray(rollout, jnp.float32))) > 0, keep_ref)
  # the loss and its gradient (the weights and mask are targets: fixed under the derivative)
  ref = lambda lp: _np_loss(lp, old, adv, w_ref, keep_ref, keep_ref, agg)
  loss, g, _ = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)
  np.testing.assert_allclose(loss, ref(logp), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, _np_grad(ref, logp), rtol=1e-4, atol=2e-6)
  assert np.all(g[~keep_ref] == 0)


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_piece_metrics_vs_float64(name, kw):
  old, rollout, logp, mask, adv = _batch()
  cfg = grpo.GRPOLossConfig(**kw)
  w_ref, keep_ref = _np_correct(kw, old, rollout, mask)
  _, _, met = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)
  valid = mask > 0
  rows = valid.any(-1)
  lr = np.clip(old - rollout, -20, 20)[valid]
  p = C.PREFIX
  want = {"k1": (-lr).mean(), "k2": (0.5 * lr**2).mean(), "k3": (np.exp(lr) - 1 - lr).mean(),
          "rejected_token_frac": (valid & ~keep_ref).sum() / valid.sum(),
          "rejected_seq_frac": (rows & ~keep_ref.any(-1)).sum() / rows.sum(),
          "num_seqs": rows.sum()}
  if kw.get("rollout_is"):
    u = w_ref[valid] if kw["rollout_is"] == "token" else w_ref[rows, 0]
    want.update(is_weight_mean=u.mean(), is_weight_max=u.max(),
                ess=u.sum()**2 / (len(u) * (u**2).sum()))
  else:
    assert p + "ess" not in met
  for k, v in want.items():
    np.testing.assert_allclose(float(met[p + k]), v, rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name,kw", [c for c in CASES if c[0] in (
    "rs-seq_mean_k3-hi", "geo-rs+token-tis", "seq-is+icepop-token-is", "sparse_rl",
    "is-sequence-1.3-True")], ids=lambda x: x if isinstance(x, str) else "")
def test_micro_batches_sum_to_the_mini_batch(name, kw):
  """Two micro-batches with the mini-batch's denominators (and IS normaliser): losses and
  gradients sum to the whole batch's, the rollout_corr metrics combine to its values."""
  old, rollout, logp, mask, adv = _batch(seed=3)
  cfg = grpo.GRPOLossConfig(**kw)
  j = lambda x: jnp.asarray(x, jnp.float32)
  full_loss, full_g, full_met = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)
  den = grpo.mini_batch_denominators(j(mask), cfg, old_logp=j(old), rollout_logp=j(rollout))
  assert ("is_norm" in den) == bool(kw.get("rollout_is_batch_normalize"))
  parts, grads, mets, n_in = [], [], [], []
  for rows in (slice(0, 2), slice(2, B)):
    l, g, m = _jax_loss_grad(cfg, logp[rows], old[rows], adv[rows], mask[rows], rollout[rows],
                             **den)
    parts.append(l)
    grads.append(g)
    mets.append(m)
    n_in.append(mask[rows].sum())
  np.testing.assert_allclose(sum(parts), full_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(grads), full_g, rtol=1e-5, atol=1e-7)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *mets)
  comb = grpo.combine_micro_metrics(stacked, jnp.asarray(n_in, jnp.float32))
  for k, v in full_met.items():
    if k.startswith(C.PREFIX):
      np.testing.assert_allclose(float(comb[k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)


def test_batch_normalisation_gives_mean_one_over_the_mini_batch():
  old, rollout, logp, mask, adv = _batch(seed=5)
  for level in C.IS_LEVELS:
    cfg = grpo.GRPOLossConfig(rollout_is=level, rollout_is_threshold="3.0",
                              rollout_is_batch_normalize=True)
    _, _, met = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)
    np.testing.assert_allclose(float(met[C.PREFIX + "is_weight_mean"]), 1.0, rtol=1e-6)


def test_bypass_mode_uses_the_current_policy_and_the_input_denominators():
  """Bypass: old_logp is the rollout's; rho = sg(pi_theta) / q decides the rejection, the
  rejected tokens are zeroed but the denominators are those of the input mask."""
  old, rollout, logp, mask, adv = _batch(seed=7)
  valid = mask > 0
  lr = np.clip(logp - rollout, -20, 20)
  kw = dict(rollout_mode="bypass", rollout_rs="token_k1",
            rollout_rs_threshold=_band_for("token_k1", lr, valid, "hi"))
  cfg = grpo.GRPOLossConfig(**kw)
  _, keep_ref = _np_correct(kw, logp, rollout, mask)
  assert 0 < keep_ref.sum() < valid.sum()
  ref = lambda lp: _np_loss(lp, rollout, adv, np.ones_like(lp), keep_ref, mask)
  loss, g, met = _jax_loss_grad(cfg, logp, rollout, adv, mask, rollout)
  np.testing.assert_allclose(loss, ref(logp), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, _np_grad(ref, logp), rtol=1e-4, atol=2e-6)
  np.testing.assert_allclose(float(met[C.PREFIX + "rejected_token_frac"]),
                             (valid & ~keep_ref).sum() / valid.sum(), rtol=1e-6)
  # the denominators in bypass mode keep the input mask
  np.testing.assert_array_equal(np.asarray(grpo.loss_mask(
      jnp.asarray(mask), cfg, old_logp=jnp.asarray(rollout), rollout_logp=jnp.asarray(
          rollout))), mask)
  # bypass without a correction is plain PPO against the rollout policy
  plain = grpo.GRPOLossConfig(rollout_mode="bypass")
  assert not plain.uses_rollout_correction
  l2, g2, _ = _jax_loss_grad(plain, logp, rollout, adv, mask, rollout)
  ref2 = lambda lp: _np_loss(lp, rollout, adv, np.ones_like(lp), valid, mask)
  np.testing.assert_allclose(l2, ref2(logp), rtol=1e-5, atol=1e-6)


def test_all_masked_batch_and_reject_everything_give_zero():
  old, rollout, logp, mask, adv = _batch()
  cfg = grpo.GRPOLossConfig(rollout_is="sequence", rollout_rs="token_k2",
                            rollout_rs_threshold="0.0")  # rejects every token with k2 > 0
  loss, g, met = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)
  assert loss == 0.0 and np.all(g == 0)
  assert float(met[C.PREFIX + "rejected_seq_frac"]) == 1.0
  zero = np.zeros_like(mask)
  loss, g, met = _jax_loss_grad(cfg, logp, old, adv, zero, rollout)
  assert loss == 0.0 and np.all(g == 0)
  assert all(np.isfinite(float(v)) for v in met.values())
  assert float(met[C.PREFIX + "ess"]) == 0.0


def test_legacy_tis_keys_equal_their_family_members_bitwise():
  old, rollout, logp, mask, adv = _batch(seed=11, spread=0.6)
  pairs = [(dict(tis_cap=2.0), dict(rollout_is="token", rollout_is_threshold="2.0")),
           (dict(tis_cap=1.5, tis_mask_threshold=3.0),
            dict(rollout_is="token", rollout_is_threshold="1.5", rollout_rs="token",
                 rollout_rs_threshold="3.0")),
           (dict(tis_cap=2.0, tis_mask_threshold=3.0, tis_mask_low=0.5),
            dict(rollout_is="token", rollout_is_threshold="2.0", rollout_rs="token",
                 rollout_rs_threshold="0.5_3.0"))]
  for legacy, new in pairs:
    a = _jax_loss_grad(grpo.GRPOLossConfig(**legacy), logp, old, adv, mask, rollout)
    b = _jax_loss_grad(grpo.GRPOLossConfig(**new), logp, old, adv, mask, rollout)
    assert a[0] == b[0], (legacy, new)
    np.testing.assert_array_equal(a[1], b[1])
    for k in ("is_weight_mean", "ess", "rejected_token_frac", "k3"):
      assert float(a[2][C.PREFIX + k]) == pytest.approx(float(b[2][C.PREFIX + k]), rel=1e-6)
    # the legacy metrics are still there
    assert "is_frac_truncated" in a[2] and "is_weight_mean" in a[2]


@pytest.mark.parametrize("kw,needle", [
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="token", rollout_is_threshold="5_0.5"), "lo < hi"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold="1"), "unknown statistic"),
    (dict(rollout_rs="token"), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold="0.5"), "hi > 1"),
    (dict(rollout_rs="token,token_k3", rollout_rs_threshold="2,3,4"), "one each"),
    (dict(rollout_rs_threshold="2.0"), "without rollout_rs"),
    (dict(rollout_token_veto_threshold=2.0), "rollout_token_veto_threshold"),
    (dict(rollout_mode="sync"), "rollout_mode"),
    (dict(rollout_mode="bypass", rollout_is="token"), "bypass"),
    (dict(rollout_is_batch_normalize=True), "needs rollout_is"),
    (dict(tis_cap=2.0, rollout_is="token"), "one family"),
])
def test_bad_settings_are_clear_errors(kw, needle):
  with pytest.raises(ValueError, match=needle):
    grpo.GRPOLossConfig(**kw)


def test_every_piece_is_registered_with_a_description():
  names = CORRECTIONS.names()
  for n in [f"is:{l}" for l in C.IS_LEVELS] + [f"rs:{r}" for r in C.RS_NAMES] + [
      "is_bound:truncate", "is_bound:icepop", "is:batch_normalize", "rs:token_veto",
      "mode:decoupled", "mode:bypass"]:
    assert n in names and CORRECTIONS.doc(n), n
  assert set(C.RS_NAMES) == {"token", "sequence", "geometric", *(
      f"{k}_{d}" for k in ("token", "seq_sum", "seq_mean") for d in ("k1", "k2", "k3")),
      "seq_max_k2", "seq_max_k3"}
  for kw in C.PRESETS.values():  # every preset is a valid configuration
    grpo.GRPOLossConfig(**kw)


def test_hashable_config_with_corrections_jits_as_static():
  old, rollout, logp, mask, adv = _batch()
  cfg = grpo.GRPOLossConfig(**C.PRESETS["sparse_rl"])
  assert hash(cfg) == hash(grpo.GRPOLossConfig(**C.PRESETS["sparse_rl"]))
  f = jax.jit(lambda lp, c: grpo.grpo_loss(lp, jnp.asarray(old, jnp.float32),
                                          jnp.asarray(adv, jnp.float32),
                                          jnp.asarray(mask, jnp.float32), c,
                                          rollout_logp=jnp.asarray(rollout, jnp.float32))[0],
              static_argnums=1)
  eager = _jax_loss_grad(cfg, logp, old, adv, mask, rollout)[0]
  assert math.isclose(float(f(jnp.asarray(logp, jnp.float32), cfg)), eager, rel_tol=1e-6)
