"""ARRoL's host-side math: the binned calibrator, the survival probabilities and their seeded
keep draws, and the metrics of the head and of the kept groups (numpy, float64; no jax).

Paper symbols and the names that carry them:
  s_i        head score of rollout i, sigmoid of the head logit, in [0, 1].
  B          number of equal-width score bins (`num_bins`, 128).
  alpha      Laplace smoothing of the class-conditional bin histograms (`alpha`, 1).
  pi         prior P(y = 1) = running positive rate of all labelled rollouts seen so far
             (`BinnedCalibrator.prior`); 0.5 before any label was seen.
  q_i        calibrated success probability of bin b(s_i) (Appendix A.4):
             q_b = pi P(b|pos) / (pi P(b|pos) + (1 - pi) P(b|neg)),
             P(b|c) = (n_c[b] + alpha) / (N_c + B alpha).
  kappa      target keep rate, expected fraction of a group's scored rollouts kept
             (`keep_rate`, 0.5).
  rho        target positive ratio among the kept rollouts (`target`, 0.5; the authors'
             code uses 0.4).
  lambda     strength of the steering towards rho (`lam`, 0.5).
  p_i        survival probability clip(kappa + delta + lambda (rho - q_i), p_min, p_max)
             (`survival_probabilities`), p_min/p_max = 0.25/0.75.
  delta      the group's shift, found by bisection so that mean_i p_i = kappa.
             Without clipping delta = -lambda (rho - mean_j q_j), so p_i = kappa +
             lambda (mean_j q_j - q_i): rho cancels and the rule always favours the
             rollouts least likely to succeed. That balances groups whose mean q is above
             rho and unbalances those below it (hard prompts). `steer="signed"` (ours, not
             the paper's) uses lambda sign(mean_j q_j - rho) instead, so a hard group keeps
             its likely successes; `steer="paper"` (default) is the formula above.
  rho_hat    fraction of positive rollouts among a group's kept ones (`rho_hat_stats`).

Calibration sees only rollouts that survived pruning, but that selection depends on the
score (its bin) alone, so within a bin positives and negatives are kept at the same rate
and q_b = P(y=1 | b) is unchanged by it (up to the spread of p inside a bin).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from sparrow_jax.args import is_int

STEER_MODES = ("paper", "signed")
_DRAW_DOMAIN = 0x4152524F  # "ARRO": keeps these uniforms apart from other uses of a key tuple


def is_num(v) -> bool:
  """A finite Python or numpy number that is not a bool."""
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
      v, (bool, np.bool_)) and math.isfinite(float(v))


# ----------------------------------------------------------------------------- calibration


def check_scores(scores, what: str) -> np.ndarray:
  """float64 `[n]` head scores, each checked to be in [0, 1]; `what` names the caller."""
  s = np.asarray(scores, np.float64).reshape(-1)
  bad = ~np.isfinite(s) | (s < 0.0) | (s > 1.0)
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{what}: score[{i}]={float(s[i])!r}: expected a finite value in [0, 1] "
                     "(sigmoid of the head logit)")
  return s


def check_labels(labels, n: int, what: str) -> np.ndarray:
  """bool `[n]` labels (bool or 0/1 input, one per score); `what` names the caller."""
  y = np.asarray(labels).reshape(-1)
  if y.size != n:
    raise ValueError(f"{what}: {y.size} labels for {n} scores: expected one label per score")
  if y.dtype != np.bool_:
    if not np.all((y == 0) | (y == 1)):
      raise ValueError(f"{what}: labels must be bool or 0/1 (use reward > 0), got values "
                       f"{sorted(set(np.unique(y).tolist()))[:5]}")
    y = y.astype(np.bool_)
  return y


class BinnedCalibrator:
  """Online binned calibration of head scores (paper Appendix A.4).

  Scores s in [0, 1] fall into `num_bins` equal bins (s = 1 goes to the last bin). Every
  `update` adds the scores of labelled rollouts to the histogram of their class; nothing is
  forgotten (the paper's "past scores"). See the module docstring for q_b.
  """

  def __init__(self, num_bins: int = 128, alpha: float = 1.0):
    if not is_int(num_bins) or num_bins < 1:
      raise ValueError(f"BinnedCalibrator.num_bins={num_bins!r}: expected a positive int")
    if not is_num(alpha) or alpha <= 0:
      raise ValueError(f"BinnedCalibrator.alpha={alpha!r}: expected a finite number > 0 "
                       "(Laplace smoothing keeps empty bins well defined)")
    self.num_bins = int(num_bins)
    self.alpha = float(alpha)
    self.pos_counts = np.zeros(self.num_bins, np.int64)  # [B] past positive scores per bin
    self.neg_counts = np.zeros(self.num_bins, np.int64)  # [B] past negative scores per bin

  def bins(self, scores) -> np.ndarray:
    """int64 `[n]` bin index of each score."""
    s = check_scores(scores, "BinnedCalibrator.bins")
    return np.minimum((s * self.num_bins).astype(np.int64), self.num_bins - 1)

  def update(self, scores, labels) -> None:
    """Add labelled scores (label True/1 = positive rollout, i.e. reward > 0)."""
    b = self.bins(scores)
    y = check_labels(labels, b.size, "BinnedCalibrator.update")
    self.pos_counts += np.bincount(b[y], minlength=self.num_bins)
    self.neg_counts += np.bincount(b[~y], minlength=self.num_bins)

  @property
  def num_seen(self) -> int:
    return int(self.pos_counts.sum() + self.neg_counts.sum())

  @property
  def prior(self) -> float:
    """pi: positive rate of every label seen so far; 0.5 (no preference) before any."""
    n = self.num_seen
    return float(self.pos_counts.sum()) / n if n else 0.5

  def bin_posteriors(self) -> np.ndarray:
    """float64 `[B]`: q_b for every bin."""
    a, nb = self.alpha, self.num_bins
    p_pos = (self.pos_counts + a) / (self.pos_counts.sum() + nb * a)  # [B] P(b | pos)
    p_neg = (self.neg_counts + a) / (self.neg_counts.sum() + nb * a)  # [B] P(b | neg)
    pi = self.prior
    num = pi * p_pos
    return num / (num + (1.0 - pi) * p_neg)

  def posterior(self, scores) -> np.ndarray:
    """float64 `[n]`: q_i = q_{b(s_i)}."""
    return self.bin_posteriors()[self.bins(scores)]

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state (ints and floats only); exact round trip."""
    return {"num_bins": self.num_bins, "alpha": self.alpha,
            "pos_counts": [int(c) for c in self.pos_counts],
            "neg_counts": [int(c) for c in self.neg_counts]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for f in ("num_bins", "alpha"):
      if f not in state or state[f] != getattr(self, f):
        raise ValueError(f"BinnedCalibrator state {f}={state.get(f)!r}: expected "
                         f"{getattr(self, f)!r} (this calibrator's setting)")
    counts = {}
    for f in ("pos_counts", "neg_counts"):
      c = np.asarray(state.get(f, ()))
      if c.shape != (self.num_bins,) or not np.issubdtype(c.dtype, np.integer) or (c < 0).any():
        raise ValueError(f"BinnedCalibrator state {f}: shape {c.shape} dtype {c.dtype}: "
                         f"expected {self.num_bins} non-negative ints")
      counts[f] = c.astype(np.int64)
    self.pos_counts, self.neg_counts = counts["pos_counts"], counts["neg_counts"]


# ----------------------------------------------------------------------------- survival


def survival_probabilities(q, *, keep_rate: float, target: float, lam: float, p_min: float,
                           p_max: float, tol: float = 1e-9,
                           steer: str = "paper") -> tuple[np.ndarray, float]:
  """(p `[n]` float64, delta) with p_i = clip(kappa + delta + lam (rho - q_i), p_min, p_max).

  delta is found by bisection on the mean, which is non-decreasing in delta and runs from
  p_min to p_max, so that |mean(p) - kappa| <= tol (float64). An empty group gives
  (empty, 0.0). `steer="signed"` multiplies lam by sign(mean(q) - rho) (module docstring).

  Raises:
    ValueError: kappa outside [p_min, p_max] (infeasible), q outside [0, 1], bad bounds.
  """
  q = np.asarray(q, np.float64).reshape(-1)  # [n]
  for name, v in (("keep_rate", keep_rate), ("target", target), ("lam", lam),
                  ("p_min", p_min), ("p_max", p_max), ("tol", tol)):
    if not is_num(v):
      raise ValueError(f"survival_probabilities: {name}={v!r}: expected a finite number")
  if not 0.0 <= p_min <= p_max <= 1.0:
    raise ValueError(f"survival_probabilities: p_min={p_min}, p_max={p_max}: expected "
                     "0 <= p_min <= p_max <= 1")
  if not p_min <= keep_rate <= p_max:
    raise ValueError(f"survival_probabilities: keep_rate={keep_rate} is outside [p_min, p_max] "
                     f"= [{p_min}, {p_max}]: no delta makes mean(p) = keep_rate (infeasible)")
  if lam < 0 or not tol > 0:
    raise ValueError(f"survival_probabilities: lam={lam}, tol={tol}: expected lam >= 0, tol > 0")
  if steer not in STEER_MODES:
    raise ValueError(f"survival_probabilities: steer={steer!r}: expected one of {STEER_MODES}")
  bad = ~np.isfinite(q) | (q < 0) | (q > 1)
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"survival_probabilities: q[{i}]={float(q[i])!r}: expected a probability "
                     "in [0, 1]")
  if q.size == 0:
    return np.zeros(0, np.float64), 0.0
  if steer == "signed":
    lam = lam * float(np.sign(q.mean() - target))
  base = keep_rate + lam * (target - q)  # [n] p before the shift and the clip

  def mean_p(d: float) -> float:
    return float(np.clip(base + d, p_min, p_max).mean())

  # At lo every p_i is clipped to p_min, at hi every p_i to p_max.
  lo, hi = p_min - float(base.max()), p_max - float(base.min())
  delta = 0.5 * (lo + hi)
  for _ in range(200):
    delta = 0.5 * (lo + hi)
    m = mean_p(delta)
    if abs(m - keep_rate) <= tol:
      break
    if m < keep_rate:
      lo = delta
    else:
      hi = delta
  p = np.clip(base + delta, p_min, p_max)
  if abs(float(p.mean()) - keep_rate) > max(tol, 1e-6):
    raise RuntimeError(f"survival_probabilities: bisection ended at mean(p)={p.mean()!r} for "
                       f"keep_rate={keep_rate} (tol={tol}); this is a bug")
  return p, float(delta)


def key_uniform(key: Sequence[int]) -> float:
  """The uniform in [0, 1) of one draw key, a tuple of non-negative ints such as
  (run_seed, step, prompt_index, sample_index); a function of the key alone."""
  key = tuple(key) if not isinstance(key, (str, bytes)) else key
  if isinstance(key, (str, bytes)) or not key or not all(is_int(k) and k >= 0 for k in key):
    raise ValueError(f"draw key {key!r}: expected a non-empty tuple of non-negative ints")
  # SeedSequence hashes the whole tuple (any length, any int size) into well-mixed words;
  # the top 53 bits of one 64-bit word make a double in [0, 1).
  word = np.random.SeedSequence([_DRAW_DOMAIN, len(key), *(int(k) for k in key)]).generate_state(
      1, np.uint64)[0]
  return float(int(word) >> 11) * 2.0 ** -53


def keep_draws(p, keys: Sequence[Sequence[int]]) -> np.ndarray:
  """bool `[n]`: keep_i = u(key_i) < p_i, u from `key_uniform` (independent of the other
  rollouts in the call, so a rollout's draw does not change with how groups are batched)."""
  p = np.asarray(p, np.float64).reshape(-1)
  if len(keys) != p.size:
    raise ValueError(f"keep_draws: {len(keys)} keys for {p.size} probabilities: expected one "
                     "key per rollout")
  if p.size and (not np.isfinite(p).all() or (p < 0).any() or (p > 1).any()):
    raise ValueError(f"keep_draws: p={p.tolist()}: expected probabilities in [0, 1]")
  u = np.array([key_uniform(k) for k in keys], np.float64)  # [n]
  return u < p


# ----------------------------------------------------------------------------- metrics


def rho_hat_stats(rewards, group_ids, keep=None) -> tuple[float, float]:
  """(E[rho_hat], E[rho_hat (1 - rho_hat)]) over groups (paper Table 4).

  rho_hat of a group = fraction of reward > 0 among its kept rollouts. `rewards` and
  `group_ids` are `[N]`; `keep` (bool `[N]`, default all) selects the kept ones. Groups with
  no kept rollout have no rho_hat and are left out; (NaN, NaN) when no group is left.
  """
  r = np.asarray(rewards, np.float64).reshape(-1)
  g = np.asarray(group_ids).reshape(-1)
  k = np.ones(r.size, np.bool_) if keep is None else np.asarray(keep, np.bool_).reshape(-1)
  if not r.size == g.size == k.size:
    raise ValueError(f"rho_hat_stats: rewards {r.size}, group_ids {g.size}, keep {k.size}: "
                     "expected equal lengths")
  r, g = r[k], g[k]
  if r.size == 0:
    return float("nan"), float("nan")
  _, inv = np.unique(g, return_inverse=True)
  rho = np.bincount(inv, weights=(r > 0).astype(np.float64)) / np.bincount(inv)  # [groups]
  return float(rho.mean()), float((rho * (1.0 - rho)).mean())


def head_accuracy(scores, labels, threshold: float = 0.5) -> float:
  """Fraction of rollouts with (score > threshold) == label; NaN when empty. Pass sigmoid
  scores (or logits with threshold=0)."""
  s = np.asarray(scores, np.float64).reshape(-1)
  y = check_labels(labels, s.size, "head_accuracy")
  return float(np.mean((s > threshold) == y)) if s.size else float("nan")


def head_auc(scores, labels) -> float:
  """ROC AUC by Mann-Whitney: P(score of a positive > score of a negative), ties count 1/2.
  NaN when either class is absent (AUC is undefined without both)."""
  s = np.asarray(scores, np.float64).reshape(-1)
  y = check_labels(labels, s.size, "head_auc")
  n_pos, n_neg = int(y.sum()), int((~y).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(s, kind="stable")
  ranks = np.empty(s.size, np.float64)
  ranks[order] = np.arange(1, s.size + 1)
  # Mid-ranks for ties: every member of a tie block gets the block's mean rank.
  uniq, inv = np.unique(s, return_inverse=True)
  ranks = (np.bincount(inv, weights=ranks) / np.bincount(inv))[inv]
  u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
  return float(u / (n_pos * n_neg))


def sigmoid(x: np.ndarray) -> np.ndarray:
  """float64 logistic of head logits on the host."""
  return np.exp(-np.logaddexp(0.0, -x))  # no overflow warning for large |x|
