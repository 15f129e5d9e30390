"""Live mismatch monitor: the tail of the per-token acceptance rate, every RL step.

Paper §3 / the release's online statistic. For every generated token t the acceptance rate
between the dense policy p and the sparse actor q is alpha_t = sum_v min(p_t(v), q_t(v)); the
rollout keeps q's top-k log-probs (`EngineConfig.logprobs_topk`, k = 20 in the release) and the
dense recompute p's top-k, and `mismatch.topk_acceptance_lower_bound` gives a lower bound of
alpha_t from the two sets (tokens outside a set count as probability 0). Tokens are grouped by
position bin (position = the token's index in the full sequence = tokens held in the KV cache
when the query that produced it ran, the schedule's position) and the tail statistic, the 5th
percentile ("p5"), is reported per bin and overall. A bin with at least `min_count` tokens whose
p5 falls below tau is "below tau". The first step with such a bin is logged as a warning
naming the bin (logger `sparrow_jax.rl.monitor`); later ones are counted and logged at DEBUG
only (`warn="every"` warns each time), and `summary_line()` reports at the end of a run in how
many of its steps, and in which bins, p5 fell below tau: a run whose sparse actor sits below
tau most of the time would otherwise print one warning per step.

Optionally the exact alpha_t on a small sample (`exact_alpha`, both logits needed) checks how
loose the bound is.

Both distributions must be the sampling distributions (the same temperature T on both sides).
The trainer takes the dense top-k from the recompute of softmax(logits / T), and the engine
keeps the sparse actor's top-k of softmax(logits / T) at the request's temperature
(`EngineConfig.logprobs_topk`), so at any T the bound is as tight as the two top-k sets allow.
(Until 2026-12-02 the engine kept untempered top-k and the monitor bounded the tempered values
from below, which cost up to ~0.2 of p5 at T = 0.7.)
Metrics come back as one flat dict of floats for the JSONL / TensorBoard logger:
  mismatch/p5_overall, mismatch/mean, mismatch/frac_accepted, mismatch/tokens,
  mismatch/p5_bin_{i}, mismatch/mean_bin_{i}, mismatch/count_bin_{i}  (non-empty bins only),
  mismatch/min_p5_bin, mismatch/bins_below_tau,
  mismatch/exact_p5_overall, mismatch/exact_mean, mismatch/exact_bound_gap  (with exact alpha).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.schedule import mismatch

logger = logging.getLogger(__name__)

_CHUNK_ROWS = 4096  # tokens per jitted bound call: chunk * kp * kq * 4 bytes of temporaries


@dataclasses.dataclass(frozen=True, kw_only=True)
class MonitorConfig:
  """tau: tail target; bin_size: tokens per position bin (the release: 2048); min_count:
  tokens a bin needs before it can raise a warning; quantile: the tail percentile (5)."""

  tau: float = 0.86
  bin_size: int = 2048
  min_count: int = 32
  quantile: float = 5.0
  num_bins: int | None = None

  def __post_init__(self):
    if isinstance(self.tau, bool) or not 0.0 < float(self.tau) <= 1.0:
      raise ValueError(f"MonitorConfig.tau={self.tau!r}: expected a float in (0, 1]")
    for f in ("bin_size", "min_count"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MonitorConfig.{f}={v!r}: expected a positive int")
    if not 0.0 <= self.quantile <= 100.0:
      raise ValueError(f"MonitorConfig.quantile={self.quantile!r}: expected a percentile in "
                       "[0, 100]")
    if self.num_bins is not None and (not isinstance(self.num_bins, int) or self.num_bins < 1):
      raise ValueError(f"MonitorConfig.num_bins={self.num_bins!r}: expected None or a "
                       "positive int")


_bound_jit = jax.jit(mismatch.topk_acceptance_lower_bound)


def lower_bound_alpha(sparse_ids, sparse_logp, dense_ids, dense_logp) -> np.ndarray:
  """Per-token lower bound of alpha from the two top-k sets -> float32 [...] (host).

  sparse_ids/sparse_logp [..., kq] (rollout), dense_ids/dense_logp [..., kp] (recompute). Runs
  in fixed-size jitted chunks of tokens so memory stays bounded and shapes compile once.
  """
  q_ids, q_lp = np.asarray(sparse_ids), np.asarray(sparse_logp, np.float32)
  p_ids, p_lp = np.asarray(dense_ids), np.asarray(dense_logp, np.float32)
  if q_ids.shape != q_lp.shape or p_ids.shape != p_lp.shape:
    raise ValueError(f"top-k shapes: sparse ids {q_ids.shape} vs log-probs {q_lp.shape}, dense "
                     f"ids {p_ids.shape} vs log-probs {p_lp.shape}: expected ids and log-probs "
                     "of equal shape")
  if q_ids.shape[:-1] != p_ids.shape[:-1]:
    raise ValueError(f"sparse top-k token axes {q_ids.shape[:-1]} != dense {p_ids.shape[:-1]}: "
                     "expected the same tokens on both sides")
  lead = q_ids.shape[:-1]
  q_ids, q_lp = q_ids.reshape(-1, q_ids.shape[-1]), q_lp.reshape(-1, q_lp.shape[-1])
  p_ids, p_lp = p_ids.reshape(-1, p_ids.shape[-1]), p_lp.reshape(-1, p_lp.shape[-1])
  n = q_ids.shape[0]
  out = np.empty(n, np.float32)
  rows = min(_CHUNK_ROWS, max(1, 1 << (n - 1).bit_length()))  # power-of-two bucket
  for s in range(0, n, rows):
    e = min(s + rows, n)
    pad = lambda x, fill: np.concatenate(
        [x[s:e], np.full((rows - (e - s),) + x.shape[1:], fill, x.dtype)])
    # Padded rows carry id -1 (never matches), so they contribute 0 and are dropped anyway.
    b = _bound_jit(pad(p_ids, -1), pad(p_lp, -np.inf), pad(q_ids, -2), pad(q_lp, -np.inf))
    out[s:e] = np.asarray(b)[:e - s]
  return out.reshape(lead)


def replay_diff(replay_logp, rollout_logp, mask) -> np.ndarray:
  """|log q_replay(y_t) - log q_rollout(y_t)| per token [B, T] (float64; 0 off `mask`): the
  teacher-forced sparse actor's log-prob of each sampled token against the engine's."""
  d = np.abs(np.asarray(replay_logp, np.float64) - np.asarray(rollout_logp, np.float64))
  return np.where(np.asarray(mask) > 0, d, 0.0)


def replay_stats(diff, mask, threshold: float = 1e-3) -> dict[str, float]:
  """`mismatch/replay_*` of a `replay_diff`: the largest difference, the fraction of `mask`'s
  tokens off by more than `threshold` and the rows holding any ({} without tokens)."""
  m = np.asarray(mask) > 0
  if not m.any():
    return {}
  off = (diff > threshold) & m
  return {"mismatch/replay_logp_maxdiff": float(diff[m].max()),
          "mismatch/replay_frac_off": float(off.sum() / m.sum()),
          "mismatch/replay_rows_off": float(off.any(axis=1).sum())}


def exact_alpha(dense_logits, sparse_logits, mask=None) -> np.ndarray:
  """Exact alpha_t from next-token logits [..., T, V] of both sides -> float32 [..., T]."""
  return np.asarray(mismatch.acceptance_rate(jnp.asarray(dense_logits),
                                             jnp.asarray(sparse_logits), mask))


def _positions_for(shape, positions):
  if positions is None:
    if len(shape) < 1:
      raise ValueError("positions=None needs per-token arrays shaped [..., T]")
    return np.broadcast_to(np.arange(shape[-1]), shape)
  pos = np.asarray(positions)
  if pos.shape != tuple(shape):
    raise ValueError(f"positions.shape={pos.shape}: expected {tuple(shape)} (the token axes)")
  return pos


def tail_metrics(alpha, mask=None, positions=None, cfg: MonitorConfig = MonitorConfig(), *,
                 prefix: str = "mismatch/") -> tuple[dict[str, float], list[int]]:
  """Flat per-bin and overall tail metrics of per-token alpha -> (metrics, bins below tau).

  alpha, mask, positions: [...] per token (positions default to the index along the last
  axis). A bin is "below tau" when its p-quantile < tau and it holds >= min_count tokens.
  """
  a = np.asarray(alpha, np.float64)
  m = np.ones(a.shape, bool) if mask is None else np.asarray(mask) > 0
  if m.shape != a.shape:
    raise ValueError(f"mask.shape={m.shape}: expected alpha.shape={a.shape}")
  pos = _positions_for(a.shape, positions)
  valid = a[m]
  q = cfg.quantile
  out = {f"{prefix}tokens": float(valid.size)}
  if valid.size == 0:
    return out, []
  out[f"{prefix}p{q:g}_overall"] = float(np.percentile(valid, q))
  out[f"{prefix}mean"] = float(valid.mean())
  out[f"{prefix}frac_accepted"] = float(np.mean(valid >= mismatch.ACCEPT_THRESHOLD))
  bins = np.minimum(pos[m].astype(np.int64) // cfg.bin_size,
                    (cfg.num_bins or np.iinfo(np.int64).max) - 1)
  below, tails = [], []
  for b in np.unique(bins):
    x = valid[bins == b]
    p = float(np.percentile(x, q))
    out[f"{prefix}p{q:g}_bin_{b}"] = p
    out[f"{prefix}mean_bin_{b}"] = float(x.mean())
    out[f"{prefix}count_bin_{b}"] = float(x.size)
    if x.size >= cfg.min_count:
      tails.append(p)
      if p < cfg.tau:
        below.append(int(b))
  if tails:
    out[f"{prefix}min_p{q:g}_bin"] = float(min(tails))
  out[f"{prefix}bins_below_tau"] = float(len(below))
  return out, below


class MismatchMonitor:
  """Per-step monitor; `update(...)` returns flat metrics and warns (once, by default) when a
  bin falls below tau; `summary_line()` says how often that happened."""

  WARN_MODES = ("once", "every")

  def __init__(self, cfg: MonitorConfig = MonitorConfig(), *, warn: str = "once"):
    if not isinstance(cfg, MonitorConfig):
      raise ValueError(f"MismatchMonitor: cfg={cfg!r}: expected a MonitorConfig")
    if warn not in self.WARN_MODES:
      raise ValueError(f"MismatchMonitor: warn={warn!r}: expected one of {self.WARN_MODES}")
    self.cfg = cfg
    self.warn = warn
    self.num_warnings = 0  # warnings logged at WARNING level
    self.num_updates = 0  # monitored batches (steps)
    self.steps: list[int | None] = []  # the step of each monitored batch
    self.below_steps: list[int | None] = []  # ... of each batch with a bin below tau
    self.below_bins: dict[int, int] = {}  # bin -> batches in which it was below tau
    self.lowest: tuple[float, int | None, int] | None = None  # (p5, step, bin), lowest seen

  def should_warn(self) -> bool:
    """Warn now about a batch below tau? Yes for the first one (or each, `warn="every"`)."""
    return self.warn == "every" or not self.below_steps

  def _note_below(self, metrics: dict[str, float], below: list[int], step: int | None) -> bool:
    """Count a batch with bins below tau; returns whether to warn about it."""
    warn = self.should_warn()
    self.below_steps.append(step)
    q = f"p{self.cfg.quantile:g}"
    for b in below:
      self.below_bins[b] = self.below_bins.get(b, 0) + 1
      p = metrics[f"mismatch/{q}_bin_{b}"]
      if self.lowest is None or p < self.lowest[0]:
        self.lowest = (p, step, b)
    return warn

  def summary_line(self) -> str | None:
    """One line for the end of a run, e.g. "mismatch monitor: p5 below tau=0.860 in 37 of 60
    steps (1-60; bin 0 in 37), lowest p5 0.6402 (bin 0, step 12)"; None before any update."""
    if not self.num_updates:
      return None
    n, k, tau = self.num_updates, len(self.below_steps), self.cfg.tau
    q = f"p{self.cfg.quantile:g}"
    known = [s for s in self.steps if s is not None]
    span = [f"steps {min(known)}-{max(known)}"] if known else []
    if not k:
      return (f"mismatch monitor: {q} at or above tau={tau:.3f} in all {n} steps"
              + (f" ({span[0]})" if span else ""))
    bins = [f"bin {b} in {c}" for b, c in sorted(self.below_bins.items())]
    p, step, b = self.lowest
    at = f"bin {b}" + ("" if step is None else f", step {step}")
    return (f"mismatch monitor: {q} below tau={tau:.3f} in {k} of {n} steps "
            f"({'; '.join(span + bins)}), lowest {q} {p:.4f} ({at})")

  def update(self, sparse_ids, sparse_logp, dense_ids, dense_logp, mask, positions=None, *,
             step: int | None = None, dense_logits=None, sparse_logits=None,
             exact_mask=None) -> dict[str, float]:
    """Monitor one batch.

    Args:
      sparse_ids, sparse_logp: [..., T, kq] the rollout's top-k (sparse actor).
      dense_ids, dense_logp: [..., T, kp] the recompute's top-k (dense policy).
      mask: [..., T] generated tokens to count.
      positions: [..., T] token index in the full sequence (default: arange(T)).
      step: for the warning text.
      dense_logits, sparse_logits: optional [..., T, V] next-token logits of the same tokens
        (a small sample) for exact alpha; `exact_mask` [..., T] limits it (default `mask`).
    """
    cfg = self.cfg
    bound = lower_bound_alpha(sparse_ids, sparse_logp, dense_ids, dense_logp)
    metrics, below = tail_metrics(bound, mask, positions, cfg)
    self.num_updates += 1
    self.steps.append(step)
    if below:
      warn = self._note_below(metrics, below, step)
      q = f"p{cfg.quantile:g}"
      desc = ", ".join(
          f"bin {b} (positions {b * cfg.bin_size}-{(b + 1) * cfg.bin_size - 1}: {q} "
          f"{metrics[f'mismatch/{q}_bin_{b}']:.4f}, {int(metrics[f'mismatch/count_bin_{b}'])} "
          "tokens)" for b in below)
      where = "" if step is None else f" step {step}"
      if warn:
        self.num_warnings += 1
        later = ("" if self.warn == "every" else "; later steps below tau are counted, not "
                 "printed (summary at the end of the run)")
        logger.warning("mismatch monitor%s: tail acceptance below tau=%.3f in %s%s", where,
                       cfg.tau, desc, later)
      else:
        logger.debug("mismatch monitor%s: tail acceptance below tau=%.3f in %s", where,
                     cfg.tau, desc)
    if (dense_logits is None) != (sparse_logits is None):
      raise ValueError("exact alpha needs both dense_logits and sparse_logits (or neither)")
    if dense_logits is not None:
      em = mask if exact_mask is None else exact_mask
      exact = exact_alpha(dense_logits, sparse_logits)
      if exact.shape != np.shape(bound):
        raise ValueError(f"exact alpha shape {exact.shape} (from the logits): expected the "
                         f"token axes of the top-k arrays, {np.shape(bound)}")
      ex, _ = tail_metrics(exact, em, positions, cfg, prefix="mismatch/exact_")
      metrics.update({k: v for k, v in ex.items() if "_bin_" not in k})
      sel = np.asarray(em) > 0
      if sel.any():
        metrics["mismatch/exact_bound_gap"] = float(np.mean(exact[sel] - bound[sel]))
    return metrics
