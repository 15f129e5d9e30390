"""Asynchronous training (issue 47): the config's refusals, the behaviour weight against a
float64 reference, group advantages over members of different versions, the mismatch split,
and a tiny run that keeps its staleness bound and resumes from a checkpoint mid-async."""

import json
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl import reward_helpers  # noqa: F401  (registers the test verifiers)
from sparrow_jax.engine.config import Completion
from sparrow_jax.rl import grpo
from sparrow_jax.run import algorithm, hooks, stages
from sparrow_jax.run.batch import make_batch
from sparrow_jax.run.config import TrainConfig, get_train_config
from sparrow_jax.run.metrics import read_jsonl
from sparrow_jax.run.trainer import Trainer


def test_async_keys_refused_where_they_cannot_work():
  for kw, msg in ((dict(partial_rollouts=True), "needs max_staleness >= 1"),
                  (dict(max_staleness=-1), "max_staleness=-1"),
                  (dict(rollout_devices=-1), "rollout_devices=-1"),
                  (dict(max_staleness=1, dynamic_sampling=True), "dynamic_sampling"),
                  (dict(max_staleness=1, arrol=True, max_new_tokens=64), "arrol=true"),
                  (dict(max_staleness=1, partial_rollout_kv="drop"), "partial_rollout_kv"),
                  (dict(max_staleness=1, val_every=5), "val_every=5"),
                  (dict(async_overlap=True, max_staleness=1), "rollout_devices=0"),
                  (dict(async_overlap=True, rollout_devices=2), "max_staleness=0")):
    with pytest.raises(ValueError, match=msg):
      TrainConfig(**kw)
  # the pool lives through training; the behaviour weight is capped unless a key says
  assert TrainConfig().kv_pool_released and not TrainConfig(max_staleness=1).kv_pool_released
  assert algorithm.loss_config(TrainConfig()).tis_cap is None
  assert algorithm.loss_config(TrainConfig(max_staleness=2)).tis_cap == algorithm.ASYNC_TIS_CAP
  assert algorithm.loss_config(TrainConfig(max_staleness=2, tis_cap=5.0)).tis_cap == 5.0
  assert algorithm.loss_config(TrainConfig(max_staleness=2, rollout_is="token")).tis_cap is None


def test_memory_plan_holds_the_pool_through_training_under_async():
  from sparrow_jax.run.builders import model_config
  from sparrow_jax.run.dry_run import plan_for_model

  def plan(**kw):
    cfg = get_train_config("qwen3_1p7b", [f"{k}={v}" for k, v in kw.items()])
    return plan_for_model(cfg, model_config(cfg), 4)

  held, released = plan(release_kv_cache="false"), plan()
  asyn = plan(max_staleness=1, partial_rollouts="true")
  assert released.pool_released and not held.pool_released and not asyn.pool_released
  assert asyn.kv_cache_bytes == held.kv_cache_bytes < released.kv_cache_bytes


def _batch(versions, rewards, g=4, t=6):
  """One-prompt-per-group batch: row j has `t` response tokens of versions[j] (an int or a
  per-token list)."""
  comps = []
  for j, v in enumerate(versions):
    v = np.full(t, v, np.int32) if np.isscalar(v) else np.asarray(v, np.int32)
    comps.append(Completion(request_id=(j // g, j % g), prompt_ids=np.array([5, 6], np.int32),
                            token_ids=np.arange(7, 7 + t, dtype=np.int32),
                            logprobs=np.full(t, -1.0, np.float32), finish_reason="length",
                            versions=v))
  return make_batch(comps, max_new_tokens=t, topk=0, rewards=rewards, version=9)


def test_group_advantages_are_over_the_whole_group_whatever_the_versions():
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], np.float32)
  mixed = _batch([3, [3, 3, 4, 4, 5, 5], 4, 5, 5, 5, 4, 3], rewards)
  same = _batch([5] * 8, rewards)
  assert (mixed.versions[1, 2:] == [3, 3, 4, 4, 5, 5]).all()  # per token, as the engine wrote
  ln = types.SimpleNamespace(cfg=TrainConfig(prompts_per_step=2, group_size=4))
  for b in (mixed, same):
    stages.advantages(ln, None, types.SimpleNamespace(batch=b, rho_hat=None))
  np.testing.assert_array_equal(mixed.advantages, same.advantages)
  r = rewards.astype(np.float64).reshape(2, 4)
  ref = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(mixed.advantages, ref.reshape(-1), atol=1e-5)


