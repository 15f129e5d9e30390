"""Schedule switching (paper §4.5.1, made automatic): a ladder of ever more aggressive schedules.

DistillSparse lets a sparser schedule meet the same tail threshold; the paper switched from the
0.86 table to the 0.80 table by hand after 20K examples, once the 0.80 table's p5 acceptance
reached ~0.86. `ScheduleLadder` does this online: every `probe_every` steps the trainer
measures the tail alpha of the *next* schedule (the candidate) with the current LoRA on the
step's whole rollout batch (`probe_tail_alpha` over the response tokens; position bins need
`probe_min_count` tokens, and a probe in which no bin qualifies is skipped), and calls
`observe(tail)`; when the tail stays >= tau for
`patience` (M) consecutive checks the ladder switches to the candidate. A check below tau
resets the streak. The ladder only moves forward.

  tau            the tail target (p5 of alpha_t >= tau), 0.86 in the paper.
  M (patience)   consecutive passing checks required to switch.
  probe tail     the 5th percentile of exact alpha_t = sum_v min(p_t(v), q_t(v)) between the
                 dense policy p and the sparse actor q (+ LoRA) under the candidate schedule,
                 over the probe batch's response tokens (or, with `bin_size`, the minimum
                 per-bin p5 over bins with at least `min_count` tokens).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.rl.logprobs import time_chunk
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets
from sparrow_jax.schedule import mismatch
from sparrow_jax.schedule.schedule import attention_spec, SparsitySchedule, max_budget

logger = logging.getLogger(__name__)


class ScheduleLadder:
  """Schedules from the current (least sparse) to the most aggressive; see the module doc."""

  def __init__(self, schedules: Sequence[SparsitySchedule], *, tau: float, patience: int = 3,
               probe_every: int = 5):
    schedules = list(schedules)
    if not schedules:
      raise ValueError("ScheduleLadder.schedules=[]: expected at least one SparsitySchedule")
    for i, s in enumerate(schedules):
      if not isinstance(s, SparsitySchedule):
        raise ValueError(f"ScheduleLadder.schedules[{i}]={s!r}: expected a SparsitySchedule")
    names = [s.name for s in schedules]
    if len(set(names)) != len(names):
      raise ValueError(f"ScheduleLadder.schedules names {names}: expected distinct names")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
      raise ValueError(f"ScheduleLadder.tau={tau!r}: expected a float in (0, 1]")
    for f, v in (("patience", patience), ("probe_every", probe_every)):
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"ScheduleLadder.{f}={v!r}: expected a positive int")
    self.schedules = schedules
    self.tau = float(tau)
    self.patience = patience
    self.probe_every = probe_every
    self.index = 0
    self.streak = 0
    self.checks = 0
    self.history: list[dict[str, Any]] = []  # one entry per switch

  @property
  def current(self) -> SparsitySchedule:
    return self.schedules[self.index]

  @property
  def candidate(self) -> SparsitySchedule | None:
    """The next, more aggressive schedule (None at the top of the ladder)."""
    return self.schedules[self.index + 1] if self.index + 1 < len(self.schedules) else None

  def should_probe(self, step: int) -> bool:
    """True on steps where the trainer should measure the candidate (never at the top)."""
    return self.candidate is not None and step > 0 and step % self.probe_every == 0

  def observe(self, probe_tail_alpha: float, *, step: int | None = None) -> bool:
    """Record one check of the candidate's tail; returns True if the ladder switched."""
    if self.candidate is None:
      return False
    tail = float(probe_tail_alpha)
    if not np.isfinite(tail):
      raise ValueError(f"ScheduleLadder.observe: probe_tail_alpha={probe_tail_alpha!r}: "
                       "expected a finite float")
    self.checks += 1
    self.streak = self.streak + 1 if tail >= self.tau else 0
    if self.streak < self.patience:
      return False
    old, new = self.current, self.candidate
    self.index += 1
    self.streak = 0
    self.history.append({"step": step, "check": self.checks, "from": old.name, "to": new.name,
                         "tail": tail})
    logger.warning("schedule ladder: switched %s -> %s%s (candidate tail %.4f >= tau %.3f "
                   "for %d consecutive checks)", old.name, new.name,
                   "" if step is None else f" at step {step}", tail, self.tau, self.patience)
    return True

  def metrics(self) -> dict[str, float]:
    return {"ladder/index": float(self.index), "ladder/streak": float(self.streak),
            "ladder/checks": float(self.checks), "ladder/switches": float(len(self.history))}

  # --- checkpoints ----------------------------------------------------------------------
  def state_dict(self) -> dict[str, Any]:
    return {"names": [s.name for s in self.schedules], "index": self.index,
            "streak": self.streak, "checks": self.checks,
            "history": [dict(h) for h in self.history]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    names = [s.name for s in self.schedules]
    if list(state.get("names", [])) != names:
      raise ValueError(f"ScheduleLadder.load_state_dict: names {state.get('names')!r}: "
                       f"expected this ladder's schedules {names}")
    index, streak = int(state["index"]), int(state["streak"])
    if not 0 <= index < len(names) or not 0 <= streak < self.patience:
      raise ValueError(f"ScheduleLadder.load_state_dict: index={index}, streak={streak}: "
                       f"expected 0 <= index < {len(names)} and 0 <= streak < {self.patience}")
    self.index, self.streak = index, streak
    self.checks = int(state.get("checks", 0))
    self.history = [dict(h) for h in state.get("history", [])]


# --- probing -------------------------------------------------------------------------------

def attention_for(schedule: SparsitySchedule, max_position: int,
                  **overrides) -> attn_lib.BlockSparse:
  """The BlockSparse spec a schedule implies for sequences up to `max_position` tokens."""
  if schedule.is_dense:
    raise ValueError(f"schedule {schedule.name!r} is dense: expected a sparse schedule to probe")
  return attention_spec(schedule, max_position=max_position, **overrides)


@functools.partial(jax.jit, static_argnames=("graphdef", "attention", "chunk", "with_logp"))
def _probe_alpha(graphdef, state, lora, tokens, budgets, prompt_lengths, lengths, temperature,
                 *, attention, chunk, with_logp=False, dense_state=None):
  """alpha [B, T] (and with `with_logp` the sparse actor's log-prob of every token at the
  temperature, [B, T]), both aligned with tokens: entry t is of token t, entry 0 is 0.
  `dense_state`: the dense side's weights when they differ from the sparse actor's (an older
  actor against the learner's current policy); None = `state`."""
  model = nnx.merge(graphdef, state)
  dense_model = model if dense_state is None else nnx.merge(graphdef, dense_state)
  dense = dense_model.hidden_states(tokens, lengths=lengths)  # [B, T, D]
  sparse = model.hidden_states(tokens, lengths=lengths, attention=attention, budgets=budgets,
                               prompt_lengths=prompt_lengths, lora=lora)  # [B, T, D]
  b, t, d = dense.shape
  # The LM head runs about `chunk` tokens (rows x positions) at a time, so [B, T, V] logits
  # never exist.
  chunk = time_chunk(chunk, b, t)
  nc = -(-t // chunk)
  split = lambda h: jnp.pad(h, ((0, 0), (0, nc * chunk - t), (0, 0))).reshape(
      b, nc, chunk, d).swapaxes(0, 1)  # [nc, B, chunk, D]

  xs = (split(dense), split(sparse))
  if with_logp:  # the token each position predicts (the last position's is a dummy 0)
    nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, nc * chunk - t + 1)))
    xs += (nxt.reshape(b, nc, chunk).swapaxes(0, 1),)  # [nc, B, chunk]

  def one(args):
    ls = model.logits(args[1]) / temperature  # [B, chunk, V]
    alpha = mismatch.acceptance_rate(dense_model.logits(args[0]) / temperature,
                                     ls)  # [B, chunk]
    if not with_logp:
      return alpha
    lse = jax.nn.logsumexp(ls.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(ls, args[2][..., None], axis=-1)[..., 0].astype(jnp.float32)
    return alpha, picked - lse

  # Token t is predicted by the logits at t - 1: the value of token t is at index t.
  unsplit = lambda x: jnp.pad(x.swapaxes(0, 1).reshape(b, nc * chunk)[:, :t - 1],
                              ((0, 0), (1, 0)))  # [B, T]
  return jax.tree.map(unsplit, jax.lax.map(one, xs))  # [B, T] (a pair with `with_logp`)


def probe_alpha(graphdef, state, lora, tokens, schedule: SparsitySchedule, *,
                prompt_lengths=None, lengths=None, attention: attn_lib.BlockSparse | None = None,
                temperature: float = 1.0, chunk: int = 128) -> np.ndarray:
  """Exact alpha_t of every token between the dense policy and sparse(+LoRA) under `schedule`,
  both at softmax(logits / temperature) (the rollout's sampling temperature).

  tokens [B, T]; returns float32 [B, T] aligned with tokens (entry 0 is 0: no prediction).
  `attention` overrides the spec derived from the schedule (`attention_for`); its max_budget
  must cover the schedule's budgets. `lora=None` probes the sparse actor without adapters.
  The LM head runs over `chunk` positions at a time.
  """
  if not temperature > 0:
    raise ValueError(f"probe_alpha: temperature={temperature!r}; expected > 0")
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  attention = attention if attention is not None else attention_for(schedule, t)
  if max_budget(schedule, t) > attention.max_budget:
    raise ValueError(f"schedule {schedule.name!r} needs max_budget {max_budget(schedule, t)}: "
                     f"attention.max_budget={attention.max_budget} is smaller")
  if schedule.page_size != attention.page_size:
    raise ValueError(f"schedule {schedule.name!r} page_size={schedule.page_size}: expected the "
                     f"attention spec's page_size={attention.page_size}")
  budgets = teacher_forced_budgets(as_schedule(schedule), t, b)
  return np.asarray(_probe_alpha(graphdef, state, lora, tokens, budgets, prompt_lengths,
                                 lengths, jnp.float32(temperature), attention=attention,
                                 chunk=int(chunk)))


def probe_tail_alpha(graphdef, state, lora, tokens, mask, prompt_lengths, schedule, *,
                     lengths=None, attention=None, temperature: float = 1.0,
                     quantile: float = 5.0, bin_size: int | None = None,
                     min_count: int = 1, chunk: int = 128) -> float:
  """p-quantile (5th) of exact alpha over the masked tokens of a probe batch under `schedule`.

  `mask` [B, T] marks the tokens to count: the response tokens (not a reward-dependent mask;
  alpha does not depend on rewards). With `bin_size`, the minimum over position bins holding
  >= `min_count` tokens of the per-bin quantile (the stricter check that every bin meets tau);
  without it, the quantile over all tokens when there are >= `min_count`. NaN when no bin (or
  too few tokens) qualifies: the caller skips the check rather than judge on a handful of
  tokens.
  """
  alpha = probe_alpha(graphdef, state, lora, tokens, schedule, prompt_lengths=prompt_lengths,
                      lengths=lengths, attention=attention, temperature=temperature,
                      chunk=chunk)
  return alpha_tail(alpha, mask, quantile=quantile, bin_size=bin_size, min_count=min_count)


def alpha_tail(alpha, mask, *, quantile: float = 5.0, bin_size: int | None = None,
               min_count: int = 1) -> float:
  """The tail statistic of `probe_tail_alpha` from per-token alpha [B, T] (host or device)
  and the mask of the tokens to count (entry 0 never counts: no prediction)."""
  alpha = np.asarray(alpha)
  m = np.array(mask) > 0
  m[:, 0] = False
  if bin_size is None:
    return float(np.percentile(alpha[m], quantile)) if m.sum() >= max(min_count, 1) else \
        float("nan")
  tails = [v for v, c in alpha_tails_per_bin(alpha, mask, bin_size=bin_size,
                                             quantile=quantile).values()
           if c >= max(min_count, 1)]
  return float(min(tails)) if tails else float("nan")


def alpha_tails_per_bin(alpha, mask, *, bin_size: int, quantile: float = 5.0
                        ) -> dict[int, tuple[float, int]]:
  """{bin: (quantile of alpha, token count)} per position bin of `bin_size` positions, from
  per-token alpha [B, T] and the mask of the tokens to count (entry 0 never counts); only
  bins that hold tokens appear."""
  alpha = np.asarray(alpha)
  m = np.array(mask) > 0
  m[:, 0] = False
  pos = np.broadcast_to(np.arange(alpha.shape[1]), alpha.shape)[m] // bin_size
  vals = alpha[m]
  return {int(k): (float(np.percentile(vals[pos == k], quantile)), int(np.sum(pos == k)))
          for k in np.unique(pos)}
