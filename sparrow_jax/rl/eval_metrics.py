"""Evaluation metrics over n sampled responses per prompt: avg@k, pass@k, maj@k.

Inputs are per-prompt lists, in sampling order: `rewards[i][j]` the verifier's reward of
sample j of prompt i, `answers[i][j]` its extracted answer (any hashable; None when nothing
could be extracted). A sample is *correct* when its reward >= `threshold` (0.5 by default, so
0/1 verifier rewards and small overlong penalties both work).

  avg@k    mean over prompts of the mean reward of the first k samples (the paper's "avg of
           16" on AIME, "avg of 4" on AMC).
  pass@k   unbiased estimator of Chen et al. (2021) from n >= k samples with c correct:
           1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k / i); averaged
           over prompts.
  maj@k    majority vote over the extracted answers of the first k samples; samples without
           an answer do not vote. Ties go to the tied answer that appears first in sampling
           order (deterministic, independent of hashing). The vote is correct when the first
           sample carrying the winning answer is correct (its reward was judged against the
           ground truth by the verifier); no answer at all counts as incorrect.

Test-time voting with weights (ARRoL Sec. 4.4, DeepConf), side by side with maj@k:
  weighted_vote      the answer with the largest total weight (same ties and None rule as
                     majority_vote); `weighted_maj_at_k` scores it like maj@k.
  rank_weights       ARRoL's weights from quality-head scores: candidates sorted by score,
                     ranks linearly rescaled to [0, 1] (lowest 0, highest 1); tied scores
                     share their mean rank; a single candidate gets 1.
  trace_confidence   DeepConf's trace score: token confidence C_t = -mean_j log p_t(j) over
                     the top-k log-probs at t (a peaked distribution gives a large C_t);
                     group confidences = means of C over sliding windows of `window` tokens
                     (stride 1; one window of the whole trace when it is shorter); the trace
                     confidence is the mean of the lowest `lowest_frac` of them ("bottom-10%
                     group confidence"). Defaults window=2048, lowest_frac=0.1 follow
                     DeepConf's settings; short CPU traces want a smaller window.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import numpy as np


def _check_k(k: int, name: str = "k") -> None:
  if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
    raise ValueError(f"{name}={k!r}: expected a positive int")


def _rows(rewards: Sequence[Sequence[float]], k: int | None, what: str) -> list[np.ndarray]:
  if len(rewards) == 0:
    raise ValueError(f"{what}: rewards has no prompts: expected at least one")
  rows = [np.asarray(r, np.float64).reshape(-1) for r in rewards]
  if k is not None:
    _check_k(k)
    short = [i for i, r in enumerate(rows) if r.size < k]
    if short:
      raise ValueError(f"{what}: prompt {short[0]} has {rows[short[0]].size} samples: expected "
                       f">= k={k}")
  return rows


def avg_at_k(rewards: Sequence[Sequence[float]], k: int | None = None) -> float:
  """Mean over prompts of the mean reward of the first k samples (all samples if k is None)."""
  rows = _rows(rewards, k, "avg@k")
  if any(r.size == 0 for r in rows):
    raise ValueError("avg@k: a prompt has no samples: expected at least one each")
  return float(np.mean([r[:k].mean() for r in rows]))


def pass_at_k_estimator(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one prompt with n samples of which c are correct (Chen et al.)."""
  _check_k(k)
  if not 0 <= c <= n or n < k:
    raise ValueError(f"pass@k: n={n}, c={c}, k={k}: expected 0 <= c <= n and n >= k")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k(rewards: Sequence[Sequence[float]], k: int, *, threshold: float = 0.5) -> float:
  """Mean over prompts of the unbiased pass@k from all n samples of each prompt."""
  rows = _rows(rewards, k, "pass@k")
  return float(np.mean([pass_at_k_estimator(r.size, int(np.sum(r >= threshold)), k)
                        for r in rows]))


