"""The run package's pieces on their own: the typed batch, the training state and its
checkpoint layout, the advantage estimators by name, hooks and the step's composition by
feature (no trainer is built except where the composition needs one)."""

import dataclasses

import jax
import numpy as np
import pytest

from sparrow_jax.engine.config import Completion
from sparrow_jax.rl import grpo
from sparrow_jax.rl.advantages import compute_advantages
from sparrow_jax.rl.registry import ADVANTAGES, CORRECTIONS, POLICY_LOSSES, Registry
from sparrow_jax.run import hooks, stages
from sparrow_jax.run.batch import TrainBatch, make_batch
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.state import TrainState


def _comp(prompt, resp, *, versions=None, loss_mask=None, k=2, rid=(0, 0)):
  n = len(resp)
  return Completion(request_id=rid, prompt_ids=np.asarray(prompt, np.int32),
                    token_ids=np.asarray(resp, np.int32),
                    logprobs=-np.arange(1, n + 1, dtype=np.float32),
                    finish_reason="stop", topk_ids=np.tile(np.arange(k, dtype=np.int32), (n, 1)),
                    topk_logprobs=np.full((n, k), -0.5, np.float32), versions=versions,
                    loss_mask=loss_mask)


def test_make_batch_lays_out_rows_masks_and_versions():
  comps = [_comp([5, 6, 7], [1, 2], rid=(0, 0)),
           _comp([5], [3, 4, 8, 9], rid=(0, 1), versions=np.array([2, 2, 3, 3]),
                 loss_mask=np.array([1, 0, 0, 1]))]
  b = make_batch(comps, max_new_tokens=4, topk=2, step=7, version=3, rewards=[1.0, 0.0])
  assert b.tokens.shape == (2, 5) and b.tokens.dtype == np.int32
  np.testing.assert_array_equal(b.tokens, [[5, 6, 7, 1, 2], [5, 3, 4, 8, 9]])
  np.testing.assert_array_equal(b.lengths, [5, 5])
  np.testing.assert_array_equal(b.prompt_lens, [3, 1])
  # Response tokens carry the loss mask: all ones without one, the completion's own with it.
  np.testing.assert_array_equal(b.mask, [[0, 0, 0, 1, 1], [0, 1, 0, 0, 1]])
  # Each token's policy version: the batch's when the completion has none, else its own.
  np.testing.assert_array_equal(b.versions, [[-1, -1, -1, 3, 3], [-1, 2, 2, 3, 3]])
  np.testing.assert_array_equal(b.rollout_logp[0], [0, 0, 0, -1, -2])
  assert b.rollout_topk_logp[0, 0, 0] == -1e9 and b.rollout_topk_logp[0, 3, 0] == -0.5
  assert b.group_ids == [0, 0] and b.step == 7 and b.policy_version == 3
  assert set(b.arrays()) == {"tokens", "lengths", "prompt_lens", "mask", "versions",
                             "rollout_logp", "rollout_topk_ids", "rollout_topk_logp"}
  with pytest.raises(KeyError, match="no array field 'bogus'"):
    b.arrays("bogus")
  with pytest.raises(AttributeError):  # nothing is added under an undeclared name
    b.bogus = 1
  sub = b.rows_of(slice(1, 2))
  assert sub.tokens.shape == (1, 5) and sub.rewards.tolist() == [0.0]


def test_make_batch_refuses_a_response_past_the_window():
  with pytest.raises(ValueError, match="5 response tokens > max_new_tokens=4"):
    make_batch([_comp([1], [1, 2, 3, 4, 5])], max_new_tokens=4, topk=2)


def test_train_state_is_a_pytree_with_the_old_checkpoint_layout():
  st = TrainState(step=3, params={"w": np.ones(2)}, opt_state=(np.zeros(2),), seed=5,
                  data={"epoch": 1})
  leaves, treedef = jax.tree.flatten(st)
  assert len(leaves) == 2  # arrays only; None fields are empty subtrees
  assert jax.tree.unflatten(treedef, leaves).step == 3
  assert set(st.checkpoint_arrays()) == {"params", "opt_state"}
  meta = st.checkpoint_metadata()
  assert meta["step"] == 3 and meta["data"] == {"epoch": 1} and meta["rng"]["seed"] == 5
  # A checkpoint written before policy versions existed resumes with version = step.
  old_meta = {k: v for k, v in meta.items() if k != "policy_version"}
  back = st.restored({"params": {"w": np.zeros(2)}, "opt_state": (np.ones(2),)},
                     dict(old_meta, step=9))
  assert back.step == 9 and back.policy_version == 9 and back.warmstart_done is False
  np.testing.assert_array_equal(back.params["w"], np.zeros(2))


