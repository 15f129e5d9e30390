"""Bypass mode inside the trainer: the PPO clip's old policy is the rollout actor, so the
update's ratio is pi_theta / pi_rollout (sparse actor), while the decoupled default with the
redundant recompute skipped has ratio exactly 1; both read the same rollouts."""

import numpy as np

from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.trainer import Trainer
from tests.rl import reward_helpers  # noqa: F401  (registers test_parity)

BASE = ["warmstart_steps=0", "prompts_per_step=2", "group_size=4", "num_slots=8",
        "tensorboard=false", "reward_workers=1", "max_new_tokens=8", "distill=false",
        "schedule=constant:1", "page_size=2", "num_steps=1", "reward=test_parity"]


def _step(tmp, *extra):
  tr = Trainer(get_train_config("tiny", BASE + [f"out_dir={tmp}", *extra]), quiet=True)
  with tr:
    rec = tr.run_step()
  return tr, rec


def test_bypass_ratio_is_policy_over_rollout_actor(tmp_path):
  tr, rec = _step(tmp_path / "bypass", "rollout_mode=bypass")
  assert tr.programs.skip_recompute  # one update per batch: no recompute in either mode
  b, m = rec.batch, rec.batch.mask > 0
  # The monitor still gets the dense policy's log-probs (the update's own forward).
  assert b.old_logp is not None and b.dense_topk_ids is not None
  rho = np.exp(b.old_logp.astype(np.float64) - b.rollout_logp)[m]
  upd = rec.update_metrics[0]
  assert abs(rho.max() - 1) > 1e-3  # the sparse actor differs from the dense policy here
  np.testing.assert_allclose(float(upd["ratio_max"]), rho.max(), rtol=1e-4)
  np.testing.assert_allclose(float(upd["ratio_min"]), rho.min(), rtol=1e-4)
  _, dec = _step(tmp_path / "decoupled")
  u = dec.update_metrics[0]
  assert abs(float(u["ratio_max"]) - 1) < 1e-6 and abs(float(u["ratio_min"]) - 1) < 1e-6
  np.testing.assert_array_equal(dec.batch.tokens, b.tokens)  # the same rollouts
