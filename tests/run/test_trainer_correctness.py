"""Trainer wiring (issue 10): a hanging verifier, the KL reference, the ladder probe and the
masks under dynamic sampling, temperature, the dual-clip default, micro-batch aggregation,
DAPO refill, and DistillSparse's policy-gradient term. One test (or two) per item, each on
the tiny preset at small shapes."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import data as data_lib
from sparrow_jax.rl import rewards as rewards_lib
from sparrow_jax.rl.monitor import lower_bound_alpha
from sparrow_jax.run import hooks, stages
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.learner import StepRecord
from sparrow_jax.run.metrics import read_jsonl
from sparrow_jax.run.trainer import Trainer
from tests.rl import reward_helpers

SMALL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "reward_workers=2"]
G = 4


def _trainer(tmp, *extra) -> Trainer:
  cfg = get_train_config("tiny", SMALL + [f"out_dir={tmp}"] + list(extra))
  return Trainer(cfg, quiet=True)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _assert_trees_equal(a, b):
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _trees_differ(a, b) -> bool:
  return any(not np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def _recompute(tr, batch):
  """Old log-probs, the monitor's dense top-k and the reference's log-probs of a batch."""
  return stages.dense_logprobs(tr.learner, tr.params, tr.ref_params, batch,
                               tr.learner.logprob_plan(batch["lengths"]))


def _patch_rewards(monkeypatch, tr, patterns):
  """Replace the verifier's rewards of successive `score` calls by `patterns[i]`, strings of
  one letter per group: 'I' informative ([1, 0, 0, 0]), 'Z' zero variance (all 0)."""
  real = tr.producer.score
  calls = []

  def score(examples, comps):
    r, res = real(examples, comps)
    pat = patterns[min(len(calls), len(patterns) - 1)]
    calls.append(pat)
    group = {"I": [1.0, 0.0, 0.0, 0.0], "Z": [0.0] * G}
    return np.asarray([x for c in pat for x in group[c]], np.float32), res

  monkeypatch.setattr(tr.producer, "score", score)
  return calls


# --- 1. a verifier that hangs holding the GIL ------------------------------------------------

def test_hanging_verifier_costs_the_timeout_and_is_counted(tmp_path, monkeypatch):
  timeout = 1.5
  tr = _trainer(tmp_path, "num_steps=1", "distill=false", "reward=test_gil_hang",
                f"reward_timeout_s={timeout}")
  real_decode = tr.tokenizer.decode
  texts = []

  def decode(ids, **kw):  # the first completion of every batch hangs the verifier
    text = real_decode(ids, **kw)
    text = reward_helpers.HANG_MARK + text if len(texts) % (4 * G) == 0 else text
    texts.append(text)
    return text

  monkeypatch.setattr(tr.tokenizer, "decode", decode)
  with tr:
    examples = tr.dataset.next_batch()
    comps = tr.producer.rollout(examples, 1)
    workers = list(tr.producer.scorer._workers)  # started before the clock runs
    t0 = time.monotonic()
    rewards, res = tr.producer.score(examples, comps)
    elapsed = time.monotonic() - t0
    assert res.num_timeouts == 1 and res.num_errors == 0
    assert elapsed < timeout + 2.0, f"{elapsed=:.2f}s for a {timeout}s deadline"
    want = [rewards_lib.exact_match(t, examples[c.request_id[0]].answer)
            for t, c in zip(texts[1:], comps[1:])]
    np.testing.assert_array_equal(rewards, [0.0] + want)  # the others are scored as usual
    # The pool is reused: the hung worker was replaced, the other one kept.
    assert sum(w in tr.producer.scorer._workers for w in workers) == 1
    # The same through a training step: counted in the metrics.
    out = tr.train_step()
    assert out["reward/verifier_timeouts"] == 1
    procs = [w.proc for w in tr.producer.scorer._workers]
  assert tr.producer._scorer is None and not any(p.is_alive() for p in procs)  # closed on exit


# --- 2. the KL reference is the policy at the start of RL --------------------------------------

def test_kl_reference_is_the_post_warmstart_policy_and_is_restored(tmp_path, monkeypatch):
  args = ("distill=false", "kl_coef=0.1", "save_every=1")
  tr = _trainer(tmp_path, "num_steps=1", *args)
  init = _leaves(tr.params)
  seen = {}
  real_step = tr.train_step

  def step():
    if not seen:
      seen["params"], seen["ref"] = _leaves(tr.params), _leaves(tr.ref_params)
    return real_step()

  monkeypatch.setattr(tr, "train_step", step)
  tr.fit()
  assert any(not np.array_equal(a, b) for a, b in zip(init, seen["params"]))  # warm start ran
  for a, b in zip(seen["params"], seen["ref"], strict=True):
    np.testing.assert_array_equal(a, b)
  rec = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
  assert abs(rec["loss/kl"]) < 1e-6  # pi_theta == pi_ref before the first update
  resumed = _trainer(tmp_path, "num_steps=2", *args)
  assert resumed.resume() == 1
  for a, b in zip(seen["ref"], _leaves(resumed.ref_params), strict=True):
    np.testing.assert_array_equal(a, b)
  resumed.fit()  # a resumed run neither warm-starts nor resets the reference
  for a, b in zip(seen["ref"], _leaves(resumed.ref_params), strict=True):
    np.testing.assert_array_equal(a, b)


# --- 3 / 4. probe and masks under dynamic sampling ---------------------------------------------

@pytest.fixture(scope="module")
def ds_step(tmp_path_factory):
  """One step with the ladder probing, DistillSparse on and dynamic sampling (no refill), the
  first group zero-variance; records the probe's inputs."""
  mp = pytest.MonkeyPatch()
  tr = _trainer(tmp_path_factory.mktemp("ds"), "num_steps=1", "distill=true",
                "dynamic_sampling=true", "max_refill_rounds=0", "schedule=constant:3",
                "ladder=constant:2", "probe_every=1", "probe_min_count=4")
  _patch_rewards(mp, tr, ["ZIZI"])
  probes = []
  real_probe = tr.learner.tail_alpha

  def probe(*a, **kw):
    probes.append((a, kw))
    return real_probe(*a, **kw)

  mp.setattr(tr.learner, "tail_alpha", probe)
  batches = []
  real_produce = tr.producer.produce
  mp.setattr(tr.producer, "produce",
             lambda *a, **kw: batches.append(real_produce(*a, **kw)) or batches[-1])
  with tr:
    out = tr.train_step()
  yield tr, out, probes, batches[0]
  mp.undo()