def test_advantage_estimators_against_float64_references():
  rng = np.random.default_rng(0)
  r = rng.integers(0, 2, 12).astype(np.float32)
  ids = np.arange(12) // 4
  ref_grpo = np.asarray(grpo.group_advantages(r, 4))
  np.testing.assert_allclose(compute_advantages("grpo", r, ids, group_size=4,
                                                normalize_std=True), ref_grpo, atol=1e-6)
  # rloo: r_i minus the mean of the group's other rewards, in float64.
  want = np.zeros(12)
  for g in range(3):
    x = r[g * 4:(g + 1) * 4].astype(np.float64)
    for i in range(4):
      want[g * 4 + i] = x[i] - (x.sum() - x[i]) / 3
  got = compute_advantages("rloo", r, ids, group_size=4, normalize_std=True)
  np.testing.assert_allclose(got, want, atol=1e-6)
  # Ragged groups (ARRoL): a group of one member gets 0.
  got = compute_advantages("rloo", [1.0, 0.0, 1.0], ["a", "a", "b"], group_size=None,
                           normalize_std=True)
  np.testing.assert_allclose(got, [1.0, -1.0, 0.0])
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo.*rloo"):
    compute_advantages("ppo", r, ids, group_size=4, normalize_std=True)


def test_registry_names_and_refusals():
  reg = Registry("thing")
  f = reg.register("a", "the a")(lambda: 1)
  assert reg.get("a") is f and reg.doc("a") == "the a" and "a" in reg and reg.names() == ("a",)
  with pytest.raises(ValueError, match="registered already"):
    reg.register("a")(lambda: 2)
  with pytest.raises(ValueError, match="unknown thing 'b'"):
    reg.get("b")
  assert {"grpo", "rloo"} <= set(ADVANTAGES.names())
  assert isinstance(CORRECTIONS, Registry) and isinstance(POLICY_LOSSES, Registry)


def test_a_hook_runs_when_its_step_is_due():
  h = hooks.Hook("x", lambda tr, rec: {}, every=3)
  assert [s for s in range(1, 10) if h.due(s)] == [3, 6, 9]
  assert not hooks.Hook("off", lambda tr, rec: {}, every=0).due(4)


@pytest.mark.parametrize("extra,want_stages,want_hooks", [
    (["distill=false"], ["batch", "recompute", "advantages", "update"], ["monitor"]),
    (["distill=true", "exact_alpha_every=2"],
     ["batch", "recompute", "advantages", "distill", "update"], ["exact_alpha", "monitor"]),
])
def test_a_feature_adds_its_stage_or_hook(extra, want_stages, want_hooks):
  cfg = get_train_config("tiny", extra)
  assert [n for n, _ in stages.learner_stages(cfg)] == want_stages
  got = hooks.step_hooks(cfg, ladder_on=False, arrol_on=False)
  assert [h.name for h in got] == want_hooks
  assert [h.name for h in hooks.step_hooks(cfg, ladder_on=True, arrol_on=True)] == (
      want_hooks + ["ladder", "arrol"])
  if "exact_alpha_every=2" in extra:
    assert got[0].point == "before_update" and got[0].every == 2


def test_train_batch_fields_are_typed_and_shape_commented():
  """Every field of the batch has a type; the array ones name their shape."""
  import inspect
  src = inspect.getsource(TrainBatch)
  for f in dataclasses.fields(TrainBatch):
    assert f.type, f.name
    if f.name in ("tokens", "mask", "versions", "rollout_logp", "old_logp", "advantages"):
      line = next(x for x in src.splitlines() if x.strip().startswith(f.name + ":"))
      assert "[B" in line, line