def majority_vote(answers: Sequence[Hashable | None]) -> tuple[Hashable | None, int]:
  """(winning answer, its index of first occurrence); (None, -1) when nobody answered.

  Ties: the tied answer whose first occurrence comes earliest wins.
  """
  counts: dict = {}
  first: dict = {}
  for j, a in enumerate(answers):
    if a is None:
      continue
    counts[a] = counts.get(a, 0) + 1
    first.setdefault(a, j)
  if not counts:
    return None, -1
  best = max(counts, key=lambda a: (counts[a], -first[a]))
  return best, first[best]


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], rewards: Sequence[Sequence[float]],
             k: int, *, threshold: float = 0.5) -> float:
  """Mean over prompts of the correctness of the majority answer among the first k samples."""
  rows = _rows(rewards, k, "maj@k")
  if len(answers) != len(rows):
    raise ValueError(f"maj@k: {len(answers)} answer lists for {len(rows)} reward lists: "
                     "expected one per prompt")
  hits = []
  for i, (ans, r) in enumerate(zip(answers, rows)):
    if len(ans) != r.size:
      raise ValueError(f"maj@k: prompt {i} has {len(ans)} answers and {r.size} rewards: "
                       "expected one answer per sample")
    _, j = majority_vote(list(ans)[:k])
    hits.append(j >= 0 and r[j] >= threshold)
  return float(np.mean(hits))


def weighted_vote(answers: Sequence[Hashable | None],
                  weights: Sequence[float]) -> tuple[Hashable | None, int]:
  """(answer with the largest total weight, its index of first occurrence); (None, -1) when
  nobody answered. Samples without an answer do not vote; weights must be finite and >= 0.

  Ties: totals within 1e-9 (relative) of the best are tied (so float rounding in sums such
  as 1/3 + 2/3 vs 1 cannot decide), and the tied answer that appears first wins.
  """
  w = np.asarray(weights, np.float64).reshape(-1)
  if w.size != len(answers):
    raise ValueError(f"weighted_vote: {w.size} weights for {len(answers)} answers: expected one "
                     "weight per answer")
  if w.size and (not np.isfinite(w).all() or (w < 0).any()):
    raise ValueError(f"weighted_vote: weights={w.tolist()}: expected finite values >= 0")
  parts: dict = {}
  first: dict = {}
  for j, a in enumerate(answers):
    if a is None:
      continue
    parts.setdefault(a, []).append(float(w[j]))
    first.setdefault(a, j)
  if not parts:
    return None, -1
  totals = {a: math.fsum(v) for a, v in parts.items()}
  best_total = max(totals.values())
  tied = [a for a, t in totals.items() if t >= best_total - 1e-9 * max(1.0, abs(best_total))]
  best = min(tied, key=lambda a: first[a])
  return best, first[best]


def rank_weights(scores: Sequence[float]) -> np.ndarray:
  """float64 `[n]`: ranks of `scores` (ascending, tied scores share their mean rank) rescaled
  linearly to [0, 1]: the lowest score gets 0, the highest 1. One candidate gets [1.0]; no
  candidate gives []. All scores equal gives 0.5 each (every candidate shares the mean rank).
  """
  s = np.asarray(scores, np.float64).reshape(-1)
  if not np.isfinite(s).all():
    raise ValueError(f"rank_weights: scores={s.tolist()}: expected finite values")
  n = s.size
  if n <= 1:
    return np.ones(n, np.float64)
  order = np.argsort(s, kind="stable")
  ranks = np.empty(n, np.float64)
  ranks[order] = np.arange(n, dtype=np.float64)  # 0-based
  _, inv = np.unique(s, return_inverse=True)
  ranks = (np.bincount(inv, weights=ranks) / np.bincount(inv))[inv]  # mean rank per tie
  return ranks / (n - 1)