def test_ladder_probe_uses_the_whole_batch_and_the_response_mask(ds_step):
  tr, out, probes, batch = ds_step
  assert len(probes) == 1 and np.isfinite(out["ladder/probe_tail_alpha"])
  assert out["ladder/checks"] == 1.0 and out["ladder/probe_skipped"] == 0.0
  (params, arrays, schedule, lora, mask, plan), kw = probes[0]
  assert arrays["tokens"].shape[0] == 4 * G  # every row, including the zero-variance group
  assert sorted(np.concatenate([m.index for m in plan])) == list(range(4 * G))
  assert schedule.name == "constant-2" and lora is tr.lora
  np.testing.assert_array_equal(np.asarray(mask), batch.mask)
  assert kw["min_count"] == 4 and tr.temperature == 1.0
  # No position bin with enough tokens: the probe is skipped, not NaN, and nothing crashes.
  tr.cfg = tr.cfg.replace(probe_min_count=10**6)
  skipped = hooks.ladder(tr, StepRecord(step=2, batch=batch))
  assert skipped["ladder/probe_skipped"] == 1.0 and "ladder/probe_tail_alpha" not in skipped
  assert skipped["ladder/checks"] == 1.0  # not counted as a check


def test_monitor_and_distill_count_every_response_token(ds_step):
  _, out, _, batch = ds_step
  n_resp = float(batch.mask.sum())
  assert out["reward/frac_zero_var_groups"] == 0.5
  assert out["rollout/tokens"] == n_resp
  assert out["mismatch/tokens"] == n_resp
  assert out["distill/num_tokens"] == n_resp


def test_optimizer_state_starts_in_the_layout_the_update_returns(ds_step):
  """A fresh optimizer state is laid out as the guarded apply returns it (counts replicated
  on the mesh, not on one device): otherwise step 2 compiles the apply programs again."""
  tr = ds_step[0]
  for tx, tree, after in ((tr.learner.tx, tr.params, tr.opt_state),
                          (tr.learner.lora_tx, tr.lora, tr.lora_opt_state)):
    fresh, _ = tr._init_opt(tx, tree)
    for x, y in zip(jax.tree.leaves(fresh), jax.tree.leaves(after), strict=True):
      # jit keys on the sharding's kind: one device is not a mesh, even a 1-device one
      assert type(x.sharding) is type(y.sharding), (x.sharding, y.sharding)
      assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


# --- 5. temperature ----------------------------------------------------------------------------

