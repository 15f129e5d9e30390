"""DistillSparse inside the trainer: the LoRA cannot leak into the policy update, it does get
trained, and the schedule ladder switches exactly when the probe tail stays above tau."""

import jax
import numpy as np
import pytest

from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.metrics import read_jsonl
from sparrow_jax.run.trainer import Trainer

# Responses long enough to reach the pages that the schedules leave out: with pages of 2
# tokens and 1 bos + 2 recent pages reserved, `constant:B` attends to every key up to
# position 2 * (B + 3) - 1, and the tiny task's prompts are ~5 tokens. Shorter responses make
# the sparse actor equal the dense policy, so that only rounding noise would move the LoRA or
# lower the probe's tail.
SMALL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "max_new_tokens=12"]


def _trainer(tmp, *extra):
  return Trainer(get_train_config("tiny", SMALL + [f"out_dir={tmp}"] + list(extra)), quiet=True)


def test_policy_after_one_step_is_bitwise_identical_with_and_without_distill(tmp_path):
  # The same update path in both (the recompute is skipped only without DistillSparse).
  # exact_alpha_every runs before the update and changes nothing (checked below on `off`).
  # T = 0.7: the exact alpha, the monitor and the replay check below all work at the
  # rollout's temperature (a T mix-up anywhere shows).
  on = _trainer(tmp_path / "on", "num_steps=1", "distill=true", "temperature=0.7")
  off = _trainer(tmp_path / "off", "num_steps=1", "distill=false", "temperature=0.7",
                 "skip_redundant_recompute=false", "exact_alpha_every=1", "exact_alpha_rows=0")
  lora_before = [np.asarray(x) for x in jax.tree.leaves(on.lora)]
  on.fit()
  off.fit()
  for a, b in zip(jax.tree.leaves(jax.device_get(on.params)),
                  jax.tree.leaves(jax.device_get(off.params))):
    np.testing.assert_array_equal(a, b)
  # ... while the LoRA itself did move (B leaves start at zero).
  lora_after = [np.asarray(x) for x in jax.tree.leaves(on.lora)]
  assert any(not np.array_equal(x, y) for x, y in zip(lora_before, lora_after))
  rec = read_jsonl(str(tmp_path / "on" / "metrics.jsonl"))[1]
  assert "distill/loss" in rec and np.isfinite(rec["distill/loss"])
  assert rec["distill/grad_norm"] > 1e-5 and abs(rec["distill/logp_gap"]) > 1e-6, rec  # real
  assert rec["distill/max_abs_gap"] > 1e-4 and rec["distill/no_gap"] == 0.0, rec
  off_rec = read_jsonl(str(tmp_path / "off" / "metrics.jsonl"))[1]
  _assert_exact_alpha_bounded_below_by_the_monitor(off_rec)
  # TIS statistics are logged with TIS off too: the sparse actor's tokens are off the dense
  # policy, so the ratios spread around 1 and KL(q || pi) is positive.
  assert off_rec["tis/ratio_min"] < 1 - 1e-3 < 1 + 1e-3 < off_rec["tis/ratio_max"], off_rec
  assert off_rec["tis/kl_rollout_vs_policy"] > 1e-6, off_rec["tis/kl_rollout_vs_policy"]
  assert 0.0 <= off_rec["tis/frac_above_cap"] <= 1.0


def test_bf16_landmarks_reach_the_engine_and_the_exact_alpha(tmp_path):
  """landmark_dtype=bfloat16 (the GPU presets' setting) through the whole step: the engine's
  cache keeps bf16 landmarks, and the exact alpha and replay check, which rerun the sparse
  actor teacher-forced, select the very pages the engine selected (replay within 1e-4)."""
  tr = _trainer(tmp_path, "num_steps=1", "temperature=0.7", "landmark_dtype=bfloat16",
                "exact_alpha_every=1", "exact_alpha_rows=0")
  tr.fit()
  pool = tr.engine._pool()  # (released while training; a fresh one is built as for a rollout)
  assert {x.dtype for x in jax.tree.leaves(pool.landmarks)} == {np.dtype("bfloat16")}
  _assert_exact_alpha_bounded_below_by_the_monitor(
      read_jsonl(str(tmp_path / "metrics.jsonl"))[1])


def _assert_exact_alpha_bounded_below_by_the_monitor(rec):
  # The monitor's top-k statistic is a per-token lower bound of alpha_t, so per position bin
  # its p5 cannot exceed the exact p5 over the same tokens (every rollout: rows=0).
  bins = sorted(int(k.rsplit("_", 1)[1]) for k in rec if k.startswith("mismatch/exact_p5_bin_"))
  assert bins and rec["mismatch/exact_rows"] == 16.0, rec
  assert rec["mismatch/exact_p5"] == min(rec[f"mismatch/exact_p5_bin_{b}"] for b in bins)
  assert rec["mismatch/exact_p5"] < 0.9999  # 12-token responses: sparsity is real
  for b in bins:
    exact, bound = rec[f"mismatch/exact_p5_bin_{b}"], rec[f"mismatch/p5_bin_{b}"]
    assert 0.0 < bound <= exact + 1e-4 <= 1.0 + 1e-4, (b, bound, exact)
    assert rec[f"mismatch/exact_count_bin_{b}"] == rec[f"mismatch/count_bin_{b}"], b
  # The same bound restricted to the exact rows (all of them here) and checked token by token.
  assert rec["mismatch/bound_p5_exact_rows"] == pytest.approx(
      min(rec[f"mismatch/p5_bin_{b}"] for b in bins), abs=1e-6)
  assert rec["mismatch/bound_above_exact_frac"] == 0.0
  assert 0.0 <= rec["mismatch/exact_bound_gap"] < 1.0
  # The teacher-forced sparse actor replays the engine's sampled-token log-probs (same
  # temperature, same alignment, same pages): a mix-up of any of them is off by >> 1e-4.
  assert rec["mismatch/replay_logp_maxdiff"] < 1e-4, rec["mismatch/replay_logp_maxdiff"]
  assert rec["mismatch/replay_frac_off"] == 0.0 and rec["mismatch/replay_rows_off"] == 0.0
  assert rec["time/exact_alpha_s"] > 0


