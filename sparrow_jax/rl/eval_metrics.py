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
"""

from __future__ import annotations

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
