"""The learner's stages: each a function of (learner, training state, step record) that does
its own work on the record's typed batch and returns the new training state.

    prepare     the micro-batch plans of the step and their padding metrics; the share of
                tokens past the schedule's calibrated positions
    recompute   old dense log-probs + the monitor's dense top-k, and the KL reference's
                log-probs, micro-batched and sharded; the old log-probs are skipped when
                redundant (one optimizer step per rollout batch: the update's forward gives them)
    advantages  group-relative advantages (ragged groups once ARRoL pruned members) and the GRPO
                loss mask (the response mask less dynamic sampling's zero-variance groups)
    distill     DistillSparse (present with distill=true): LoRA-only update against the old
                dense log-probs, before the policy update, so teacher dense(theta_k) and student
                sparse(theta_k) + LoRA share the policy that generated the rollout
    update      GRPO: `ppo_epochs` passes of mini-batches, each a sum of micro-batch gradients
                with the mini-batch's loss denominators, then one guarded optimizer step

`learner_stages(cfg)` lists the stages a config runs; periodic side effects (monitor, exact
alpha, ladder, ARRoL's head, validation, checkpoints) are hooks (`run/hooks.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl import distill as distill_lib
from sparrow_jax.rl import grpo
from sparrow_jax.rl.advantages import compute_advantages
from sparrow_jax.run import distributed
from sparrow_jax.run import microbatch as mb_lib
from sparrow_jax.run.learner import Learner, StepRecord
from sparrow_jax.run.state import TrainState
from sparrow_jax.schedule.schedule import beyond_calibrated_frac, teacher_forced_budgets

_LOGPROB_KEYS = ("tokens", "lengths", "prompt_lens")


def prepare(ln: Learner, state: TrainState, rec: StepRecord) -> TrainState:
  b, cfg = rec.batch, ln.cfg
  lengths = b.lengths
  rec.logprob_plan = ln.logprob_plan(lengths)
  minis = [lengths[s:s + cfg.mini_batch] for s in range(0, len(lengths), cfg.mini_batch)]
  update_plan = [m for mini in minis for m in ln.update_plan(mini)]
  rec.out["batch/padding_frac"] = mb_lib.padding_frac(update_plan, np.concatenate(minis))
  rec.out["batch/logprob_padding_frac"] = mb_lib.padding_frac(rec.logprob_plan, lengths)
  rec.out["batch/micro_batches"] = len(update_plan)
  beyond = beyond_calibrated_frac(b.schedule, b.prompt_lens, lengths)
  if beyond is not None:
    rec.out["schedule/beyond_calibrated_frac"] = beyond
  return state


def dense_logprobs(ln: Learner, params, ref_params, arrays: dict, plan, *,
                   with_old: bool = True) -> dict[str, np.ndarray]:
  """The no-grad recompute of a batch's host arrays (tokens, lengths, prompt_lens),
  micro-batched by `plan`: {"old_logp", "dense_topk_ids", "dense_topk_logp"} of `params`
  (with `with_old`) and {"ref_logp"} of `ref_params` (when given), aligned with the tokens."""
  out = {}
  keys = tuple(k for k in _LOGPROB_KEYS if k in arrays)
  if with_old:
    # prompt_lens: the LM head runs over the responses' window only (run/programs.py)
    res = ln.run_micro(lambda mb: ln.programs.logprobs(params, mb), arrays, plan, keys=keys)
    out["old_logp"] = res["logp"]
    if "topk_ids" in res:
      out["dense_topk_ids"], out["dense_topk_logp"] = res["topk_ids"], res["topk_logp"]
  if ref_params is not None:
    out["ref_logp"] = ln.run_micro(lambda mb: ln.programs.ref_logprobs(ref_params, mb),
                                   arrays, plan, keys=keys)["logp"]
  return out


def recompute(ln: Learner, state: TrainState, rec: StepRecord) -> TrainState:
  b = rec.batch
  res = dense_logprobs(ln, state.params, state.ref_params, b.arrays(*_LOGPROB_KEYS),
                       rec.logprob_plan, with_old=not ln.programs.skip_recompute)
  for k, v in res.items():  # old_logp, dense_topk_ids / _logp, ref_logp
    setattr(b, k, v)
  return state


def advantages(ln: Learner, state: TrainState, rec: StepRecord) -> TrainState:
  cfg, b = ln.cfg, rec.batch
  g = cfg.group_size
  rec.rho_hat = arrol_lib.rho_hat_stats(b.rewards, b.group_ids)
  if not cfg.arrol:  # whole groups of G, contiguous
    adv = compute_advantages(cfg.adv_estimator, b.rewards, np.arange(b.rows) // g,
                             group_size=g, normalize_std=cfg.normalize_adv_std)
    groups = b.rewards.reshape(-1, g)
    b.zero_var = np.all(groups == groups[:, :1], axis=1)  # [prompts_per_step]
  else:  # groups of unequal size once ARRoL pruned some members
    adv = compute_advantages(cfg.adv_estimator, b.rewards, b.group_ids, group_size=None,
                             normalize_std=cfg.normalize_adv_std)
  b.advantages = np.asarray(adv, np.float32)
  loss_mask = b.mask.copy()  # [B, T]: the GRPO loss (the response mask: everything else)
  if cfg.dynamic_sampling:
    loss_mask *= np.repeat(~b.zero_var, g)[:, None]
  b.loss_mask = loss_mask
  return state


# --- DistillSparse -----------------------------------------------------------------------

def distill_grads(ln: Learner, state: TrainState, arrays: dict, plan, schedule):
  """DistillSparse's (loss, metrics, LoRA gradients) on a batch, summed over the
  micro-batches of `plan`, each divided by the batch's token count (= one piece)."""
  cfg, progs = ln.cfg, ln.programs
  keys = ["tokens", "mask", "old_logp", "prompt_lens", "lengths"]
  if cfg.distill_pg_coef > 0:  # the LoRA's own truncated-IS policy gradient
    keys += ["advantages", "rollout_logp"]
  m = np.asarray(arrays["mask"], np.float32).copy()
  m[:, 0] = 0.0
  den = {"num_tokens": jnp.float32(m.sum())}
  acc = progs.zeros(state.lora)
  losses, per_micro = [], []
  for micro in plan:
    inputs = mb_lib.gather(arrays, micro, keys)
    inputs["budgets"] = np.asarray(teacher_forced_budgets(schedule, micro.length, micro.rows))
    acc, loss, mm = progs.distill_grad(state.lora, acc, state.params, ln.place(inputs), den)
    losses.append(loss)
    per_micro.append(mm)
  metrics = distill_lib.combine_micro_metrics(distributed.fetch(per_micro))
  return jnp.sum(jnp.stack(losses)), metrics, acc