def test_behaviour_weight_against_float64():
  """pi_prox / mu per token through the async TIS cap: prox = the learner's policy at the
  step's start, mu = the engine's log-prob at the version that sampled the token."""
  rng = np.random.default_rng(0)
  prox = rng.normal(-2.0, 0.5, (3, 7))
  mu = prox + rng.normal(0.0, 0.6, (3, 7))  # older versions: further from the learner
  mask = (rng.random((3, 7)) > 0.2).astype(np.float32)
  cap = algorithm.loss_config(TrainConfig(max_staleness=1)).tis_cap
  w, _, stats = grpo.rollout_correction(jnp.asarray(prox, jnp.float32),
                                        jnp.asarray(mu, jnp.float32), jnp.asarray(mask),
                                        tis_cap=cap)
  ref = np.minimum(np.exp(prox - mu), cap) * mask
  np.testing.assert_allclose(np.asarray(w), ref, rtol=2e-6, atol=1e-6)
  trunc = ((np.exp(prox - mu) > cap) * mask).sum() / mask.sum()
  np.testing.assert_allclose(float(stats["is_frac_truncated"]), trunc, rtol=1e-6)


class _Learner:
  """token_alpha of a sparse actor `params` against a dense side: a value per (actor,
  dense) pair, so the split's routing shows."""

  def token_alpha(self, params, arrays, schedule, lora, plan=None, *, dense_params=None):
    shape = arrays["tokens"].shape
    dense = params if dense_params is None else dense_params
    return np.full(shape, 0.5 + 0.1 * params + 0.01 * dense, np.float32)


def _split_tr(now, history):
  cfg = types.SimpleNamespace(mismatch_bin_size=8)
  return types.SimpleNamespace(cfg=cfg, state=types.SimpleNamespace(policy_version=now,
                                                                    params=now),
                               learner=_Learner(), policy_history=history)


def test_alpha_split_equals_exact_alpha_without_staleness():
  b = _batch([4] * 4, np.zeros(4, np.float32))
  sub = b.arrays("tokens", "prompt_lens", "lengths", "mask")
  alpha = np.random.default_rng(1).uniform(0.6, 1.0, b.tokens.shape).astype(np.float32)
  out = hooks.alpha_split(_split_tr(4, {}), b, sub, alpha)
  exact = hooks.alpha_tails_per_bin(alpha, sub["mask"], bin_size=8)
  p5 = min(v for v, _ in exact.values())
  assert out["mismatch/p5_sparsity"] == out["mismatch/p5_total"] == p5
  assert out["mismatch/split_missing_tokens"] == 0


def test_alpha_split_takes_each_tokens_version():
  alpha = lambda b: np.ones(b.tokens.shape, np.float32)  # the current version's exact alpha
  old = _batch([3] * 4, np.zeros(4, np.float32))
  sub = old.arrays("tokens", "prompt_lens", "lengths", "mask")
  out = hooks.alpha_split(_split_tr(4, {3: (3, None)}), old, sub, alpha(old))
  # sparsity: the actor of version 3 against dense 3; total: against the learner's (4)
  assert out["mismatch/p5_sparsity"] == pytest.approx(0.5 + 0.1 * 3 + 0.01 * 3)
  assert out["mismatch/p5_total"] == pytest.approx(0.5 + 0.1 * 3 + 0.01 * 4)
  mixed = _batch([4, 3, [2, 2, 3, 3, 4, 4], 4], np.zeros(4, np.float32))
  sub = mixed.arrays("tokens", "prompt_lens", "lengths", "mask")
  out = hooks.alpha_split(_split_tr(4, {3: (3, None)}), mixed, sub, alpha(mixed))
  assert out["mismatch/split_missing_tokens"] == 2  # version 2 was not kept
  assert 0.83 - 1e-6 <= out["mismatch/p5_sparsity"] < out["mismatch/p5_total"] < 1.0


SMALL = ["warmstart_steps=0", "prompts_per_step=2", "group_size=4", "num_slots=8",
         "max_new_tokens=12", "ignore_eos=true", "decode_chunk=4", "tensorboard=false",
         "distill=false", "reward_workers=1", "sample_every=0"]


