"""Hooks: what runs beside the learner's stages, each with an `every` (levanter's
`add_hook(fn, every=N)` is the model). A feature that is off has no hook.

    exact_alpha   before the update, every `exact_alpha_every` steps: the exact tail of alpha_t
                  per position bin of the actor that generated the batch (its schedule and LoRA)
                  against the dense policy that sampled, teacher-forced on the first
                  `exact_alpha_rows` rollouts; the replay check of the actor's log-probs
    monitor       after the update, every step: importance ratios of the sampled tokens, the
                  top-k lower bound of alpha_t per position bin (rl/monitor.py), the bound
                  against the exact values on the rows that have them
    ladder_probe  before the update, asynchronous training only: the next schedule's tail
                  split into sparsity and total, each token at its own version
    ladder        after the update: probe the next schedule, switch after `ladder_patience`
                  (asynchronous: decide on the total `ladder_probe` measured)
    arrol         after the update: train ARRoL's quality head on the step's labelled rollouts

A hook is `fn(trainer, rec) -> metrics` (`rec`: the step's `StepRecord`); its metrics join the
step's record. The training loop's own periodic work (validation, samples, checkpoints) is in
`run/loop.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl.monitor import lower_bound_alpha, replay_diff, replay_stats
from sparrow_jax.rl.switching import alpha_tail, alpha_tails_per_bin


@dataclasses.dataclass(frozen=True)
class Hook:
  name: str
  fn: Callable  # (trainer, rec) -> dict of metrics
  every: int = 1  # steps between runs (the step number a multiple of it)
  point: str = "after_update"  # before_update | after_update

  def due(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0


# --- exact alpha -------------------------------------------------------------------------

def exact_alpha(tr, rec) -> dict[str, float]:
  """The exact tail of alpha_t per position bin of the rollout actor (the batch's schedule,
  with its LoRA) against the dense policy that generated the rollouts, teacher-forced on the
  first `exact_alpha_rows` rollouts of the step (all with 0), over their response tokens:
  what the monitor's top-k statistic bounds from below.

  The same forward replays the sparse actor on the tokens it sampled: where sampling was
  unfiltered (top_p = 1, top_k = 0) its log-prob of each sampled token must equal the one the
  engine recorded (`rollout_logp`) up to float rounding, or exact alpha would not be of the
  actor that generated the batch. `mismatch/replay_logp_maxdiff` is the largest difference,
  `mismatch/replay_frac_off` the fraction of tokens off by more than 1e-3 and
  `mismatch/replay_rows_off` the rows holding any (a page selection flipped by rounding on
  near-tied landmark scores changes that token and, through its K/V, later ones).
  Sets `rec.exact_token_alpha` [rows, T] (None for a dense schedule)."""
  cfg, b = tr.cfg, rec.batch
  if b.schedule is None or b.schedule.is_dense:
    return {}
  rows = b.rows if not cfg.exact_alpha_rows else min(cfg.exact_alpha_rows, b.rows)
  sub = {k: v[:rows] for k, v in b.arrays("tokens", "prompt_lens", "lengths", "mask").items()}
  replay = cfg.samples_unfiltered
  res = tr.learner.token_alpha(tr.state.params, sub, b.schedule, b.lora, with_logp=replay)
  alpha, logp = res if replay else (res, None)
  tails = alpha_tails_per_bin(alpha, sub["mask"], bin_size=cfg.mismatch_bin_size)
  out: dict[str, float] = {"mismatch/exact_rows": float(rows)}
  if replay:
    diff = replay_diff(logp, b.rollout_logp[:rows], sub["mask"])
    out.update(replay_stats(diff, sub["mask"]))
  if tails:
    out["mismatch/exact_p5"] = min(v for v, _ in tails.values())
    out["mismatch/exact_bins_below_tau"] = float(sum(v < cfg.tau for v, _ in tails.values()))
  for k, (v, c) in tails.items():
    out[f"mismatch/exact_p5_bin_{k}"] = v
    out[f"mismatch/exact_count_bin_{k}"] = float(c)
  out.update(alpha_split(tr, b, sub, np.asarray(alpha)))
  rec.exact_token_alpha = np.asarray(alpha)
  return out


def alpha_split(tr, b, sub: dict, alpha: np.ndarray) -> dict[str, float]:
  """The mismatch tail split into its two sources (asynchronous training): for each token
  sampled by policy version v, alpha of the sparse actor of version v (its weights and LoRA,
  teacher-forced on the row) against the dense policy of the same version v
  (`mismatch/p5_sparsity`: what sparse attention costs) and against the learner's current
  dense policy (`mismatch/p5_total`: sparsity and staleness together), each the lowest
  per-bin p5 as `mismatch/exact_p5`. Tokens of the current version take `alpha` (the
  existing exact alpha) for both, so with no stale token both equal `mismatch/exact_p5`.
  Older versions' weights come from `tr.policy_history` (kept with max_staleness > 0 and
  exact alpha on); a version missing there is left out (`mismatch/split_missing_tokens`)."""
  sparsity, total, keep = versioned_alpha(tr, b, sub, alpha, b.schedule)
  m = sub["mask"] > 0
  out = {"mismatch/split_missing_tokens": float((m & ~keep).sum())}
  for name, a in (("sparsity", sparsity), ("total", total)):
    tails = alpha_tails_per_bin(a, keep.astype(np.float32), bin_size=tr.cfg.mismatch_bin_size)
    if tails:
      out[f"mismatch/p5_{name}"] = min(v for v, _ in tails.values())
  return out


def versioned_alpha(tr, b, sub: dict, alpha: np.ndarray, schedule
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(sparsity, total, keep) [rows, T] of the sparse actor under `schedule`, each token at
  the policy version that sampled it: `alpha` (that schedule's actor of the current version
  against the current dense policy) where the token is of the current version; else the
  actor of version v (weights and LoRA from `tr.policy_history`) against the dense policy of
  v (sparsity) and against the learner's current one (total). `keep`: the response tokens
  whose version is current or kept (`alpha_split`)."""
  now = tr.state.policy_version
  rows = alpha.shape[0]
  m = sub["mask"] > 0
  versions = np.asarray(b.versions[:rows])
  sparsity, total, keep = alpha.copy(), alpha.copy(), m.copy()
  for v in np.unique(versions[m]):
    if int(v) == now:
      continue
    sel = m & (versions == v)
    old = getattr(tr, "policy_history", {}).get(int(v))
    if old is None:
      keep &= ~sel
      continue
    params_v, lora_v = old
    a_s = tr.learner.token_alpha(params_v, sub, schedule, lora_v)
    a_t = tr.learner.token_alpha(params_v, sub, schedule, lora_v, dense_params=tr.state.params)
    sparsity[sel], total[sel] = np.asarray(a_s)[sel], np.asarray(a_t)[sel]
  return sparsity, total, keep