def distill(ln: Learner, state: TrainState, rec: StepRecord) -> TrainState:
  """One LoRA-only step on the step batch, micro-batched, teacher = the old dense log-probs,
  with the batch's token count as the loss denominator."""
  b = rec.batch
  loss, out, grads = distill_grads(ln, state, b.arrays(), rec.logprob_plan, b.schedule)
  lora, lora_opt, am = ln.programs.distill_apply(
      state.lora, state.lora_opt_state, grads, loss, jnp.float32(out["max_abs_gap"]))
  out.update({k: float(v) for k, v in distributed.fetch(am).items()})
  rec.out.update({f"distill/{k}": v for k, v in out.items()})
  return state.replace(lora=lora, lora_opt_state=lora_opt)


# --- GRPO update -------------------------------------------------------------------------

def mini_batch_grads(ln: Learner, params, arrays: dict[str, np.ndarray]):
  """(loss, metrics, grads, aux) of one mini-batch (host arrays: tokens, lengths, mask =
  the loss mask, advantages, [old_logp, rollout_logp, ref_logp]) as the sum of its
  micro-batches, each divided by the mini-batch's loss denominators (so the result equals
  the mini-batch in one piece). `aux`: with the recompute skipped, the forward's own old
  log-probs and dense top-k, as full host arrays."""
  progs, loss_cfg = ln.programs, ln.loss_cfg
  den = grpo.mini_batch_denominators(
      jnp.asarray(arrays["mask"]), loss_cfg,
      old_logp=None if "old_logp" not in arrays else jnp.asarray(arrays["old_logp"]),
      rollout_logp=(None if "rollout_logp" not in arrays
                    else jnp.asarray(arrays["rollout_logp"])))
  keys = [k for k in ("tokens", "lengths", "prompt_lens", "mask", "advantages", "old_logp",
                      "rollout_logp", "ref_logp") if k in arrays]
  if not loss_cfg.uses_rollout_correction:
    keys = [k for k in keys if k != "rollout_logp"]
  if progs.skip_recompute and loss_cfg.rollout_mode != "bypass":
    keys = [k for k in keys if k != "old_logp"]
  acc = progs.zeros(params)
  losses, per_micro, n_in, aux = [], [], [], {}
  b, t = np.shape(arrays["tokens"])[:2]
  for micro in ln.update_plan(arrays["lengths"]):
    inputs = ln.place(mb_lib.gather(arrays, micro, keys))
    acc, loss, m, n, a = progs.grad_step(params, acc, inputs, den)
    losses.append(loss)
    per_micro.append(m)
    n_in.append(n)
    if a:
      mb_lib.scatter(aux, micro, distributed.fetch(a), b, t)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_micro)
  metrics = grpo.combine_micro_metrics(stacked, jnp.stack(n_in))
  return jnp.sum(jnp.stack(losses)), metrics, acc, aux