def test_async_run_keeps_its_bound_and_resumes_mid_async(tmp_path):
  def cfg(d, steps):
    return get_train_config("tiny", SMALL + [f"out_dir={d}", f"num_steps={steps}",
                                             "max_staleness=1", "partial_rollouts=true",
                                             "save_every=2"])
  # per-request lengths 3..12 (ignore_eos): some sequences outlive their step
  budget = lambda self, seed: 3 + int(seed) % 10
  from sparrow_jax.run import producer as producer_lib
  old = producer_lib.Producer.response_budget
  producer_lib.Producer.response_budget = budget
  try:
    with Trainer(cfg(tmp_path, 3), quiet=True) as tr:
      tr.fit()
    with Trainer(cfg(tmp_path, 5), quiet=True) as tr:
      assert tr.resume() == 3
      assert tr.producer._regenerate  # the outstanding groups come back
      tr.fit()
  finally:
    producer_lib.Producer.response_budget = old
  by_step = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert sorted(by_step) == [1, 2, 3, 4, 5]
  rows = list(by_step.values())
  for r in rows:
    assert r["async/staleness_max"] <= 1 and r["async/over_stale_tokens"] == 0
    assert 0 < r["async/occupancy"] <= 1
  assert any(r["async/staleness_mean"] > 0 for r in rows)
  assert any(r["async/partial_frac"] > 0 for r in rows)


def test_rollout_devices_refused_where_they_cannot_work(monkeypatch):
  from sparrow_jax.run import distributed, setup
  with pytest.raises(ValueError, match="rollout_devices=1: this process has 1 device"):
    setup.build_mesh(TrainConfig(rollout_devices=1))  # (this process: one CPU device)
  monkeypatch.setattr(distributed, "is_multi", lambda: True)
  with pytest.raises(ValueError, match="rollout_devices=2 with .* processes: not supported"):
    setup.build_mesh(TrainConfig(rollout_devices=2))
  assert not TrainConfig(rollout_devices=2).kv_pool_released  # the pool is on its own devices


def test_rollout_devices_first_step_equals_the_time_shared_one(tmp_path):
  """8 fake CPU devices (a subprocess: XLA_FLAGS before jax): the engine on the last 4, the
  learner on the first 4, against both on all 8: the same rollouts and the same loss."""
  script = os.path.join(os.path.dirname(__file__), "rollout_devices_check.py")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                        text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  shared, split = res["shared"], res["split"]
  assert shared["learner_devices"] == shared["engine_devices"] == list(range(8))
  assert split["learner_devices"] == [0, 1, 2, 3] and split["engine_devices"] == [4, 5, 6, 7]
  assert split["engine_shards"] == 4 and split["steps"] == 2 and split["finite"]
  # the same rollouts (tokens, request ids, versions; log-probs to float rounding), the same loss
  assert res["same_tokens"] and res["same_ids"] and res["same_versions"], res
  assert res["logprob_diff"] <= 1e-5, res
  assert shared["grad_norm"] > 0  # (an informative step: the loss is not trivially 0)
  assert res["loss_diff"] <= 1e-5 and res["grad_norm_rel_diff"] <= 1e-5, res
  # every update's weights copied to the engine's devices, timed; the async bound holds there
  assert all(t is not None and t > 0 for t in split["weight_sync_s"]), split
  assert split["staleness_max"] <= 1 and max(split["partial_frac"]) > 0
  # async_overlap: the engine ran iterations while the learner trained, within the bound.
  ov = res["overlap"]
  assert ov["steps"] == 4 and ov["finite"], ov
  assert sum(ov["chunks"]) > 0 and all(s >= 0 for s in ov["overlap_s"]), ov
  assert ov["staleness_max"] <= 1 and ov["over_stale"] == 0, ov


class _StaleLearner:
  """token_alpha of a sparse actor `params` (an int: its version) against a dense side: 0.95
  against its own version, 0.05 less per version of distance to another dense policy."""

  def __init__(self):
    self.calls = []

  def token_alpha(self, params, arrays, schedule, lora, plan=None, *, dense_params=None):
    self.calls.append((params, dense_params, schedule))
    gap = 0 if dense_params is None else abs(params - dense_params)
    return np.full(arrays["tokens"].shape, 0.95 - 0.05 * gap, np.float32)