def remember_policy(tr) -> None:
  """Keep a copy of the policy (and actor LoRA) about to be updated, by version, for the
  alpha split of the next `max_staleness` steps (the update donates the parameters)."""
  v, keep = tr.state.policy_version, tr.cfg.max_staleness
  copy = lambda t: None if t is None else jax.tree.map(jnp.copy, t)
  tr.policy_history[v] = (copy(tr.state.params), copy(tr._actor_lora()))
  for old in [k for k in tr.policy_history if k < v + 1 - keep]:
    del tr.policy_history[old]


# --- monitor -----------------------------------------------------------------------------

def monitor(tr, rec) -> dict[str, float]:
  """Top-k lower bound of alpha between the sparse actor (top-k kept during rollout) and the
  dense policy (recompute, or the update's own forward), both at the rollout temperature (the
  engine keeps its top-k under softmax(logits / T) of each request)."""
  b, out = rec.batch, {}
  if b.old_logp is not None:
    out.update(rollout_is_stats(b.old_logp, b.rollout_logp, b.mask,
                                cap=tr.learner.loss_cfg.tis_cap))
  if b.dense_topk_ids is None:
    return out
  out.update(tr.monitor.update(b.rollout_topk_ids, b.rollout_topk_logp, b.dense_topk_ids,
                               b.dense_topk_logp, b.mask, step=rec.step))
  if rec.exact_token_alpha is not None:
    out.update(bound_vs_exact(b, rec.exact_token_alpha, tr.cfg.mismatch_bin_size))
  return out


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


def bound_vs_exact(b, exact, bin_size: int) -> dict[str, float]:
  """The monitor's top-k bound on exactly the rows (and tokens) exact alpha was computed on:
  its tail per bin as `mismatch/exact_p5` takes it (`mismatch/bound_p5_exact_rows`, min over
  bins), the mean gap exact - bound and the fraction of tokens where the bound exceeds the
  exact value by more than float32 noise (a lower bound never should: a live check of both)."""
  rows = exact.shape[0]
  bound = lower_bound_alpha(b.rollout_topk_ids[:rows], b.rollout_topk_logp[:rows],
                            b.dense_topk_ids[:rows], b.dense_topk_logp[:rows])
  m = np.array(b.mask[:rows]) > 0
  m[:, 0] = False
  tails = alpha_tails_per_bin(bound, m, bin_size=bin_size)
  if not tails:
    return {}
  gap = exact[m] - bound[m]
  return {"mismatch/bound_p5_exact_rows": min(v for v, _ in tails.values()),
          "mismatch/exact_bound_gap": float(np.mean(gap)),
          "mismatch/bound_above_exact_frac": float(np.mean(gap < -1e-3))}


# --- schedule ladder ---------------------------------------------------------------------