def update_inputs(b, loss_cfg) -> dict[str, np.ndarray]:
  """The update's host arrays of a batch: `mask` is the GRPO loss mask; in bypass mode the
  PPO clip's old policy is the rollout actor (old_logp = rollout_logp)."""
  arrays = b.arrays("tokens", "lengths", "prompt_lens", "advantages", "old_logp",
                    "rollout_logp", "ref_logp")
  arrays["mask"] = b.loss_mask if b.loss_mask is not None else b.mask
  if loss_cfg.rollout_mode == "bypass":
    arrays["old_logp"] = b.rollout_logp
  return arrays


def apply_updates(ln: Learner, state: TrainState, full: dict[str, np.ndarray]):
  """`ppo_epochs` passes of mini-batch updates over a batch's update arrays (`update_inputs`)
  -> (state, per-update metrics, whether every update was finite, aux). `aux`: with the
  recompute skipped, the forward's own old log-probs and dense top-k (one mini-batch)."""
  cfg = ln.cfg
  n = full["tokens"].shape[0]
  metrics, all_finite, aux_all = [], True, {}
  params, opt_state = state.params, state.opt_state
  for _ in range(cfg.ppo_epochs):
    for s in range(0, n, cfg.mini_batch):
      sub = {k: v[s:s + cfg.mini_batch] for k, v in full.items()}
      loss, m, grads, aux = mini_batch_grads(ln, params, sub)
      params, opt_state, ok, gnorm = ln.programs.apply(params, opt_state, grads, loss)
      m = distributed.fetch(dict(m, loss=loss, grad_norm=gnorm, finite=ok))
      all_finite &= bool(m["finite"])
      metrics.append(m)
      aux_all.update(aux)
  return state.replace(params=params, opt_state=opt_state), metrics, all_finite, aux_all


def update(ln: Learner, state: TrainState, rec: StepRecord) -> TrainState:
  """The GRPO update of the batch. With the recompute skipped, the forward's own old
  log-probs and the monitor's dense top-k fill the batch's fields."""
  b = rec.batch
  state, rec.update_metrics, rec.all_finite, aux = apply_updates(ln, state,
                                                                 update_inputs(b, ln.loss_cfg))
  for k, v in aux.items():
    assert k in ("old_logp", "dense_topk_ids", "dense_topk_logp"), k  # typed fields only
    setattr(b, k, v)
  return state


def learner_stages(cfg) -> tuple:
  """(name, stage) of the learner for `cfg`: a feature adds its stage."""
  stages = [("batch", prepare), ("recompute", recompute), ("advantages", advantages)]
  if cfg.distill:
    stages.append(("distill", distill))
  stages.append(("update", update))
  return tuple(stages)