def test_training_logprobs_are_those_of_the_tempered_sampler(tmp_path):
  tr = _trainer(tmp_path, "distill=false", "schedule=dense", "temperature=0.7", "top_p=1.0",
                "kl_coef=0.1", "skip_redundant_recompute=false")
  examples = tr.dataset.next_batch()
  batch = tr.make_batch(tr.producer.rollout(examples, 1)).arrays()
  rec = _recompute(tr, batch)
  old, dense_lp, ref = rec["old_logp"], rec["dense_topk_logp"], rec["ref_logp"]
  m = batch["mask"] > 0
  np.testing.assert_allclose(np.asarray(old)[m], batch["rollout_logp"][m], atol=2e-5)
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(old))  # reference at T too
  # The monitor's dense top-k is tempered: the sampled token's entry matches old_logp.
  top = np.asarray(dense_lp)[m]  # [n, k]
  assert np.all(top.max(-1) >= np.asarray(old)[m] - 2e-5)
  # ... and so is the rollout's (engine) top-k: a dense rollout's equals the recompute's, so
  # on dense rollouts at T = 0.7 the monitor's bound of alpha is the whole top-k mass, the
  # most two top-k sets can certify (an untempered engine top-k falls short of it).
  np.testing.assert_array_equal(batch["rollout_topk_ids"][m], np.asarray(rec["dense_topk_ids"])[m])
  np.testing.assert_allclose(batch["rollout_topk_logp"][m], top, atol=5e-5)
  bound = lower_bound_alpha(batch["rollout_topk_ids"], batch["rollout_topk_logp"],
                            np.asarray(rec["dense_topk_ids"]), np.asarray(dense_lp))
  np.testing.assert_allclose(bound[m], np.exp(top.astype(np.float64)).sum(-1), atol=1e-4)
  # The update's log-probs are tempered as well: on-policy ratios are exactly ~1.
  full = dict(tokens=batch["tokens"], lengths=batch["lengths"], old_logp=np.asarray(old),
              advantages=np.ones(4 * G, np.float32), mask=batch["mask"], ref_logp=np.asarray(ref))
  _, metrics, _, _ = stages.mini_batch_grads(tr.learner, tr.params, full)
  assert abs(float(metrics["ratio_max"]) - 1) < 1e-5 and abs(float(metrics["ratio_min"]) - 1) < 1e-5


def test_logged_tis_ratios_are_one_on_dense_tempered_rollouts(tmp_path):
  # Wiring of the per-step TIS statistics: the trainer's dense old log-probs against the
  # engine's sampling log-probs at T = 0.7; a temperature or mask mix-up moves them off 1.
  tr = _trainer(tmp_path, "distill=false", "schedule=dense", "temperature=0.7", "top_p=1.0",
                "num_steps=1")
  tr.fit()
  rec = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
  assert abs(rec["tis/ratio_min"] - 1) < 1e-4 and abs(rec["tis/ratio_max"] - 1) < 1e-4, rec
  assert 0 <= rec["tis/kl_rollout_vs_policy"] < 1e-8 and rec["tis/frac_above_cap"] == 0.0


def test_tis_stats_against_float64():
  from sparrow_jax.run.hooks import rollout_is_stats
  rng = np.random.default_rng(0)
  old, roll = rng.normal(-2, 1, (3, 7)), rng.normal(-2, 1, (3, 7))
  mask = rng.random((3, 7)) < 0.6
  rho = np.exp(old - roll)[mask]
  out = rollout_is_stats(old.astype(np.float32), roll.astype(np.float32), mask, cap=1.5)
  np.testing.assert_allclose([out["tis/ratio_mean"], out["tis/ratio_max"], out["tis/ratio_p5"],
                              out["tis/frac_above_cap"], out["tis/kl_rollout_vs_policy"]],
                             [rho.mean(), rho.max(), np.percentile(rho, 5), np.mean(rho > 1.5),
                              np.mean(rho - 1 - (old - roll)[mask])], rtol=1e-5)
  assert rollout_is_stats(old, roll, np.zeros_like(mask)) == {}


