"""DistillSparse: LoRA-only gradients, loss values vs float64 numpy, and the p5 rise."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.config import get_config
from sparrow_jax.models.lora import LoRAConfig, init_lora, lora_norms
from sparrow_jax.rl import distill
from sparrow_jax.rl.switching import probe_tail_alpha
from sparrow_jax.schedule.presets import constant
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets
from tests.rl.sparse_setup import sample_sparse_actor, sharp_tiny, sparse_spec

B, T, P = 2, 96, 16  # 6 pages: 1 selected + 1 bos + 2 recent leaves 2 pages out


@pytest.fixture(scope="module")
def setup():
  cfg, graphdef, state = sharp_tiny()
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, T)), jnp.int32)
  mask = jnp.zeros((B, T), jnp.float32).at[:, P:].set(1.0).at[1, T - 5:].set(0.0)
  dense_logits = jax.jit(lambda st, tk: distill.dense_logits_of(graphdef, st, tk))(state, tokens)
  old_logp = distill.logprobs_from_logits(dense_logits, tokens)
  return dict(cfg=cfg, graphdef=graphdef, state=state, lora=lora, tokens=tokens, mask=mask,
              old_logp=old_logp, dense_logits=dense_logits,
              budgets=teacher_forced_budgets(as_schedule(1), T, B))


def _perturbed(lora, key, std=0.05):
  """The same adapter with a non-zero B (so that A has a gradient too)."""
  flat, tree = jax.tree_util.tree_flatten_with_path(lora)
  keys = jax.random.split(key, len(flat))
  out = [x + std * jax.random.normal(k, x.shape) if str(p[-1].key) == "b" else x
         for (p, x), k in zip(flat, keys)]
  return jax.tree.unflatten(tree, out)


def _loss_fn(s, kind, **kw):
  return lambda lora, state: distill.distill_loss(
      lora, s["graphdef"], state, s["tokens"], s["mask"], s["old_logp"],
      attention=sparse_spec(1), budgets=s["budgets"], kind=kind, **kw)


def test_gradients_reach_lora_only(setup):
  s = setup
  lora = _perturbed(s["lora"], jax.random.key(7))
  grad_fn = jax.jit(jax.grad(_loss_fn(s, "k3"), argnums=(0, 1), has_aux=True))
  (g_lora, g_state), _ = grad_fn(lora, s["state"])
  norms = {jax.tree_util.keystr(p): float(jnp.linalg.norm(x))
           for p, x in jax.tree_util.tree_flatten_with_path(g_lora)[0]}
  assert len(norms) == 2 * 7 * 4  # A and B of 7 targets in 4 layers: no other leaf
  zero = [k for k, v in norms.items() if not v > 0]
  assert not zero, f"LoRA leaves without gradient: {zero}"
  # The policy goes in under stop_gradient: every leaf of its gradient is exactly zero.
  for p, x in jax.tree_util.tree_flatten_with_path(g_state)[0]:
    assert not np.any(np.asarray(x)), jax.tree_util.keystr(p)
  # At initialisation (B = 0) only B receives gradient: d/dA of (x A) B vanishes with B.
  (g0, _), _ = grad_fn(s["lora"], s["state"])
  for p, x in jax.tree_util.tree_flatten_with_path(g0)[0]:
    nz = bool(np.any(np.asarray(x)))
    assert nz == (str(p[-1].key) == "b"), jax.tree_util.keystr(p)


def _np_logsoftmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_values_match_float64_numpy(setup):
  s = setup
  lora = _perturbed(s["lora"], jax.random.key(8), std=0.02)
  q_logits = np.asarray(distill.actor_logits(s["graphdef"], s["state"], lora, s["tokens"],
                                             attention=sparse_spec(1), budgets=s["budgets"]),
                        np.float64)
  p_logits = np.asarray(s["dense_logits"], np.float64)
  toks = np.asarray(s["tokens"])
  m = np.asarray(s["mask"], np.float64).copy()
  m[:, 0] = 0
  lq, lp = _np_logsoftmax(q_logits[:, :-1]), _np_logsoftmax(p_logits[:, :-1])  # [B, T-1, V]
  q_tok = np.take_along_axis(lq, toks[:, 1:, None], -1)[..., 0]
  p_tok = np.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]
  d = np.clip(p_tok - q_tok, -20, 20)
  k3 = np.clip(np.exp(d) - d - 1.0, -10, 10)  # verl's clamps, as grpo.kl_penalty
  rkl = (np.exp(lq) * (lq - lp)).sum(-1)
  mm = m[:, 1:]
  k3_ref, rkl_ref = (k3 * mm).sum() / mm.sum(), (rkl * mm).sum() / mm.sum()
  assert rkl_ref > 1e-3 and k3_ref > 1e-3  # a real mismatch, not a degenerate case
  assert np.mean(k3[mm > 0] >= 10) < 0.2  # mostly unclamped values
  # Policy-gradient term with truncated IS: rollout log-probs shifted so some rho exceed C.
  rng = np.random.default_rng(1)
  rollout = q_tok + rng.normal(0, 0.5, q_tok.shape)
  adv = np.array([1.5, -0.5])
  rho = np.exp(q_tok - rollout)
  pg_ref = (-adv[:, None] * np.minimum(rho, 1.2) * q_tok * mm).sum() / mm.sum()
  rollout_full = jnp.asarray(np.pad(rollout, ((0, 0), (1, 0))), jnp.float32)

  loss_k3 = jax.jit(_loss_fn(s, "k3", coef=0.5, pg_coef=2.0, advantages=jnp.asarray(adv),
                             rollout_logp=rollout_full, tis_cap=1.2))
  _, mk = loss_k3(lora, s["state"])
  np.testing.assert_allclose(float(mk["k3"]), k3_ref, rtol=2e-5)
  np.testing.assert_allclose(float(mk["pg_loss"]), pg_ref, rtol=2e-5)
  np.testing.assert_allclose(float(mk["loss"]), 0.5 * k3_ref + 2.0 * pg_ref, rtol=2e-5)
  np.testing.assert_allclose(float(mk["max_abs_gap"]), np.abs(p_tok - q_tok)[mm > 0].max(),
                             rtol=1e-4)
  assert 0 < float(mk["is_frac_truncated"]) < 1
  # The trainer's LM-head window over the responses (mask = positions P..T-1) gives the same
  # values (the LoRA gradient with and without it: tests/run/test_micro_phases.py).
  win = (jnp.full((B,), P, jnp.int32), T - P)
  _, mw = jax.jit(_loss_fn(s, "k3", coef=0.5, pg_coef=2.0, advantages=jnp.asarray(adv),
                           rollout_logp=rollout_full, tis_cap=1.2, window=win))(lora, s["state"])
  for key, want in (("k3", k3_ref), ("pg_loss", pg_ref), ("loss", 0.5 * k3_ref + 2.0 * pg_ref)):
    np.testing.assert_allclose(float(mw[key]), want, rtol=2e-5, err_msg=key)
  with pytest.raises(ValueError, match="window"):
    _loss_fn(s, "reverse_kl_full", window=win)(lora, s["state"])
  # Full-vocabulary reverse KL; dense logits recomputed inside or passed in agree.
  loss_rkl = jax.jit(_loss_fn(s, "reverse_kl_full"))
  _, mr = loss_rkl(lora, s["state"])
  np.testing.assert_allclose(float(mr["reverse_kl_full"]), rkl_ref, rtol=2e-5)
  np.testing.assert_allclose(float(mr["loss"]), rkl_ref, rtol=2e-5)
  np.testing.assert_allclose(float(mr["k3"]), k3_ref, rtol=2e-5)


def test_config_and_batch_validation(setup):
  with pytest.raises(ValueError, match="kind='k4'"):
    distill.DistillConfig(kind="k4")
  with pytest.raises(ValueError, match="tis_cap=0"):
    distill.DistillConfig(tis_cap=0)
  with pytest.raises(ValueError, match="coef=0 and pg_coef=0"):
    distill.DistillConfig(coef=0.0)
  s = setup
  with pytest.raises(ValueError, match="advantages=None"):
    _loss_fn(s, "k3", pg_coef=1.0)(s["lora"], s["state"])
  step = distill.make_distill_step(s["graphdef"], sparse_spec(1), distill.default_optimizer())
  with pytest.raises(ValueError, match=r"missing keys \['budgets'\]"):
    step(s["lora"], distill.default_optimizer().init(s["lora"]), s["state"],
         dict(tokens=s["tokens"], mask=s["mask"], old_logp=s["old_logp"]))


def test_min_gap_skips_the_step_and_keeps_lora_and_optimizer_state(setup):
  s = setup
  with pytest.raises(ValueError, match="min_gap=-1"):
    distill.DistillConfig(min_gap=-1.0)
  # A policy-gradient term has signal whatever the gap: never skipped.
  assert distill.DistillConfig(min_gap=1e9, pg_coef=1.0).skip_below_gap == 0.0
  batch = dict(tokens=s["tokens"], mask=s["mask"], old_logp=s["old_logp"], budgets=s["budgets"])
  opt = distill.default_optimizer(1e-2)
  lora = _perturbed(s["lora"], jax.random.key(3), std=0.02)
  before = [np.asarray(x) for x in jax.tree.leaves(lora)]
  runs = {}
  for min_gap in (0.0, 1e9):  # never skip / always skip (the batch's gap is real: ~1e-2)
    step = distill.make_distill_step(s["graphdef"], sparse_spec(1), opt,
                                     distill.DistillConfig(min_gap=min_gap))
    lr = jax.tree.map(jnp.copy, lora)
    new, new_opt, m = step(lr, opt.init(lr), s["state"], batch)
    runs[min_gap] = ([np.asarray(x) for x in jax.tree.leaves(new)],
                     [np.asarray(x) for x in jax.tree.leaves(new_opt)], m)
  moved, _, m0 = runs[0.0]
  kept, kept_opt, m1 = runs[1e9]
  assert float(m0["distill/no_gap"]) == 0.0 and float(m1["distill/no_gap"]) == 1.0
  assert float(m1["distill/skipped"]) == 0.0  # not counted as a non-finite skip
  assert float(m0["distill/max_abs_gap"]) == float(m1["distill/max_abs_gap"]) > 1e-3
  assert any(not np.array_equal(x, y) for x, y in zip(before, moved))
  for x, y in zip(before, kept):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(opt.init(lora)), kept_opt):  # the moments stay at zero
    np.testing.assert_array_equal(np.asarray(x), y)


def test_p5_alpha_rises_with_distillation():
  """The acceptance test: N k3 steps on on-policy rollouts raise p5 alpha at that schedule."""
  cfg, graphdef, state = sharp_tiny()
  b, t, p, n_steps = 4, 160, 16, 12
  attention = sparse_spec(1)  # schedule constant:1 -> 1 page of 16 + 3 reserved of 10 pages
  schedule = constant(1).replace(dense_layers=(0,))
  lora = init_lora(cfg, LoRAConfig(rank=8), jax.random.key(1))
  # Rollout of the sparse actor (fresh LoRA), kept fixed as the distillation and probe set.
  tokens = sample_sparse_actor(graphdef, state, lora, jax.random.key(2), batch=b, seq_len=t,
                               prompt_len=p, budget=1, attention=attention)
  mask = np.zeros((b, t), np.float32)
  mask[:, p:] = 1.0
  dense = jax.jit(lambda st, tk: distill.dense_logits_of(graphdef, st, tk))
  old_logp = distill.logprobs_from_logits(dense(state, tokens), tokens)
  batch = dict(tokens=tokens, mask=jnp.asarray(mask), old_logp=old_logp,
               budgets=teacher_forced_budgets(schedule, t, b),
               prompt_lengths=jnp.full((b,), p, jnp.int32))
  state_before = jax.tree.map(np.array, state)
  opt = distill.default_optimizer(1e-3)
  step = distill.make_distill_step(graphdef, attention, opt, distill.DistillConfig(kind="k3"))
  dstate = distill.DistillState.create(lora, opt)

  def p5(lora):
    return probe_tail_alpha(graphdef, state, lora, tokens, mask, batch["prompt_lengths"],
                            schedule, attention=attention)

  curve = [(0, p5(dstate.lora), float("nan"))]
  t0 = time.perf_counter()
  for i in range(1, n_steps + 1):
    dstate, metrics = distill.distill_state_step(step, dstate, state, batch)
    if i % 6 == 0:
      curve.append((i, p5(dstate.lora), float(metrics["distill/k3"])))
  print(f"\nDistillSparse p5 alpha (tiny, constant:1, k3, lr 1e-3), {n_steps} steps in "
        f"{time.perf_counter() - t0:.1f}s:")
  for i, a, k3 in curve:
    print(f"  step {i:3d}  p5 alpha {a:.4f}  k3 {k3:.5f}")
  assert int(dstate.step) == n_steps
  assert float(metrics["distill/skipped"]) == 0.0
  assert float(lora_norms(dstate.lora)["b_norm"]) > 0
  assert curve[0][1] < 0.75, "the schedule should be aggressive enough to matter"
  assert curve[-1][1] > curve[0][1] + 0.08, curve
  # The policy was an argument, never an output: untouched.
  jax.tree.map(np.testing.assert_array_equal, state_before, jax.tree.map(np.array, state))

  # A non-finite loss leaves LoRA and optimizer state unchanged.
  bad = dict(batch, old_logp=batch["old_logp"].at[0, p + 3].set(jnp.nan))
  lora_before = jax.tree.map(np.array, dstate.lora)
  lora_after, _, m = step(dstate.lora, dstate.opt_state, state, bad)
  assert float(m["distill/skipped"]) == 1.0
  jax.tree.map(np.testing.assert_array_equal, lora_before, jax.tree.map(np.array, lora_after))


def test_distill_state_checkpoint_round_trip(tmp_path):
  """LoRA + its optimizer state go through the project's orbax Checkpointer; the static
  scale comes back from the template, A/B/moments from disk."""
  from sparrow_jax.run.checkpointing import Checkpointer

  cfg = get_config("tiny", num_layers=4)
  opt = distill.default_optimizer(1e-3)
  lora = _perturbed(init_lora(cfg, LoRAConfig(rank=2, alpha=4.0), jax.random.key(0)),
                    jax.random.key(1))
  saved = distill.DistillState.create(lora, opt)._replace(step=jnp.int32(7))
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(7, {"distill": saved})
    ckpt.wait()
    template = {"distill": distill.DistillState.create(
        init_lora(cfg, LoRAConfig(rank=2, alpha=4.0), jax.random.key(9)), opt)}
    restored, _ = ckpt.restore(7, template)
  got = restored["distill"]
  assert isinstance(got, distill.DistillState) and int(got.step) == 7
  assert jax.tree.structure(got) == jax.tree.structure(saved)
  jax.tree.map(np.testing.assert_array_equal, got, saved)
  assert float(got.lora["layers"][0]["q"]["scale"]) == 2.0
