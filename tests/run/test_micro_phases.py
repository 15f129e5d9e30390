"""Every micro-batched phase of the trainer equals its one-piece result (recompute: old
log-probs, the monitor's top-k, the reference; DistillSparse's loss and LoRA gradients; the
GRPO gradient under a token budget), the recompute skip gives the update the recompute gives,
and ragged lengths pack with little padding inside a real step."""

import jax
import numpy as np
import pytest

from sparrow_jax.run import microbatch as mb
from sparrow_jax.run import stages
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.trainer import Trainer

SMALL = ["warmstart_steps=0", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "reward_workers=1", "max_new_tokens=8"]


def _trainer(tmp, *extra) -> Trainer:
  return Trainer(get_train_config("tiny", SMALL + [f"out_dir={tmp}"] + list(extra)),
                 quiet=True)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _ragged_batch(tr, seed=0):
  """A rollout batch whose rows have very different lengths (responses of 1 to 8 tokens)."""
  rng = np.random.default_rng(seed)
  comps = tr.producer.rollout(tr.dataset.next_batch(), 1, lora=tr.lora)
  for c in comps:  # cut responses to random lengths: long-tailed rows
    n = int(rng.integers(1, len(c.token_ids) + 1))
    c.token_ids, c.logprobs = list(c.token_ids[:n]), list(c.logprobs[:n])
    c.topk_ids, c.topk_logprobs = c.topk_ids[:n], c.topk_logprobs[:n]
    if c.versions is not None:  # (the engine records each token's policy version)
      c.versions = c.versions[:n]
  return tr.make_batch(comps).arrays()


def _recompute(tr, batch):
  """Old log-probs, the monitor's dense top-k and the reference's log-probs of a batch."""
  return stages.dense_logprobs(tr.learner, tr.params, tr.ref_params, batch,
                               tr.learner.logprob_plan(batch["lengths"]))


def _distill_grads(tr, batch, plan):
  return stages.distill_grads(tr.learner, tr.state, batch, plan, tr.schedule)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """Two trainers with identical weights: one piece vs micro-batches of 4 rows / a budget."""
  tmp = tmp_path_factory.mktemp("pair")
  args = ["distill=true", "kl_coef=0.1", "schedule=constant:1", "page_size=2"]
  whole = _trainer(tmp / "whole", *args)
  micro = _trainer(tmp / "micro", *args, "logprob_micro_batch_size=4", "micro_batch_size=4")
  budget = _trainer(tmp / "budget", *args, "max_tokens_per_micro_batch=48")
  for t in (micro, budget):
    t.params, t.ref_params, t.lora = whole.params, whole.ref_params, whole.lora
  return whole, micro, budget, _ragged_batch(whole)


def test_recompute_in_micro_batches_equals_one_piece(pair):
  whole, micro, budget, batch = pair
  assert len(whole.learner.logprob_plan(batch["lengths"])) == 1
  assert len(micro.learner.logprob_plan(batch["lengths"])) == 4
  assert len(budget.learner.logprob_plan(batch["lengths"])) > 1
  ref = _recompute(whole, batch)
  m = batch["mask"] > 0
  for other in (micro, budget):
    got = _recompute(other, batch)
    for key in ("old_logp", "ref_logp"):
      np.testing.assert_allclose(got[key][m], ref[key][m], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["dense_topk_logp"][m], ref["dense_topk_logp"][m],
                               rtol=1e-5, atol=1e-6)
    # Same top-k sets (ids may swap only between tied log-probs).
    same = got["dense_topk_ids"][m] == ref["dense_topk_ids"][m]
    assert same.mean() > 0.999


def test_distill_in_micro_batches_equals_one_piece(pair):
  whole, micro, budget, batch = pair
  batch = dict(batch, old_logp=_recompute(whole, batch)["old_logp"])
  l1, m1, g1 = _distill_grads(whole, batch, whole.learner.logprob_plan(batch["lengths"]))
  for other in (micro, budget):
    plan = other.learner.update_plan(batch["lengths"])
    assert len(plan) > 1
    l2, m2, g2 = _distill_grads(other, batch, plan)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-7)
    for k in ("k3", "logp_gap", "num_tokens", "loss"):
      np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7)
    scale = max(np.abs(x).max() for x in _leaves(g1))
    assert scale > 0  # the LoRA gets a gradient
    for x, y in zip(_leaves(g2), _leaves(g1), strict=True):  # float32 sums in another order
      np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4 * scale)