def _ladder_run(tmp, tau):
  tr = _trainer(tmp, "num_steps=4", "distill=true", "schedule=constant:3",
                "ladder=constant:2,constant:1", "probe_every=1", "ladder_patience=2",
                "probe_min_count=4",
                f"tau={tau}")
  tr.fit()
  return tr, read_jsonl(str(tmp / "metrics.jsonl"))


def test_ladder_switches_when_the_probe_tail_stays_above_tau(tmp_path):
  tr, recs = _ladder_run(tmp_path / "low", 0.01)  # every probe tail is >= 0.01
  assert [recs[s]["schedule"] for s in (1, 2, 3, 4)] == ["constant-3", "constant-3",
                                                          "constant-2", "constant-2"]
  assert tr.schedule.budgets == (1,)  # switched twice: 3 -> 2 (after step 2) -> 1 (step 4)
  assert recs[4]["ladder/switches"] == 2.0
  assert tr.engine.schedule.budgets == (1,)


def test_ladder_does_not_switch_when_the_tail_stays_below_tau(tmp_path):
  tau = 0.9999  # this near-random model's probe tails are ~0.997-0.999 (sparsity is real)
  tr, recs = _ladder_run(tmp_path / "high", tau)
  assert all(recs[s]["schedule"] == "constant-3" for s in (1, 2, 3, 4))
  assert recs[4]["ladder/switches"] == 0.0 and tr.schedule.budgets == (3,)
  assert all(recs[s]["ladder/probe_tail_alpha"] < tau for s in (1, 2, 3, 4))


def test_no_lora_step_below_distill_min_gap(tmp_path):
  # The threshold is what decides (the short-response case where the gap is rounding noise
  # is checked in test_trainer_correctness's PG-term test): above a real gap (12-token
  # responses, which move the LoRA in the first test) no step is taken, and the LoRA and its
  # moments stay as they were (one step: its lr is 0 under the LoRA's warm-up, but a taken
  # step would set the moments).
  tr = _trainer(tmp_path / "high", "num_steps=1", "distill=true", "distill_min_gap=1e9")
  opt_leaves = [np.asarray(x) for x in jax.tree.leaves(tr.lora_opt_state)]
  assert any(x.size > 1 and not x.any() for x in opt_leaves)  # Adam moments start at zero
  before = [np.asarray(x) for x in jax.tree.leaves((tr.lora, tr.lora_opt_state))]
  tr.fit()
  r = read_jsonl(str(tmp_path / "high" / "metrics.jsonl"))[1]
  assert r["distill/no_gap"] == 1.0 and r["distill/max_abs_gap"] > 1e-4, r
  after = jax.tree.leaves((tr.lora, tr.lora_opt_state))
  assert len(before) == len(after)
  for x, y in zip(before, after):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_triton_interpret_rollouts_score_pages_with_the_kernel_and_replay_them(tmp_path):
  """attention_backend=pallas_interpret: the engine decodes through the Triton kernels in the
  interpreter, its pages scored by the page-score kernel; the exact alpha and the replay check
  rerun the sparse actor teacher-forced in XLA and select the very same pages (replay within
  1e-4: a page chosen differently would move a log-prob by far more). page_scorer=xla keeps the
  XLA scoring in the same trainer."""
  tr = _trainer(tmp_path / "kernel", "num_steps=1", "temperature=0.7",
                "attention_backend=pallas_interpret", "exact_alpha_every=1",
                "exact_alpha_rows=0")
  assert tr.attention.backend == "pallas_interpret" and tr.attention.page_scorer == "auto"
  assert tr.engine.attention is tr.attention
  tr.fit()
  _assert_exact_alpha_bounded_below_by_the_monitor(
      read_jsonl(str(tmp_path / "kernel" / "metrics.jsonl"))[1])
  off = _trainer(tmp_path / "xla", "num_steps=1", "attention_backend=pallas_interpret",
                 "page_scorer=xla", "schedule=constant:3", "ladder=constant:1",
                 "distill=true")
  assert off.attention.page_scorer == "xla" and off.engine.attention.page_scorer == "xla"
  off.switch_schedule(off.ladder.candidate)  # what a ladder switch does: the key stays
  assert off.schedule.budgets == (1,)
  assert off.attention.page_scorer == "xla" and off.engine.attention.page_scorer == "xla"
  with pytest.raises(ValueError, match="page_scorer='triton'"):
    get_train_config("tiny", ["page_scorer=triton"])
