"""ARRoL's quality-head training (rl/arrol_head.py): optax's Adam on the mean BCE against a
float64 numpy Adam written out here, padding rows that do not count, and optimizer states in
the checkpoint layout (optax's tuples, or the raw dicts of an orbax restore) loading back."""

import jax
import numpy as np
import optax
import pytest

from sparrow_jax.models.quality_head import quality_logits
from sparrow_jax.rl import arrol_head
from sparrow_jax.rl.arrol import ArrolConfig, ArrolPruner
from sparrow_jax.rl.arrol_math import BinnedCalibrator


def _np_bce_grads(p, x, y):
  """float64 mean BCE of the head and its gradient, by hand:
  z = relu(x W1 + b1) . w2 + b2, L = mean(log(1 + e^z) - y z), dL/dz = (sigmoid(z) - y) / N."""
  pre = x @ p["w1_DW"] + p["b1_W"]  # [N, W]
  act = np.maximum(pre, 0.0)
  z = act @ p["w2_W"] + p["b2"]  # [N]
  loss = np.mean(np.logaddexp(0.0, z) - y * z)
  dz = (1.0 / (1.0 + np.exp(-z)) - y) / x.shape[0]  # [N]
  dpre = dz[:, None] * p["w2_W"][None, :] * (pre > 0)  # [N, W]
  grads = {"w1_DW": x.T @ dpre, "b1_W": dpre.sum(0), "w2_W": act.T @ dz, "b2": dz.sum()}
  return loss, z, grads


def _np_adam(p, m, v, t, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
  """One step of Adam (Kingma & Ba, Algorithm 1) in float64: t is the step after this one."""
  out_p, out_m, out_v = {}, {}, {}
  for k in p:
    out_m[k] = b1 * m[k] + (1 - b1) * grads[k]
    out_v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
    m_hat = out_m[k] / (1 - b1 ** t)
    v_hat = out_v[k] / (1 - b2 ** t)
    out_p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
  return out_p, out_m, out_v


def _as64(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def test_optax_adam_equals_a_float64_adam_over_several_steps():
  # N = 5 rows (padded to 8 inside) for 6 steps: the head, Adam's moments and its count follow
  # the float64 reference at every step, and the reported loss / logits are the pre-step ones.
  d, lr = 6, 0.02
  rng = np.random.default_rng(11)
  x = rng.normal(size=(5, d)).astype(np.float32)
  y = np.array([1, 0, 1, 1, 0], bool)
  pruner = ArrolPruner(ArrolConfig(head_lr=lr, head_width=16), d, seed=4)
  p = _as64(pruner.params)
  m = {k: np.zeros_like(a) for k, a in p.items()}
  v = {k: np.zeros_like(a) for k, a in p.items()}
  x64, y64 = x.astype(np.float64), y.astype(np.float64)
  for t in range(1, 7):
    loss, z, grads = _np_bce_grads(p, x64, y64)
    params, opt_state, got_loss, got_z = arrol_head.train_head(
        pruner.params, pruner.opt_state, x, y, lr=lr, steps=1)
    pruner.params, pruner.opt_state = params, opt_state
    assert got_loss == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(got_z, z, rtol=1e-5, atol=1e-5, err_msg=f"step {t}")
    p, m, v = _np_adam(p, m, v, t, grads, lr)
    adam_state = opt_state[0]
    assert int(adam_state.count) == t
    for k in p:
      np.testing.assert_allclose(np.asarray(params[k]), p[k], rtol=2e-5, atol=2e-6,
                                 err_msg=f"{k} after step {t}")
      np.testing.assert_allclose(np.asarray(adam_state.mu[k]), m[k], rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(np.asarray(adam_state.nu[k]), v[k], rtol=1e-4, atol=1e-10)


def _old_layout(params, m, v, count):
  """A head state written in the layout checkpoints have held since ARRoL's first commit:
  params a dict of float32 arrays; opt_state (ScaleByAdamState(count int32 [], mu, nu),
  EmptyState()) of `optax.adam`."""
  f32 = lambda t: {k: np.asarray(a, np.float32) for k, a in t.items()}
  return {"params": f32(params),
          "opt_state": (optax.ScaleByAdamState(count=np.asarray(count, np.int32), mu=f32(m),
                                               nu=f32(v)), optax.EmptyState())}


def test_opt_state_in_the_checkpoint_layout_loads_and_continues(tmp_path):
  # A state saved after 3 float64-reference steps loads into a fresh pruner (as optax's
  # tuples, and as the raw nested dicts an orbax restore without a template returns), and the
  # next steps continue the reference: count, moments and bias correction came back.
  from sparrow_jax.run.checkpointing import Checkpointer
  d, lr = 5, 0.01
  rng = np.random.default_rng(12)
  x = rng.normal(size=(7, d)).astype(np.float32)
  y = rng.random(7) < 0.5
  cfg = ArrolConfig(head_lr=lr, head_width=8, num_bins=4)
  p = _as64(ArrolPruner(cfg, d, seed=0).params)
  m = {k: np.zeros_like(a) for k, a in p.items()}
  v = {k: np.zeros_like(a) for k, a in p.items()}
  x64, y64 = x.astype(np.float64), y.astype(np.float64)
  for t in range(1, 4):
    p, m, v = _np_adam(p, m, v, t, _np_bce_grads(p, x64, y64)[2], lr)
  head = _old_layout(p, m, v, 3)
  state = {"step": np.asarray(3, np.int64), **head,
           "calibrator": {"pos_counts": np.array([1, 0, 2, 0]),
                          "neg_counts": np.array([0, 3, 0, 1])}}
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(3, state, {})
    raw, _ = ck.restore(3)  # no template: dicts and lists
  assert not isinstance(raw["opt_state"], tuple)
  for loaded in (state, raw):
    pruner = ArrolPruner(cfg, d, seed=9)
    template = jax.tree.structure(pruner.opt_state)
    pruner.load_state_dict(loaded)
    assert jax.tree.structure(pruner.opt_state) == template and pruner.step == 3
    assert pruner.calibrator.pos_counts.tolist() == [1, 0, 2, 0]
    q, qm, qv = p, m, v
    for t in (4, 5):
      q, qm, qv = _np_adam(q, qm, qv, t, _np_bce_grads(q, x64, y64)[2], lr)
      pruner.train(x, y)
    assert int(pruner.opt_state[0].count) == 5
    for k in q:
      np.testing.assert_allclose(np.asarray(pruner.params[k]), q[k], rtol=2e-5, atol=2e-6)
  # A state that does not fit the live head is refused, naming the leaf.
  bad = dict(state, opt_state=(optax.ScaleByAdamState(
      count=np.asarray(3, np.int64), mu=head["opt_state"][0].mu, nu=head["opt_state"][0].nu),
      optax.EmptyState()))
  with pytest.raises(ValueError, match=r"opt_state leaf 0 is int64\[\]: expected int32\[\]"):
    ArrolPruner(cfg, d, seed=9).load_state_dict(bad)


def test_train_step_is_bce_with_adam_and_padding_rows_do_not_count():
  # N = 5 rows are padded to 8 inside `train`; one step must equal an unpadded Adam step on
  # the float64 BCE of the same 5 rows.
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