def test_distill_lm_head_window_changes_nothing(pair, monkeypatch):
  """The trainer's distill program runs the LM head over the responses' window only
  (max_new_tokens wide, from each row's prompt length): the same loss and LoRA gradient as
  every position's, so the window is fed the right prompt lengths."""
  import dataclasses
  from sparrow_jax.run import programs
  whole, _, _, batch = pair
  assert batch["tokens"].shape[1] > whole.cfg.max_new_tokens  # the window cuts the rows
  batch = dict(batch, old_logp=_recompute(whole, batch)["old_logp"])
  plan = whole.learner.logprob_plan(batch["lengths"])
  l1, m1, g1 = _distill_grads(whole, batch, plan)
  every = programs.make_distill_grad(whole.graphdef, whole.attention, whole.learner.distill_cfg)
  monkeypatch.setattr(whole.learner, "programs", dataclasses.replace(whole.programs,
                                                             distill_grad=every))
  l0, m0, g0 = _distill_grads(whole, batch, plan)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7)
  for k in ("k3", "logp_gap", "max_abs_gap", "num_tokens"):
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7)
  scale = max(np.abs(x).max() for x in _leaves(g0))
  assert scale > 0
  for x, y in zip(_leaves(g1), _leaves(g0), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4 * scale)


def test_update_under_a_token_budget_equals_one_piece(pair):
  whole, _, budget, batch = pair
  rng = np.random.default_rng(3)
  full = dict(tokens=batch["tokens"], lengths=batch["lengths"], mask=batch["mask"],
              advantages=rng.normal(size=len(batch["lengths"])).astype(np.float32),
              old_logp=_recompute(whole, batch)["old_logp"],
              ref_logp=_recompute(whole, batch)["ref_logp"])
  l1, m1, g1, _ = stages.mini_batch_grads(whole.learner, whole.params, full)
  l2, m2, g2, _ = stages.mini_batch_grads(budget.learner, whole.params, full)
  assert len(budget.learner.update_plan(full["lengths"])) > 1
  np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-7)
  scale = max(np.abs(x).max() for x in _leaves(g1))
  for x, y in zip(_leaves(g2), _leaves(g1), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4 * scale)
  for k in ("pg_loss", "kl", "clip_frac_high", "ratio_max", "num_tokens"):
    np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-7)


def test_recompute_skip_gives_the_update_of_the_recompute(tmp_path):
  """Also the KV pool: `skip` frees it while it trains (the default) and rebuilds it for the
  next rollout, `full` keeps it (release_kv_cache=false); step 2 rolls out from the rebuilt
  pool and both give the same rollouts and updates."""
  skip = _trainer(tmp_path / "skip", "distill=false", "num_steps=2")
  full = _trainer(tmp_path / "full", "distill=false", "num_steps=2",
                  "skip_redundant_recompute=false", "release_kv_cache=false")
  assert skip.programs.skip_recompute and not full.programs.skip_recompute
  pool = full.engine.kv_pool_bytes
  assert pool == skip.engine.kv_pool_bytes > 0
  for _ in range(2):
    a, b = skip.train_step(), full.train_step()
    assert skip.engine.kv_pool_bytes == 0 and full.engine.kv_pool_bytes == pool
    assert a["recompute/skipped"] == 1.0 and b["recompute/skipped"] == 0.0
    for k in ("reward/mean", "response/len_mean", "rollout/tokens"):
      assert a[k] == b[k]  # the same rollouts
    assert ([list(c.token_ids) for c in skip.last_rollout[1]]
            == [list(c.token_ids) for c in full.last_rollout[1]])
    for k in ("loss/total", "loss/policy", "grad_norm", "mismatch/p5_overall",
              "mismatch/tokens"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6)
  for x, y in zip(_leaves(skip.params), _leaves(full.params), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
  # Not skipped where something needs the old log-probs first.
  assert not get_train_config("tiny", ["distill=true"]).skips_recompute
  assert not get_train_config("tiny", ["distill=false", "ppo_epochs=2"]).skips_recompute
  assert not get_train_config("tiny", ["distill=false", "mini_batch_size=64"]).skips_recompute


def test_short_and_long_rows_pack_with_little_padding(tmp_path):
  """Responses of 16, 16, 16 and 512 tokens with a budget that holds the short ones together:
  at most 15% of the processed tokens are padding (one batch-wide bucket: about 70%)."""
  tr = _trainer(tmp_path, "max_new_tokens=512", "max_prompt_len=8",
                "max_tokens_per_micro_batch=1024", "prompts_per_step=1", "group_size=4")
  lengths = np.array([8 + 16, 8 + 16, 8 + 512, 8 + 16])
  plan = tr.learner.update_plan(lengths)
  assert mb.padding_frac(plan, lengths) <= 0.15
  one_piece = 1 - lengths.sum() / (4 * 1024)  # the old power-of-two batch bucket
  assert one_piece > 0.6
