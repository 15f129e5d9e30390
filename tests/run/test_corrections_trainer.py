"""The rollout-correction keys reach the training step (issue 48): a correction that rejects
every token trains nothing, one that rejects nothing equals no correction, and one step of
each preset-like combination (corrections.PRESETS) runs and logs its `rollout_corr/*`
metrics."""

import jax
import numpy as np
import pytest

from tests.rl import reward_helpers  # noqa: F401  (registers test_parity)
from sparrow_jax.rl import corrections
from sparrow_jax.run import algorithm
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.trainer import Trainer

# Tiny trainers as in test_trainer.py, one step, no DistillSparse; the recompute is kept in
# every run so that runs with and without a correction see the same old log-probs. The
# parity reward gives the untrained policy informative groups (train_step has no warm start).
# 3-digit sums and 8 new tokens make the sparse actor differ from the dense policy (pi / q
# in ~[0.89, 1.11] here; with the preset's 1-digit sums every sequence fits its budget and
# pi = q up to rounding).
SMALL = ["reward=test_parity", "arith_min_digits=3", "arith_max_digits=3", "max_new_tokens=8",
         "warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "save_every=0", "num_steps=1", "distill=false",
         "skip_redundant_recompute=false", "weight_decay=0.0"]


def _keys(d):
  return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()]


def _trainer(tmp, *extra):
  return Trainer(get_train_config("tiny", SMALL + [f"out_dir={tmp}"] + list(extra)),
                 quiet=True)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_every_preset_is_a_valid_training_configuration():
  for name, kw in corrections.PRESETS.items():
    cfg = get_train_config("tiny", _keys(kw))
    lc = algorithm.loss_config(cfg)
    assert lc.correction.active or lc.rollout_bypass, name
  cfg = get_train_config("tiny", _keys(corrections.PRESETS["geo_rs"]))
  assert not cfg.skips_recompute  # the decoupled rejection needs old log-probs first


@pytest.mark.parametrize("keys", [
    ("rollout_rs=token", "rollout_rs_threshold=1000000_10000000"),  # every token rejected
    ("rollout_is=token", "rollout_is_threshold=5_6"),  # IcePop: every weight 0, mask kept
], ids=["rejection", "icepop-zero-weights"])
def test_a_correction_that_rejects_everything_leaves_the_params_unchanged(tmp_path, keys):
  tr = _trainer(tmp_path, *keys)
  before = _leaves(tr.params)
  out = tr.train_step()
  assert out["reward/frac_zero_var_groups"] < 1.0  # there was something to train on
  if "rollout_rs=token" in keys:
    assert out["rollout_corr/rejected_token_frac"] == 1.0
    assert out["rollout_corr/rejected_seq_frac"] == 1.0
  else:
    assert out["rollout_corr/rejected_token_frac"] == 0.0
    assert out["rollout_corr/is_weight_max"] == 0.0 and out["rollout_corr/ess"] == 0.0
  for x, y in zip(before, _leaves(tr.params)):
    np.testing.assert_array_equal(x, y)


def test_a_correction_that_rejects_nothing_equals_no_correction(tmp_path):
  plain = _trainer(tmp_path / "plain")
  plain_out = plain.train_step()
  # decoupled: old = the dense recompute = the policy before its first update, so the PPO
  # ratio starts at 1 (the bypass test below relies on the contrast)
  assert abs(plain_out["loss/approx_kl"]) < 1e-5
  # every statistic and the veto with thresholds nothing reaches
  tr = _trainer(tmp_path / "corr", "rollout_rs=token,seq_sum_k3,seq_max_k2",
                "rollout_rs_threshold=1000000,1000000,1000000",
                "rollout_token_veto_threshold=1e-30")
  out = tr.train_step()
  assert out["rollout_corr/rejected_token_frac"] == 0.0
  for x, y in zip(_leaves(plain.params), _leaves(tr.params)):
    np.testing.assert_array_equal(y, x)
  before = _leaves(_trainer(tmp_path / "fresh").params)
  assert any(not np.array_equal(a, b) for a, b in zip(before, _leaves(tr.params)))  # it trained


@pytest.mark.parametrize("name", sorted(corrections.PRESETS))
def test_one_step_of_each_preset_runs_and_logs_its_metrics(tmp_path, name):
  kw = corrections.PRESETS[name]
  tr = _trainer(tmp_path, *_keys(kw))
  out = tr.train_step()
  assert np.isfinite(out["loss/total"])
  logged = {k for k in out if k.startswith(corrections.PREFIX)}
  if kw.get("rollout_mode") == "bypass":
    # old = the sparse actor's log-probs: the PPO ratio pi_theta / q starts away from 1
    # (approx_kl = mean(old - logp); ~0 in decoupled mode)
    assert abs(out["loss/approx_kl"]) > 1e-4
  if kw.get("rollout_mode") == "bypass" and not kw.get("rollout_rs"):
    assert not logged  # plain PPO-clip against the rollout policy: nothing to report
    return
  want = {"k1", "k2", "k3", "rejected_token_frac", "rejected_seq_frac"}
  if kw.get("rollout_is"):
    want |= {"is_weight_mean", "is_weight_max", "ess"}
  if kw.get("rollout_token_veto_threshold"):
    want.add("veto_seq_frac")
  assert {corrections.PREFIX + k for k in want} <= logged, sorted(logged)
  for k in logged:
    assert np.isfinite(out[k]), k
  if kw.get("rollout_is_batch_normalize"):
    assert out["rollout_corr/is_weight_mean"] == pytest.approx(1.0, rel=1e-5)
  if kw.get("rollout_is"):
    assert 0.0 < out["rollout_corr/ess"] < 1.0  # unequal weights: the mismatch is real
  assert out["rollout_corr/k3"] > 1e-5