def test_top_p_and_top_k_only_shape_sampling(tmp_path):
  """top_p < 1 / top_k > 0: the engine's log-probs are renormalised over the kept set (the
  top-k, then the nucleus of the renormalised top-k), the training side keeps the full
  tempered distribution (verl's convention), so rollout - dense = -log(kept mass under
  softmax(logits / T)) on every response token."""
  # (both filters at once: top-k, then top-p over the renormalised top-k set; the sampler's
  # own tests check each alone against transformers' warpers)
  top_p, top_k = 0.9, 5
  from flax import nnx
  temp = 0.7
  tr = _trainer(tmp_path, "distill=false", "schedule=dense", f"temperature={temp}",
                f"top_p={top_p}", f"top_k={top_k}")
  batch = tr.make_batch(tr.producer.rollout(tr.dataset.next_batch(), 1)).arrays()
  tokens = jnp.asarray(batch["tokens"])
  old = _recompute(tr, batch)["old_logp"]
  logits = np.asarray(nnx.merge(tr.graphdef, tr.params)(tokens), np.float64) / temp
  probs = np.exp(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))  # [B, T, V]
  top = -np.sort(-probs, axis=-1)[..., :top_k or None]  # the top-k set, descending
  renorm = top / top.sum(-1, keepdims=True)
  mass = np.sum(top * ((np.cumsum(renorm, -1) - renorm) < top_p), -1)  # as sampled
  m = batch["mask"] > 0
  kept = np.pad(mass[:, :-1], ((0, 0), (1, 0)))[m]  # token t is predicted at t - 1
  np.testing.assert_allclose(batch["rollout_logp"][m] - old[m], -np.log(kept), atol=5e-5)
  assert kept.min() < 0.99  # the filters really cut something
  with pytest.raises(ValueError, match="top_k=-1"):
    get_train_config("tiny", ["top_k=-1"])


# --- 6. dual clip on by default ----------------------------------------------------------------

def test_dual_clip_is_on_by_default_and_null_turns_it_off(tmp_path):
  tr = _trainer(tmp_path, "distill=false")
  assert tr.cfg.dual_clip_c == 3.0 and tr.learner.loss_cfg.dual_clip_c == 3.0
  for off in ("null", "none", "None"):
    assert get_train_config("tiny", [f"dual_clip_c={off}"]).dual_clip_c is None
  assert get_train_config("qwen3_4b", ["data=x.jsonl"]).dual_clip_c == 3.0
  with pytest.raises(ValueError, match="dual_clip_c=1.0"):
    get_train_config("tiny", ["dual_clip_c=1.0"])


# --- 7. aggregation over micro-batches -----------------------------------------------------------

def _uneven_batch(vocab, *, empty_micro: bool):
  rng = np.random.default_rng(0)
  b, t = 4 * G, 16
  tokens = rng.integers(3, vocab, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), np.float32)
  for i in range(b):  # rows 0-7 (micro-batch 0) short responses, rows 8-15 long ones
    n = 1 + i % 2 if i < b // 2 else 6 + i % 5
    mask[i, 4:4 + n] = 1
  if empty_micro:
    mask[: b // 2] = 0
  return dict(tokens=tokens, lengths=np.full((b,), t, np.int32),
              old_logp=rng.normal(-5.5, 0.3, (b, t)).astype(np.float32),
              advantages=rng.normal(size=b).astype(np.float32), mask=mask)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_micro_batched_gradient_equals_the_whole_mini_batch(tmp_path, agg):
  whole = _trainer(tmp_path / "a", "distill=false", f"loss_agg={agg}",
                   "skip_redundant_recompute=false")
  micro = _trainer(tmp_path / "b", "distill=false", f"loss_agg={agg}",
                   f"micro_batch_size={2 * G}", "skip_redundant_recompute=false")
  for empty in (False, True):
    batch = _uneven_batch(whole.model_cfg.vocab_size, empty_micro=empty)
    l1, m1, g1, _ = stages.mini_batch_grads(whole.learner, whole.params, batch)
    l2, m2, g2, _ = stages.mini_batch_grads(micro.learner, whole.params, batch)
    assert len(micro.learner.update_plan(batch["lengths"])) == 2
    assert np.isfinite(float(l2)) and all(np.isfinite(x).all() for x in _leaves(g2))
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-7)
    for x, y in zip(_leaves(g2), _leaves(g1), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7)
    for key in ("pg_loss", "clip_frac_high", "approx_kl", "ratio_max", "num_tokens"):
      np.testing.assert_allclose(float(m2[key]), float(m1[key]), rtol=1e-5, atol=1e-7)


# --- 8. dynamic sampling with refill -------------------------------------------------------------

def test_dynamic_sampling_refills_until_the_batch_is_informative(tmp_path, monkeypatch):
  tr = _trainer(tmp_path, "distill=false", "dynamic_sampling=true", "max_refill_rounds=3")
  _patch_rewards(monkeypatch, tr, ["ZIZI", "ZZZI", "IIZI"])
  rounds = []
  real_rollout = tr.producer.rollout
  monkeypatch.setattr(tr.producer, "rollout", lambda ex, step, r=0, **kw: rounds.append(
      real_rollout(ex, step, r, **kw)) or rounds[-1])
  with tr:
    comps, rewards, _, info = tr.producer.generate_groups(1)
  assert info.rounds == 3 and len(info.completions) == 3 * 4 * G
  want = rounds[0][G:2 * G] + rounds[0][3 * G:] + rounds[1][3 * G:] + rounds[2][:G]
  assert all(a is b for a, b in zip(comps, want, strict=True))  # first informative, FIFO
  np.testing.assert_array_equal(rewards.reshape(-1, G), [[1, 0, 0, 0]] * 4)
  ds = data_lib.PromptDataset(tr.examples, batch_size=4, seed=tr.cfg.seed)
  for _ in range(3):
    ds.next_batch()
  assert tr.dataset.state_dict() == ds.state_dict()  # the data position advanced 3 batches


