"""One RL step as named stages over one step batch (the data path of DESIGN.md).

    generate    rollouts of the sparse actor (policy + LoRA), scored by the verifiers, with
                DAPO refill rounds; ARRoL's pruned rollouts leave here
    batch       the scored rollouts as host arrays [B, T] and the micro-batch plans; the
                engine's KV pool is released (the trainer gets its memory back)
    recompute   old dense log-probs + the monitor's dense top-k, and the KL reference's
                log-probs, micro-batched and sharded; skipped when it is redundant (one
                optimizer step per rollout batch: the update's own forward gives them)
    exact_alpha every `exact_alpha_every` steps: the exact alpha tail per position bin of the
                rollout actor vs the dense policy that sampled (teacher-forced, before the
                update changes either)
    advantages  group-relative advantages (ragged groups with ARRoL) and the GRPO loss mask
    distill     DistillSparse: LoRA-only update against the old dense log-probs, before the
                policy update, so teacher dense(theta_k) and student sparse(theta_k) + LoRA
                share the policy that generated the rollout (rl/distill.py)
    update      GRPO: `ppo_epochs` passes of mini-batches, each a sum of micro-batch gradients
                with the mini-batch's loss denominators, then one guarded optimizer step
    monitor     the top-k lower bound of alpha_t per position bin (rl/monitor.py)
    ladder      probe the next schedule of the ladder, switch after `ladder_patience` passes
    arrol       train ARRoL's quality head on this step's labelled detection states
    metrics     one flat dict for the logger

Each stage is `fn(trainer, sb)`: it reads and writes the `StepBatch` and uses the trainer's
programs, mesh and state. Wall time per stage goes to `time/<stage>_s` (`time/rollout_s` and
`time/reward_s` split the generate stage). Every phase that touches rollouts runs through
`run/microbatch.py`: micro-batches sorted by length, padded to their own length bucket and
placed sharded over the batch axes.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl import grpo
from sparrow_jax.rl.monitor import lower_bound_alpha
from sparrow_jax.rl.switching import alpha_tails_per_bin
from sparrow_jax.run import compile_clock
from sparrow_jax.run import microbatch as mb_lib
from sparrow_jax.run.builders import _frac_zero_var
from sparrow_jax.schedule.schedule import beyond_calibrated_frac


@dataclasses.dataclass
class StepBatch:
  """Everything one step knows about its rollouts, filled stage by stage.

  `arrays` (host, row j = `completions[j]`): tokens [B, T] int32, lengths [B], mask [B, T]
  (response tokens: monitor, DistillSparse, probe), prompt_lens [B], rollout_logp [B, T],
  rollout_topk_ids / rollout_topk_logp [B, T, k]; then old_logp [B, T], dense_topk_ids /
  dense_topk_logp [B, T, k], ref_logp [B, T] (recompute), advantages [B], loss_mask [B, T]
  (advantages: the dynamic-sampling mask on top of `mask`).
  """

  step: int
  schedule: str = ""  # the rollout's schedule (the ladder may switch at the end of a step)
  completions: list = dataclasses.field(default_factory=list)
  rewards: np.ndarray | None = None  # [B] of the trained completions
  gen: dict = dataclasses.field(default_factory=dict)  # generate's info (every completion)
  arrays: dict = dataclasses.field(default_factory=dict)
  group_ids: list = dataclasses.field(default_factory=list)
  zero_var: np.ndarray | None = None  # [groups] with fixed-size groups
  rho_hat: tuple = (0.0, 0.0)
  logprob_plan: list = dataclasses.field(default_factory=list)
  update_metrics: list = dataclasses.field(default_factory=list)
  all_finite: bool = True
  out: dict = dataclasses.field(default_factory=dict)  # metrics of every stage
  times: dict = dataclasses.field(default_factory=dict)
  exact_token_alpha: np.ndarray | None = None  # [rows, T] exact alpha of the first rows


# --- stages --------------------------------------------------------------------------------

def generate(tr, sb: StepBatch) -> None:
  sb.schedule = tr.schedule.name
  sb.completions, sb.rewards, sb.gen = tr.generate_groups(sb.step)
  sb.times["rollout"], sb.times["reward"] = sb.gen["rollout_s"], sb.gen["reward_s"]
  sb.group_ids = [c.request_id[0] for c in sb.completions]


def batch(tr, sb: StepBatch) -> None:
  sb.arrays = tr.make_batch(sb.completions)
  tr.engine_release()
  lengths = sb.arrays["lengths"]
  sb.logprob_plan = tr.logprob_plan(lengths)
  update_plan = [m for s in range(0, len(lengths), tr.cfg.mini_batch)
                 for m in tr.update_plan(lengths[s:s + tr.cfg.mini_batch])]
  sb.out["batch/padding_frac"] = mb_lib.padding_frac(
      update_plan, np.concatenate([lengths[s:s + tr.cfg.mini_batch]
                                   for s in range(0, len(lengths), tr.cfg.mini_batch)]))
  sb.out["batch/logprob_padding_frac"] = mb_lib.padding_frac(sb.logprob_plan, lengths)
  sb.out["batch/micro_batches"] = len(update_plan)
  # The rollout's schedule (the ladder switches only after this step's update).
  beyond = beyond_calibrated_frac(tr.schedule, sb.arrays["prompt_lens"], lengths)
  if beyond is not None:
    sb.out["schedule/beyond_calibrated_frac"] = beyond


def recompute(tr, sb: StepBatch) -> None:
  a = sb.arrays
  if not tr.programs.skip_recompute:
    # prompt_lens: the LM head runs over the responses' window only (run/programs.py)
    res = tr.run_micro(lambda mb: tr.programs.logprobs(tr.params, mb), a, sb.logprob_plan,
                       keys=("tokens", "lengths", "prompt_lens"))
    a["old_logp"] = res["logp"]
    if "topk_ids" in res:
      a["dense_topk_ids"], a["dense_topk_logp"] = res["topk_ids"], res["topk_logp"]
  if tr.ref_params is not None:
    res = tr.run_micro(lambda mb: tr.programs.ref_logprobs(tr.ref_params, mb), a,
                       sb.logprob_plan, keys=("tokens", "lengths", "prompt_lens"))
    a["ref_logp"] = res["logp"]


def exact_alpha(tr, sb: StepBatch) -> None:
  every = tr.cfg.exact_alpha_every
  if every and sb.step % every == 0:
    out, sb.exact_token_alpha = tr.exact_alpha(sb.arrays)
    sb.out.update(out)


def advantages(tr, sb: StepBatch) -> None:
  cfg, a = tr.cfg, sb.arrays
  g = cfg.group_size
  sb.rho_hat = arrol_lib.rho_hat_stats(sb.rewards, sb.group_ids)
  if tr.arrol is None:
    adv = np.asarray(grpo.group_advantages(jnp.asarray(sb.rewards), g,
                                           normalize_std=cfg.normalize_adv_std))
    groups = sb.rewards.reshape(-1, g)
    sb.zero_var = np.all(groups == groups[:, :1], axis=1)  # [prompts_per_step]
  else:  # groups of unequal size once ARRoL pruned some members
    adv = grpo.ragged_group_advantages(sb.rewards, sb.group_ids,
                                       normalize_std=cfg.normalize_adv_std)
  a["advantages"] = np.asarray(adv, np.float32)
  loss_mask = a["mask"].copy()  # [B, T]: the GRPO loss (response mask: everything else)
  if cfg.dynamic_sampling:
    loss_mask *= np.repeat(~sb.zero_var, g)[:, None]
  a["loss_mask"] = loss_mask


def distill(tr, sb: StepBatch) -> None:
  if not tr.cfg.distill:
    return
  sb.out.update(tr.distill_update(sb.arrays, sb.logprob_plan))


def update(tr, sb: StepBatch) -> None:
  sb.update_metrics, sb.all_finite = tr.apply_updates(sb.arrays)
  tr.engine.set_state(tr.params)


def monitor(tr, sb: StepBatch) -> None:
  """Top-k lower bound of alpha between the sparse actor (top-k kept during rollout) and the
  dense policy (recompute, or the update's own forward), both at the rollout temperature (the
  engine keeps its top-k under softmax(logits / T) of each request)."""
  a = sb.arrays
  if "old_logp" in a:
    sb.out.update(rollout_is_stats(a["old_logp"], a["rollout_logp"], a["mask"],
                                   cap=tr.loss_cfg.tis_cap))
  if "dense_topk_ids" not in a:
    return
  sb.out.update(tr.monitor.update(a["rollout_topk_ids"], a["rollout_topk_logp"],
                                  a["dense_topk_ids"], a["dense_topk_logp"], a["mask"],
                                  step=sb.step))
  if sb.exact_token_alpha is not None:
    sb.out.update(bound_vs_exact(a, sb.exact_token_alpha, tr.cfg.mismatch_bin_size))


def rollout_is_stats(old_logp, rollout_logp, mask, cap: float | None = None
                     ) -> dict[str, float]:
  """Importance ratios rho_t = pi_dense(y_t) / q_actor(y_t) = exp(old_logp - rollout_logp) of
  the sampled tokens (`mask`: response tokens), logged every step whether or not the loss
  corrects with them (TIS is on when `tis_cap` is set): mean (1 in expectation under q),
  5th / 95th percentile, min, max, the fraction above the TIS cap C (`cap`, or 2 when TIS is
  off: what a cap of 2 would truncate) and KL(q || pi) by the k3 estimate E_q[rho - 1 - log rho]
  (non-negative token by token, lower variance than E_q[-log rho])."""
  m = np.asarray(mask) > 0
  if not m.any():
    return {}
  log_rho = (np.asarray(old_logp, np.float64) - np.asarray(rollout_logp, np.float64))[m]
  rho = np.exp(log_rho)
  c = 2.0 if cap is None else float(cap)
  p5, p95 = np.percentile(rho, [5, 95])
  return {"tis/ratio_mean": float(rho.mean()), "tis/ratio_p5": float(p5),
          "tis/ratio_p95": float(p95), "tis/ratio_min": float(rho.min()),
          "tis/ratio_max": float(rho.max()), "tis/frac_above_cap": float(np.mean(rho > c)),
          "tis/kl_rollout_vs_policy": float(np.mean(rho - 1 - log_rho))}


def bound_vs_exact(a, exact, bin_size: int) -> dict[str, float]:
  """The monitor's top-k bound on exactly the rows (and tokens) exact alpha was computed on:
  its tail per bin as `mismatch/exact_p5` takes it (`mismatch/bound_p5_exact_rows`, min over
  bins), the mean gap exact - bound and the fraction of tokens where the bound exceeds the
  exact value by more than float32 noise (a lower bound never should: a live check of both)."""
  rows = exact.shape[0]
  bound = lower_bound_alpha(a["rollout_topk_ids"][:rows], a["rollout_topk_logp"][:rows],
                            a["dense_topk_ids"][:rows], a["dense_topk_logp"][:rows])
  m = np.array(a["mask"][:rows]) > 0
  m[:, 0] = False
  tails = alpha_tails_per_bin(bound, m, bin_size=bin_size)
  if not tails:
    return {}
  gap = exact[m] - bound[m]
  return {"mismatch/bound_p5_exact_rows": min(v for v, _ in tails.values()),
          "mismatch/exact_bound_gap": float(np.mean(gap)),
          "mismatch/bound_above_exact_frac": float(np.mean(gap < -1e-3))}


def ladder(tr, sb: StepBatch) -> None:
  sb.out.update(tr.maybe_switch(sb.step, sb.arrays, sb.logprob_plan))


def arrol(tr, sb: StepBatch) -> None:
  sb.out.update(tr.arrol_update(sb.completions, sb.rewards, sb.gen["pruned"], sb.rho_hat))


def metrics(tr, sb: StepBatch) -> None:
  cfg, gen, g = tr.cfg, sb.gen, tr.cfg.group_size
  all_comps, all_rewards = gen["completions"], gen["rewards"]  # every scored sample
  resp_lens = np.array([len(c.token_ids) for c in all_comps])
  gen_tokens = int(resp_lens.sum()) + sum(len(c.token_ids) for c in gen["pruned"])
  if tr.arrol is None:
    all_groups = all_rewards.reshape(-1, g)
    frac_zero_var = float(np.mean(np.all(all_groups == all_groups[:, :1], axis=1)))
  else:
    frac_zero_var = _frac_zero_var(all_rewards, [c.request_id[0] for c in all_comps])
  upd = sb.update_metrics
  mean = lambda key: float(np.mean([float(m[key]) for m in upd]))
  t = sb.times
  out = {
      "reward/mean": float(all_rewards.mean()), "reward/std": float(all_rewards.std()),
      "reward/frac_zero_var_groups": frac_zero_var,
      # ARRoL's Table 4 statistics for every run: rho_hat = positive fraction of a group.
      **dict(zip(("reward/rho_hat_mean", "reward/rho_hat_var"), sb.rho_hat)),
      "reward/verifier_errors": gen["num_errors"],
      "reward/verifier_timeouts": gen["num_timeouts"],
      "response/len_mean": float(resp_lens.mean()), "response/len_max": int(resp_lens.max()),
      "response/clip_ratio": float(np.mean([c.finish_reason != "stop" for c in all_comps])),
      "loss/total": mean("loss"), "loss/policy": mean("pg_loss"),
      "loss/clip_frac_low": mean("clip_frac_low"), "loss/clip_frac_high": mean("clip_frac_high"),
      "loss/approx_kl": mean("approx_kl"), "grad_norm": mean("grad_norm"),
      "lr": float(tr.lr_schedule(int(jax.device_get(tr.opt_count())))),
      "time/rollout_s": t["rollout"], "time/reward_s": t["reward"],
      "time/recompute_s": t.get("recompute", 0.0), "time/update_s": t["update"],
      "rollout/tokens": gen_tokens,
      "rollout/tokens_per_s": gen_tokens / max(t["rollout"], 1e-9),
      **{f"rollout/{k}": v for k, v in gen["engine"].items()},
      "recompute/skipped": float(tr.programs.skip_recompute),
      "compilations": tr.programs.count.n + tr.engine.num_compilations,
      "skipped_update": not sb.all_finite, "schedule": sb.schedule,
  }
  if cfg.distill:
    out["time/distill_s"] = t["distill"]
  if cfg.exact_alpha_every:
    out["time/exact_alpha_s"] = t["exact_alpha"]
  if cfg.dynamic_sampling:
    out.update({"dynamic_sampling/rounds": gen["rounds"],
                "dynamic_sampling/informative_groups": int((~sb.zero_var).sum()),
                "dynamic_sampling/generated_groups": len(all_groups)})
  for key in ("kl", "entropy", "is_weight_mean", "is_ratio_max", "is_frac_truncated",
              "is_frac_masked"):
    if key in upd[0]:
      out[f"loss/{key}"] = mean(key)
  sb.out = {**out, **sb.out}


PIPELINE = (("generate", generate), ("batch", batch), ("recompute", recompute),
            ("exact_alpha", exact_alpha), ("advantages", advantages), ("distill", distill), ("update", update),
            ("monitor", monitor), ("ladder", ladder), ("arrol", arrol), ("metrics", metrics))


def run_step(tr, step: int, pipeline=None) -> StepBatch:
  """Run every stage of `pipeline` (default `PIPELINE`; a profiler passes it with its stages
  wrapped) on a fresh step batch; returns it (metrics in `.out`)."""
  sb = StepBatch(step=step)
  c0 = compile_clock.seconds()
  t0 = time.perf_counter()
  for name, stage in (PIPELINE if pipeline is None else pipeline):
    t1 = time.perf_counter()
    stage(tr, sb)
    sb.times.setdefault(name, time.perf_counter() - t1)
  sb.out["time/step_s"] = time.perf_counter() - t0
  # Part of the phase times above that was compilation (lowering + XLA), in any phase.
  sb.out["time/compile_s"] = compile_clock.seconds() - c0
  return sb