def _ladder_tr(tau, versions, now=4):
  from sparrow_jax.rl.switching import ScheduleLadder
  from sparrow_jax.schedule.presets import as_schedule
  cfg = TrainConfig(max_staleness=1, tau=tau, ladder_patience=1, probe_every=1,
                    probe_min_count=1, mismatch_bin_size=8)
  lad = ScheduleLadder([as_schedule(3), as_schedule(2)], tau=tau,
                       patience=1, probe_every=1)
  switched = []
  tr = types.SimpleNamespace(cfg=cfg, ladder=lad, learner=_StaleLearner(),
                             state=types.SimpleNamespace(policy_version=now, params=now, lora=None),
                             policy_history={now - 1: (now - 1, None)},
                             switch_schedule=switched.append)
  b = _batch(versions, np.zeros(len(versions), np.float32))
  b.schedule = lad.current
  rec = types.SimpleNamespace(step=1, batch=b, out={}, logprob_plan=None)
  return tr, rec, switched


def test_async_ladder_decides_on_the_total_mismatch():
  """Stale tokens: the candidate's sparsity share (0.95) passes tau=0.92, its total (0.90:
  the actor of version 3 against the learner's dense 4) does not: no switch. Fresh tokens
  (total = sparsity = 0.95) or tau=0.88: the switch. The decision follows mismatch/p5_total
  (the same split the exact-alpha hook reports for the current schedule)."""
  for tau, versions, switch in ((0.92, [3] * 4, False), (0.92, [4] * 4, True),
                                (0.88, [3] * 4, True), (0.92, [4, 4, [3, 3, 4, 4, 4, 4], 4],
                                                        False)):
    tr, rec, switched = _ladder_tr(tau, versions)
    for h in hooks.step_hooks(tr.cfg, ladder_on=True, arrol_on=False):
      if h.name in ("ladder_probe", "ladder"):
        rec.out.update(h.fn(tr, rec))
    sub = rec.batch.arrays("tokens", "prompt_lens", "lengths", "mask")
    split = hooks.alpha_split(tr, rec.batch, sub, np.full(rec.batch.tokens.shape, 0.95,
                                                          np.float32))
    assert rec.out["ladder/probe_tail_alpha"] == rec.out["ladder/probe_tail_total"]
    assert rec.out["ladder/probe_tail_total"] == pytest.approx(split["mismatch/p5_total"])
    assert rec.out["ladder/probe_tail_sparsity"] == pytest.approx(0.95)
    assert bool(switched) == switch == (split["mismatch/p5_total"] >= tau), (tau, versions)
    # the candidate's actor of the stale version was probed against the learner's dense policy
    stale = any(np.ndim(v) or v != 4 for v in versions)
    assert any(c[0] == 3 and c[1] == 4 and c[2].name == "constant-2"
               for c in tr.learner.calls) == stale
  sync = hooks.step_hooks(TrainConfig(), ladder_on=True, arrol_on=False)
  assert [h.name for h in sync] == ["monitor", "ladder"]  # synchronous steps: unchanged


def test_async_trainer_ladder_acts_on_the_total(tmp_path):
  """A tiny async run with a ladder: each probe's decision value is the total measured before
  the update, and the schedule switches exactly when it reaches tau."""
  cfg = get_train_config("tiny", SMALL + [f"out_dir={tmp_path}", "num_steps=3",
                                          "max_staleness=1", "partial_rollouts=true",
                                          "schedule=constant:3", "ladder=constant:2",
                                          "probe_every=1", "probe_min_count=1",
                                          "ladder_patience=1", "tau=0.5"])
  with Trainer(cfg, quiet=True) as tr:
    rows = [tr.train_step() for _ in range(3)]
    assert sorted(tr.policy_history) == [2]  # the version before the last update, kept
  probed = [r for r in rows if "ladder/probe_tail_total" in r]
  assert probed, rows
  for r in probed:
    assert r["ladder/probe_tail_alpha"] == r["ladder/probe_tail_total"]
    assert r["ladder/index"] == float(r["ladder/probe_tail_total"] >= 0.5)


def test_dry_run_says_which_devices_hold_what_with_rollout_devices():
  import io
  from sparrow_jax.run.dry_run import dry_run
  cfg = get_train_config("tiny", ["rollout_devices=4", "max_staleness=1"])
  out = io.StringIO()
  assert dry_run(cfg, num_devices=4, out=out) == 0  # (planned for 4 learner devices)
  text = out.getvalue()
  assert "rollout_devices=4: the engine runs on 4 device(s) of its own" in text
  assert "the learner's mesh is the other 4" in text and "held throughout" in text
  with pytest.raises(ValueError, match="rollout_devices=4: this process has 1 device"):
    dry_run(cfg, out=io.StringIO())  # this process: one device, nothing left to split