def test_dynamic_sampling_refill_is_bounded_and_keeps_the_batch_shape(tmp_path, monkeypatch):
  tr = _trainer(tmp_path, "num_steps=1", "distill=false", "dynamic_sampling=true",
                "max_refill_rounds=1", "warmstart_steps=0")
  _patch_rewards(monkeypatch, tr, ["ZZZI", "ZIZZ", "IIII"])
  tr.fit()
  rec = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
  assert rec["dynamic_sampling/rounds"] == 2
  assert rec["dynamic_sampling/informative_groups"] == 2
  assert rec["dynamic_sampling/generated_groups"] == 8
  assert rec["reward/frac_zero_var_groups"] == 0.75
  assert np.isfinite(rec["loss/total"]) and rec["skipped_update"] is False


def test_dynamic_sampling_with_refill_resumes_exactly(tmp_path):
  args = ("distill=false", "dynamic_sampling=true", "max_refill_rounds=2", "save_every=1",
          "reward=test_parity", "warmstart_steps=0")  # groups informative about half the time: refills happen
  full = _trainer(tmp_path / "full", "num_steps=2", *args)
  full.fit()
  part = _trainer(tmp_path / "part", "num_steps=1", *args)
  part.fit()
  resumed = _trainer(tmp_path / "part", "num_steps=2", *args)
  assert resumed.resume() == 1
  resumed.fit()
  a = read_jsonl(str(tmp_path / "full" / "metrics.jsonl"))[2]
  b = read_jsonl(str(tmp_path / "part" / "metrics.jsonl"))[2]
  drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")
                    and k not in ("rollout/tokens_per_s", "compilations")}
  assert drop(a) == drop(b)
  first = read_jsonl(str(tmp_path / "full" / "metrics.jsonl"))[1]
  assert first["dynamic_sampling/rounds"] > 1 and a["dynamic_sampling/informative_groups"] > 0
  _assert_trees_equal(full._state(), resumed._state())
  assert full.dataset.state_dict() == resumed.dataset.state_dict()


# --- 9. DistillSparse's policy-gradient term ---------------------------------------------------

def test_distill_pg_term_moves_the_lora_and_leaves_the_policy_alone(tmp_path, monkeypatch):
  runs = {}
  for name, extra in (("on", ["distill_pg_coef=1.0", "distill_pg_clip=2.0"]), ("off", [])):
    tr = _trainer(tmp_path / name, "num_steps=1", "distill=true", "warmstart_steps=0", *extra)
    _patch_rewards(monkeypatch, tr, ["IIII"])  # nonzero advantages for the PG term
    tr.fit()
    runs[name] = (tr, read_jsonl(str(tmp_path / name / "metrics.jsonl"))[1])
  (on, r), (off, r_off) = runs["on"], runs["off"]
  _assert_trees_equal(on.params, off.params)  # the policy update is bitwise the same
  assert _trees_differ(on.lora, off.lora)  # the LoRA update is not
  # The term enters the LoRA's objective: loss = k3 + pg, and another gradient.
  assert np.isfinite(r["distill/pg_loss"]) and "distill/is_frac_truncated" in r
  np.testing.assert_allclose(r["distill/loss"], r["distill/k3"] + r["distill/pg_loss"],
                             rtol=1e-5, atol=1e-7)
  assert r["distill/grad_norm"] != r_off["distill/grad_norm"]
  assert "distill/pg_loss" not in r_off
  # The tiny task's sparse actor equals the policy here: the KL-only run skips its LoRA step
  # (distill_min_gap), the PG term's run does not (its gradient is the advantages' signal).
  assert r["distill/no_gap"] == 0.0 and r_off["distill/no_gap"] == 1.0, (r, r_off)
  assert 0.0 <= r_off["distill/max_abs_gap"] < 1e-4 and r_off["distill/skipped"] == 0.0
  with pytest.raises(ValueError, match="distill_pg_clip=0.0"):
    get_train_config("tiny", ["distill_pg_clip=0"])
  assert get_train_config("tiny", ["distill_pg_clip=null"]).distill_pg_clip is None
