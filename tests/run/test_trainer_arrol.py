"""ARRoL in the trainer: pruned rollouts leave before scoring, survivors are re-batched with
ragged GRPO advantages, the quality head trains on the labelled detection states, the metrics
are logged, and a resumed run continues bit for bit (head, Adam state, calibrator, step).
With the tiny default: block-sparse rollouts with DistillSparse on, and random pruning."""

import jax
import numpy as np
import pytest

from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl import grpo
from sparrow_jax.run import stages
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.trainer import Trainer
from tests.run.resume_helpers import assert_same_metrics, full_and_interrupted

ARROL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "save_every=1", "arrol=true", "arrol_detect_len=1",
         "arrol_warmup_steps=1", "max_new_tokens=4"]
KEYS = ("arrol/kept_frac", "arrol/rho_hat_mean", "arrol/rho_hat_var", "arrol/head_acc",
        "arrol/head_auc", "arrol/delta", "time/rollout_s", "time/recompute_s", "time/update_s")


def _cfg(tmp, *extra):
  return get_train_config("tiny", ARROL + [f"out_dir={tmp}"] + list(extra))


def test_arrol_step_prunes_rebatches_and_trains_the_head(tmp_path, monkeypatch):
  tr = Trainer(_cfg(tmp_path, "num_steps=2"), quiet=True)
  assert tr.schedule.name.startswith("constant") and tr.cfg.distill  # sparse actor + LoRA
  seen = {}
  real_update = stages.apply_updates

  def spy(ln, state, full):
    seen["rows"] = full["tokens"].shape[0]
    seen["adv"], seen["mask"] = full["advantages"].copy(), full["mask"].copy()
    return real_update(ln, state, full)

  monkeypatch.setattr(stages, "apply_updates", spy)
  head0 = jax.tree.map(np.asarray, tr.arrol.params)
  m1 = tr.train_step()  # warm-up: nothing pruned, the head still learns
  assert m1["arrol/kept_frac"] == 1.0 and m1["arrol/warmup"] == 1.0
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(head0), jax.tree.leaves(jax.tree.map(np.asarray,
                                                                       tr.arrol.params))))
  m2 = tr.train_step()
  comps, rewards = tr.last_rollout[1], tr.last_rollout[2]
  n = len(comps)
  assert 0 < m2["arrol/pruned"] and n == 16 - m2["arrol/pruned"]
  assert m2["arrol/kept_frac"] == pytest.approx(n / 16)
  assert all(not c.pruned for c in comps)
  # Survivors re-batched as they are (the micro-batch driver pads), advantages per group.
  assert seen["rows"] == n
  want = grpo.ragged_group_advantages(rewards, [c.request_id[0] for c in comps])
  np.testing.assert_allclose(seen["adv"], want, atol=1e-6)
  for k in KEYS:
    assert k in m2, k
  assert m2["arrol/rho_hat_mean"] == pytest.approx(
      arrol_lib.rho_hat_stats(rewards, [c.request_id[0] for c in comps])[0])


def test_arrol_resume_continues_exactly(tmp_path):
  mode = "head"
  # (the head's state is the one a resume must restore: calibrator bins, head weights; the
  # random mode keeps none beyond the step)
  full, _, resumed = full_and_interrupted(_cfg, tmp_path, 4, 2, f"arrol_mode={mode}")
  assert resumed.resume() == 2
  assert resumed.arrol.step == 2
  resumed.fit()
  a, _ = assert_same_metrics(tmp_path, (3, 4))
  for step in (3, 4):
    assert a[step]["arrol/kept_frac"] < 1.0
  sa, sb = full.arrol.state_dict(), resumed.arrol.state_dict()
  for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eval_votes_with_the_head_and_deepconf_side_by_side(tmp_path, monkeypatch):
  from sparrow_jax.rl import eval_metrics as em
  from sparrow_jax.run.evaluate import evaluate, extract_answer
  tr = Trainer(_cfg(tmp_path, "num_steps=1", "warmstart_steps=20"), quiet=True)
  tr.fit()
  captured = {}
  real = tr.engine.generate

  def spy(reqs, **kw):
    captured["prune"] = kw.get("prune")
    captured["comps"] = real(reqs, **kw)
    return captured["comps"]

  monkeypatch.setattr(tr.engine, "generate", spy)
  examples = tr.examples[:6]
  out = evaluate(tr, examples, k=4, deepconf_window=2)
  comps = captured["comps"]
  assert not any(c.pruned for c in comps)  # the head scores, it never prunes at test time
  assert all(c.quality_logit is not None for c in comps if len(c.token_ids) > 1)
  texts = [tr.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
  answers = [[extract_answer(texts[i * 4 + j]) for j in range(4)] for i in range(6)]
  rewards = [[float(tr.reward_fn(texts[i * 4 + j], examples[i].answer)) for j in range(4)]
             for i in range(6)]
  def head_scores(row):  # an unscored sample (one token, never decoded) ranks lowest
    got = [c.quality_logit for c in row if c.quality_logit is not None]
    return [c.quality_logit if c.quality_logit is not None else min(got, default=1.0) - 1.0
            for c in row]

  scores = [head_scores(comps[i * 4:(i + 1) * 4]) for i in range(6)]
  conf = [[em.trace_confidence(c.topk_logprobs, window=2) for c in comps[i * 4:(i + 1) * 4]]
          for i in range(6)]
  assert out["eval/head_maj@4"] == em.weighted_maj_at_k(answers, rewards, scores, 4, rank=True)
  assert out["eval/deepconf_maj@4"] == em.weighted_maj_at_k(answers, rewards, conf, 4)
  assert out["eval/maj@4"] == em.maj_at_k(answers, rewards, 4)


@pytest.mark.slow
def test_arrol_decisions_do_not_depend_on_the_pool(tmp_path):
  """A pool so small that rollouts are preempted and readmitted keeps every ARRoL decision
  of a pool that fits everyone: detection points, head logits, pruned rollouts, survivors."""
  extra = ["num_steps=2", "max_new_tokens=12", "decode_chunk=2", "arrol_detect_len=4"]
  seen = {}
  for name, pool in (("large", []), ("tiny", ["kv_cache_gb=0.00018"])):
    tr = Trainer(_cfg(tmp_path / name, *extra, *pool), quiet=True)
    calls, preempted = [], 0
    real = tr.engine.generate

    def spy(reqs, **kw):
      outs = real(reqs, **kw)
      calls.append([(c.request_id, c.pruned, c.detect_index, c.quality_logit,
                     tuple(c.token_ids)) for c in outs])
      return outs

    tr.engine.generate = spy
    for _ in range(2):  # the warm-up step, then one that prunes
      m = tr.train_step()
      preempted += tr.engine.last_stats["preemptions"]
    seen[name] = (calls, preempted, m["arrol/pruned"])
  (big, n_big, pruned_big), (small, n_small, pruned_small) = seen["large"], seen["tiny"]
  assert n_big == 0 and n_small > 0
  assert pruned_big == pruned_small > 0
  assert len(big) == len(small)
  for a, b in zip(big, small):
    for (ida, pa, da, la, ta), (idb, pb, db, lb, tb) in zip(a, b):
      assert (ida, pa, da) == (idb, pb, db)
      # A rollout pruned while running stops when its group is decided, which waits for the
      # group's slowest member: its partial tokens (dropped by the trainer) depend on the pool.
      n = min(len(ta), len(tb)) if pa else len(ta)
      assert ta[:n] == tb[:n] and (pa or ta == tb)
      assert (la is None) == (lb is None)
      if la is not None:
        assert la == pytest.approx(lb, abs=1e-5)