def token_confidence(topk_logprobs) -> np.ndarray:
  """float64 `[T]`: C_t = -mean_j topk_logprobs[t, j] (DeepConf's token confidence)."""
  lp = np.asarray(topk_logprobs, np.float64)
  if lp.ndim != 2 or lp.shape[1] < 1:
    raise ValueError(f"token_confidence: topk_logprobs shape {lp.shape}: expected [T, k], k >= 1")
  if not np.isfinite(lp).all():
    raise ValueError("token_confidence: topk_logprobs holds non-finite values: expected the "
                     "finite log-probs of the top-k tokens")
  return -lp.mean(axis=1)


def trace_confidence(topk_logprobs, window: int = 2048, lowest_frac: float = 0.1) -> float:
  """DeepConf bottom-`lowest_frac` group confidence of one trace (see module docstring).

  Args:
    topk_logprobs: `[T, k]` log-probs of the k most likely tokens at each generated position.
    window: tokens per group (sliding, stride 1); a trace shorter than `window` is one group.
    lowest_frac: fraction of the groups, lowest first, that are averaged; at least one group
      is always used (ceil(lowest_frac * groups)).
  """
  if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
    raise ValueError(f"trace_confidence: window={window!r}: expected a positive int")
  if not 0.0 < float(lowest_frac) <= 1.0:
    raise ValueError(f"trace_confidence: lowest_frac={lowest_frac!r}: expected in (0, 1]")
  c = token_confidence(topk_logprobs)  # [T]
  if c.size == 0:
    raise ValueError("trace_confidence: empty trace (T = 0): expected at least one token")
  w = min(int(window), c.size)
  csum = np.concatenate([[0.0], np.cumsum(c)])  # [T + 1]
  groups = (csum[w:] - csum[:-w]) / w  # [T - w + 1] sliding-window means
  m = max(1, math.ceil(float(lowest_frac) * groups.size - 1e-9))
  return float(np.sort(groups)[:m].mean())


def weighted_maj_at_k(answers: Sequence[Sequence[Hashable | None]],
                      rewards: Sequence[Sequence[float]], weights: Sequence[Sequence[float]],
                      k: int, *, rank: bool = False, threshold: float = 0.5) -> float:
  """maj@k with weighted votes: mean over prompts of the correctness of `weighted_vote` among
  the first k samples. With `rank=True` the weights are scores (e.g. quality-head logits)
  turned into `rank_weights` over those k samples (ARRoL); otherwise they are used as given
  (e.g. `trace_confidence`, DeepConf)."""
  rows = _rows(rewards, k, "weighted maj@k")
  if not len(answers) == len(weights) == len(rows):
    raise ValueError(f"weighted maj@k: {len(answers)} answer lists, {len(weights)} weight "
                     f"lists, {len(rows)} reward lists: expected one of each per prompt")
  hits = []
  for i, (ans, wts, r) in enumerate(zip(answers, weights, rows)):
    if not len(ans) == len(wts) == r.size:
      raise ValueError(f"weighted maj@k: prompt {i} has {len(ans)} answers, {len(wts)} "
                       f"weights and {r.size} rewards: expected one of each per sample")
    w = np.asarray(wts, np.float64)[:k]
    _, j = weighted_vote(list(ans)[:k], rank_weights(w) if rank else w)
    hits.append(j >= 0 and r[j] >= threshold)
  return float(np.mean(hits))


def eval_summary(rewards: Sequence[Sequence[float]],
                 answers: Sequence[Sequence[Hashable | None]] | None = None, *,
                 ks: Sequence[int] = (1,), threshold: float = 0.5,
                 prefix: str = "eval/") -> dict[str, float]:
  """avg@k, pass@k (and maj@k when answers are given) for every k in `ks`, as a flat dict."""
  out = {f"{prefix}prompts": float(len(rewards))}
  for k in ks:
    out[f"{prefix}avg@{k}"] = avg_at_k(rewards, k)
    out[f"{prefix}pass@{k}"] = pass_at_k(rewards, k, threshold=threshold)
    if answers is not None:
      out[f"{prefix}maj@{k}"] = maj_at_k(answers, rewards, k, threshold=threshold)
  return out