def ladder(tr, rec) -> dict[str, float]:
  """Probe the next, more aggressive schedule (with the current LoRA) on this step's whole
  rollout batch, over its response tokens; switch after `ladder_patience` consecutive probes
  with tail alpha >= tau. Position bins with fewer than `probe_min_count` tokens do not count;
  when none qualifies the probe is skipped (`ladder/probe_skipped`).

  Asynchronous training (max_staleness > 0): the tail the ladder acts on is the candidate's
  *total* mismatch, measured before the update by `ladder_probe` (each token's actor of the
  version that sampled it against the learner's dense policy at the step's start), not its
  sparsity share alone: a candidate that would pass on a fresh policy but not once staleness
  adds its share is not taken."""
  lad, step = tr.ladder, rec.step
  if lad.candidate is None or not lad.should_probe(step):
    return dict(lad.metrics())
  cfg, b = tr.cfg, rec.batch
  if cfg.max_staleness:
    tail = rec.out.get("ladder/probe_tail_total", float("nan"))
  else:
    tail = tr.learner.tail_alpha(tr.state.params,
                                 b.arrays("tokens", "lengths", "prompt_lens"), lad.candidate,
                                 tr.state.lora, b.mask, rec.logprob_plan or None,
                                 bin_size=cfg.mismatch_bin_size, min_count=cfg.probe_min_count)
  if not np.isfinite(tail):
    return dict(lad.metrics(), **{"ladder/probe_skipped": 1.0})
  candidate = lad.candidate
  if lad.observe(tail, step=step):
    tr.switch_schedule(lad.current)
    print(f"step {step}: switched schedule to {candidate.name} (probe tail alpha "
          f"{tail:.3f} >= tau {cfg.tau} for {cfg.ladder_patience} checks)", flush=True)
  return dict(lad.metrics(), **{"ladder/probe_tail_alpha": tail, "ladder/probe_skipped": 0.0})


def ladder_probe(tr, rec) -> dict[str, float]:
  """Before the update, under asynchronous training: the ladder's candidate schedule probed
  on the whole batch as `alpha_split` splits exact alpha: its sparsity share (each token's
  actor of version v against the dense policy of v) and its total (against the learner's
  dense policy at the step's start), each the lowest per-bin p5 over bins with at least
  `probe_min_count` tokens. `ladder` decides on the total."""
  lad, step = tr.ladder, rec.step
  if lad.candidate is None or not lad.should_probe(step):
    return {}
  cfg, b = tr.cfg, rec.batch
  sub = b.arrays("tokens", "prompt_lens", "lengths", "mask")
  now = tr.learner.token_alpha(tr.state.params, sub, lad.candidate, tr.state.lora,
                               rec.logprob_plan or None)
  sparsity, total, keep = versioned_alpha(tr, b, sub, np.asarray(now), lad.candidate)
  kw = dict(bin_size=cfg.mismatch_bin_size, min_count=cfg.probe_min_count)
  mask = keep.astype(np.float32)
  return {"ladder/probe_tail_sparsity": alpha_tail(sparsity, mask, **kw),
          "ladder/probe_tail_total": alpha_tail(total, mask, **kw)}


# --- ARRoL's quality head ----------------------------------------------------------------

def arrol_head(tr, rec) -> dict[str, float]:
  """Train the quality head on this step's labelled rollouts (label: reward > 0) and report
  ARRoL's metrics (paper Tables 4/5): kept fraction, E[rho_hat], E[rho_hat (1 - rho_hat)]
  over groups, head accuracy and AUC (scores taken before the update: held out)."""
  b, pruner = rec.batch, tr.arrol
  comps, pruned = b.completions, b.info.pruned
  n_kept, n_all = len(comps), len(comps) + len(pruned)
  # A rollout that ended at its first token (sampled by the prefill) never reached a
  # decode step: it has no hidden state to learn from.
  seen = [j for j, c in enumerate(comps) if c.detect_hidden is not None]
  hidden = np.stack([comps[j].detect_hidden for j in seen]).astype(np.float32).reshape(
      len(seen), tr.model_cfg.hidden_size)  # [N, D]
  labels = (np.asarray(b.rewards)[seen] > 0).astype(np.float32)
  head = pruner.train(hidden, labels)
  rho_mean, rho_var = rec.rho_hat
  out = {"arrol/kept_frac": n_kept / max(n_all, 1), "arrol/pruned": n_all - n_kept,
         "arrol/rho_hat_mean": rho_mean, "arrol/rho_hat_var": rho_var,
         "arrol/head_acc": head["acc"], "arrol/head_auc": head["auc"],
         "arrol/head_loss": head["loss"], "arrol/warmup": float(pruner.warming_up)}
  if b.info.prune_hook is not None:
    out.update(b.info.prune_hook.metrics())
  pruner.end_step()
  return out


def step_hooks(cfg, *, ladder_on: bool, arrol_on: bool) -> tuple[Hook, ...]:
  """The hooks a config runs, in order."""
  hooks = []
  if cfg.exact_alpha_every:
    hooks.append(Hook("exact_alpha", exact_alpha, every=cfg.exact_alpha_every,
                      point="before_update"))
  if ladder_on and cfg.max_staleness:  # (the total needs each token's version's actor)
    hooks.append(Hook("ladder_probe", ladder_probe, point="before_update"))
  hooks.append(Hook("monitor", monitor))
  if ladder_on:
    hooks.append(Hook("ladder", ladder))
  if arrol_on:
    hooks.append(Hook("arrol", arrol_head))
  return tuple(hooks)
