"""The step's one flat metrics dict for the logger, from its record (batch, generation info,
update metrics, times) and what the stages and hooks reported."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sparrow_jax.run.builders import _frac_zero_var

# The update's per-micro-batch loss metrics logged as `loss/<key>` when the loss reports them.
_OPTIONAL_LOSS_KEYS = ("kl", "entropy", "is_weight_mean", "is_ratio_max", "is_frac_truncated",
                       "is_frac_masked")


def step_metrics(tr, rec) -> dict[str, Any]:
  cfg, b, g = tr.cfg, rec.batch, tr.cfg.group_size
  gen = b.info
  all_comps, all_rewards = gen.completions, gen.rewards  # every scored sample
  resp_lens = np.array([len(c.token_ids) for c in all_comps])
  gen_tokens = int(resp_lens.sum()) + sum(len(c.token_ids) for c in gen.pruned)
  if not cfg.arrol:
    all_groups = all_rewards.reshape(-1, g)
    frac_zero_var = float(np.mean(np.all(all_groups == all_groups[:, :1], axis=1)))
  else:
    frac_zero_var = _frac_zero_var(all_rewards, [c.request_id[0] for c in all_comps])
  upd = rec.update_metrics
  mean = lambda key: float(np.mean([float(m[key]) for m in upd]))
  t = rec.times
  out = {
      "reward/mean": float(all_rewards.mean()), "reward/std": float(all_rewards.std()),
      "reward/frac_zero_var_groups": frac_zero_var,
      # ARRoL's Table 4 statistics for every run: rho_hat = positive fraction of a group.
      **dict(zip(("reward/rho_hat_mean", "reward/rho_hat_var"), rec.rho_hat)),
      "reward/verifier_errors": gen.num_errors,
      "reward/verifier_timeouts": gen.num_timeouts,
      "response/len_mean": float(resp_lens.mean()), "response/len_max": int(resp_lens.max()),
      "response/clip_ratio": float(np.mean([c.finish_reason != "stop" for c in all_comps])),
      "loss/total": mean("loss"), "loss/policy": mean("pg_loss"),
      "loss/clip_frac_low": mean("clip_frac_low"), "loss/clip_frac_high": mean("clip_frac_high"),
      "loss/approx_kl": mean("approx_kl"), "grad_norm": mean("grad_norm"),
      "lr": float(tr.learner.lr_schedule(int(jax.device_get(tr.learner.opt_count(
          tr.state.opt_state))))),
      "time/rollout_s": t["rollout"], "time/reward_s": t["reward"],
      "time/recompute_s": t.get("recompute", 0.0), "time/update_s": t["update"],
      "rollout/tokens": gen_tokens,
      "rollout/tokens_per_s": gen_tokens / max(t["rollout"], 1e-9),
      **{f"rollout/{k}": v for k, v in gen.engine.items()},
      **gen.agent,  # turns, tool calls, errors, timeouts, env token share (agents/loop.py)
      "recompute/skipped": float(tr.learner.programs.skip_recompute),
      "compilations": tr.learner.programs.count.n + tr.rollout.num_compilations,
      "skipped_update": not rec.all_finite, "schedule": b.schedule.name,
  }
  if cfg.distill:
    out["time/distill_s"] = t["distill"]
  if cfg.exact_alpha_every:
    out["time/exact_alpha_s"] = t["exact_alpha"]
  if cfg.dynamic_sampling:
    out.update({"dynamic_sampling/rounds": gen.rounds,
                "dynamic_sampling/informative_groups": int((~b.zero_var).sum()),
                "dynamic_sampling/generated_groups": len(all_groups)})
  for key in _OPTIONAL_LOSS_KEYS:
    if key in upd[0]:
      out[f"loss/{key}"] = mean(key)
  # Rollout corrections report under `rollout_corr/*`: logged as the mean over updates.
  for key in upd[0]:
    if str(key).startswith("rollout_corr/"):
      out[key] = mean(key)
  return {**out, **rec.out}
