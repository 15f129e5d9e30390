"""ARRoL: online rollout pruning with a learned quality head ("Prune as You Generate").

The pure building blocks that the engine and the trainer call; nothing here touches the
engine. One RL step with ARRoL (Sec. 4.3, Algorithm 1):

  1. The engine decodes every rollout of a prompt group up to the detection length
     L_detect, keeping the final-normed hidden state at the last stop token at or before it
     (`detection_position`, `stop_token_ids`), and evaluates the quality head there
     (`sparrow_jax.models.quality_head.quality_logits`, inside the decode step).
  2. When every member of a group has reached L_detect or finished, it calls
     `ArrolPruner.decide(logits, keys)` once for the members still running; pruned ones
     leave the engine at once. Members that finished before L_detect are kept.
  3. The trainer updates the policy on the survivors, then `ArrolPruner.train(hidden,
     labels)` on the rollouts that got a reward (label = reward > 0), then `end_step()`.

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
  L_detect   detection length in generated tokens (`detect_len`, 512 in the paper).
  rho_hat    fraction of positive rollouts among a group's kept ones (`rho_hat_stats`).

Calibration sees only rollouts that survived pruning, but that selection depends on the
score (its bin) alone, so within a bin positives and negatives are kept at the same rate
and q_b = P(y=1 | b) is unchanged by it (up to the spread of p inside a bin).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.models.quality_head import (check_quality_head, init_quality_head,
                                             quality_logits)

ARROL_MODES = ("head", "random")
STEER_MODES = ("paper", "signed")
_DRAW_DOMAIN = 0x4152524F  # "ARRO": keeps these uniforms apart from other uses of a key tuple


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
      v, (bool, np.bool_)) and math.isfinite(float(v))


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrolConfig:
  """ARRoL hyper-parameters (paper symbols in the module docstring)."""

  mode: str = "head"  # "head": survival from the calibrated head; "random": p_i = kappa
  keep_rate: float = 0.5  # kappa
  target: float = 0.5  # rho
  lam: float = 0.5  # lambda
  p_min: float = 0.25
  p_max: float = 0.75
  num_bins: int = 128  # B
  warmup_steps: int = 20  # steps without pruning while the head and calibrator learn
  detect_len: int = 512  # L_detect, generated tokens
  head_lr: float = 0.01  # Adam, as in the authors' code
  head_width: int = 128  # W
  steer: str = "paper"  # "paper": lambda (rho - q_i); "signed": times sign(mean q - rho)

  def __post_init__(self):
    if self.mode not in ARROL_MODES:
      raise ValueError(f"ArrolConfig.mode={self.mode!r}: expected one of {ARROL_MODES}")
    if self.steer not in STEER_MODES:
      raise ValueError(f"ArrolConfig.steer={self.steer!r}: expected one of {STEER_MODES}")
    for f in ("keep_rate", "target", "lam", "p_min", "p_max", "head_lr"):
      if not _is_num(getattr(self, f)):
        raise ValueError(f"ArrolConfig.{f}={getattr(self, f)!r}: expected a finite number")
      object.__setattr__(self, f, float(getattr(self, f)))
    for f in ("num_bins", "detect_len", "head_width"):
      v = getattr(self, f)
      if not _is_int(v) or v < 1:
        raise ValueError(f"ArrolConfig.{f}={v!r}: expected a positive int")
    if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
      raise ValueError(f"ArrolConfig.warmup_steps={self.warmup_steps!r}: expected an int >= 0")
    if not 0.0 < self.keep_rate <= 1.0:
      raise ValueError(f"ArrolConfig.keep_rate={self.keep_rate}: expected in (0, 1]")
    if not 0.0 <= self.target <= 1.0:
      raise ValueError(f"ArrolConfig.target={self.target}: expected in [0, 1]")
    if self.lam < 0.0:
      raise ValueError(f"ArrolConfig.lam={self.lam}: expected >= 0")
    if not 0.0 <= self.p_min <= self.p_max <= 1.0:
      raise ValueError(f"ArrolConfig.p_min={self.p_min}, p_max={self.p_max}: expected "
                       "0 <= p_min <= p_max <= 1")
    if not self.p_min <= self.keep_rate <= self.p_max:
      raise ValueError(f"ArrolConfig.keep_rate={self.keep_rate}: expected within [p_min, p_max]"
                       f" = [{self.p_min}, {self.p_max}] (otherwise no delta makes the mean "
                       "survival probability equal kappa)")
    if not self.head_lr > 0.0:
      raise ValueError(f"ArrolConfig.head_lr={self.head_lr}: expected > 0")

  def replace(self, **kw) -> "ArrolConfig":
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ArrolConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"ArrolConfig: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return cls(**d)


# ----------------------------------------------------------------------------- calibration


def _scores(scores, what: str) -> np.ndarray:
  s = np.asarray(scores, np.float64).reshape(-1)
  bad = ~np.isfinite(s) | (s < 0.0) | (s > 1.0)
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{what}: score[{i}]={float(s[i])!r}: expected a finite value in [0, 1] "
                     "(sigmoid of the head logit)")
  return s


def _labels(labels, n: int, what: str) -> np.ndarray:
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
    if not _is_int(num_bins) or num_bins < 1:
      raise ValueError(f"BinnedCalibrator.num_bins={num_bins!r}: expected a positive int")
    if not _is_num(alpha) or alpha <= 0:
      raise ValueError(f"BinnedCalibrator.alpha={alpha!r}: expected a finite number > 0 "
                       "(Laplace smoothing keeps empty bins well defined)")
    self.num_bins = int(num_bins)
    self.alpha = float(alpha)
    self.pos_counts = np.zeros(self.num_bins, np.int64)  # [B] past positive scores per bin
    self.neg_counts = np.zeros(self.num_bins, np.int64)  # [B] past negative scores per bin

  def bins(self, scores) -> np.ndarray:
    """int64 `[n]` bin index of each score."""
    s = _scores(scores, "BinnedCalibrator.bins")
    return np.minimum((s * self.num_bins).astype(np.int64), self.num_bins - 1)

  def update(self, scores, labels) -> None:
    """Add labelled scores (label True/1 = positive rollout, i.e. reward > 0)."""
    b = self.bins(scores)
    y = _labels(labels, b.size, "BinnedCalibrator.update")
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
    if not _is_num(v):
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
  if isinstance(key, (str, bytes)) or not key or not all(_is_int(k) and k >= 0 for k in key):
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


# ----------------------------------------------------------------------------- pruner


@dataclasses.dataclass(frozen=True)
class Decision:
  """Pruning decision for the scored members of one prompt group."""

  keep: np.ndarray  # [n] bool
  p: np.ndarray  # [n] float64 survival probability (1 during warm-up)
  q: np.ndarray  # [n] float64 calibrated success probability (NaN without logits)
  delta: float  # the group's bisection shift (0 during warm-up and in random mode)


def _bce_step(tx: optax.GradientTransformation, params, opt_state, hidden_ND, labels_N,
              weight_N):
  """One Adam step on the mean BCE over rows with weight 1 (padding rows have weight 0)."""

  def loss_fn(p):
    logits = quality_logits(p, hidden_ND)  # [N]
    per = optax.sigmoid_binary_cross_entropy(logits, labels_N)  # [N] float32
    return jnp.sum(per * weight_N) / jnp.maximum(jnp.sum(weight_N), 1.0), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, logits


# Module-level jits, keyed on the (cached, hence identical) optimizer: every pruner with the
# same head_lr shares compiled programs instead of compiling its own.
_jit_logits = jax.jit(quality_logits)
_jit_bce_step = jax.jit(_bce_step, static_argnums=0)


@functools.lru_cache(maxsize=None)
def _adam(lr: float) -> optax.GradientTransformation:
  return optax.adam(lr)


@functools.lru_cache(maxsize=None)
def _init_head(hidden_size: int, width: int, lr: float):
  def init(key):  # one compiled program instead of a dozen eager ones
    params = init_quality_head(key, hidden_size, width)
    return params, _adam(lr).init(params)
  return jax.jit(init)


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return np.exp(-np.logaddexp(0.0, -x))  # no overflow warning for large |x|


def _bucket(n: int) -> int:
  """Rows padded to a power of two (>= 8) so the jitted step compiles a few shapes only."""
  return max(8, 1 << max(0, (n - 1).bit_length()))


class ArrolPruner:
  """Quality-head parameters, their Adam state, the calibrator and the step counter.

  Args:
    config: `ArrolConfig`.
    hidden_size: D of the policy (the head's input width).
    seed: seeds the head initialisation only (draws use the caller's keys).
  """

  def __init__(self, config: ArrolConfig, hidden_size: int, seed: int):
    if not isinstance(config, ArrolConfig):
      raise ValueError(f"ArrolPruner config={config!r}: expected an ArrolConfig")
    if not _is_int(seed):
      raise ValueError(f"ArrolPruner seed={seed!r}: expected an int")
    self.config = config
    self.hidden_size = int(hidden_size)
    self._tx = _adam(config.head_lr)
    self.params, self.opt_state = _init_head(self.hidden_size, config.head_width,
                                             config.head_lr)(jax.random.key(int(seed)))
    self.calibrator = BinnedCalibrator(config.num_bins)
    self.step = 0

  @property
  def warming_up(self) -> bool:
    return self.step < self.config.warmup_steps

  def logits(self, hidden) -> np.ndarray:
    """float32 `[...]` head logits of final-normed hidden states `[..., D]` (host copy)."""
    return np.asarray(_jit_logits(self.params, jnp.asarray(hidden)))

  def decide(self, logits, keys: Sequence[Sequence[int]]) -> Decision:
    """Keep/prune the `n` scored members of ONE group.

    Args:
      logits: float `[n]` head logits at the detection point, or None (allowed in random
        mode and during warm-up; q is then NaN).
      keys: n draw keys (tuples of non-negative ints, e.g. (run_seed, step, prompt, sample)).

    During warm-up (step < warmup_steps) every member is kept (p = 1), in both modes, so
    that head and random pruning start at the same step. In random mode p_i = kappa.
    """
    cfg = self.config
    n = len(keys)
    if logits is None:
      if cfg.mode == "head" and not self.warming_up:
        raise ValueError("ArrolPruner.decide: logits=None in mode='head' after warm-up: "
                         "expected the head logits of the group's members")
      q = np.full(n, np.nan)
    else:
      lg = np.asarray(logits, np.float64).reshape(-1)
      if lg.size != n or not np.isfinite(lg).all():
        raise ValueError(f"ArrolPruner.decide: logits {lg.tolist()} for {n} keys: expected "
                         "one finite logit per key")
      q = self.calibrator.posterior(_sigmoid(lg))
    if self.warming_up:
      return Decision(np.ones(n, np.bool_), np.ones(n), q, 0.0)
    if cfg.mode == "random":
      p, delta = np.full(n, cfg.keep_rate), 0.0
    else:
      p, delta = survival_probabilities(q, keep_rate=cfg.keep_rate, target=cfg.target,
                                        lam=cfg.lam, p_min=cfg.p_min, p_max=cfg.p_max,
                                        steer=cfg.steer)
    return Decision(keep_draws(p, keys), p, q, delta)

  def train(self, hidden, labels, *, steps: int = 1) -> dict[str, float]:
    """`steps` Adam steps of BCE on `hidden` `[N, D]` (final-normed, detection point) against
    `labels` `[N]` (reward > 0), then the calibrator learns from sigmoid(logits) of these
    samples computed BEFORE the update.

    Why before: at decision time the head scores rollouts it has not been trained on; the
    pre-update scores are out-of-sample in the same way, while post-update scores are fitted
    to these very labels and would make the calibrator overconfident. The same pre-update
    scores give honest `acc` / `auc` metrics.

    Returns {"loss": mean BCE before the update, "acc", "auc" (of the pre-update scores),
    "pos_rate", "n"} (NaN entries when N = 0; nothing changes then).
    """
    if not _is_int(steps) or steps < 1:
      raise ValueError(f"ArrolPruner.train: steps={steps!r}: expected a positive int")
    h = np.asarray(hidden)
    if h.ndim != 2 or h.shape[1] != self.hidden_size:
      raise ValueError(f"ArrolPruner.train: hidden shape {h.shape}: expected [N, "
                       f"{self.hidden_size}]")
    y = _labels(labels, h.shape[0], "ArrolPruner.train")
    n = h.shape[0]
    if n == 0:
      nan = float("nan")
      return {"loss": nan, "acc": nan, "auc": nan, "pos_rate": nan, "n": 0}
    rows = _bucket(n)
    h_pad = np.zeros((rows, self.hidden_size), np.float32)  # [rows, D]
    h_pad[:n] = h
    y_pad = np.zeros(rows, np.float32)  # [rows]
    y_pad[:n] = y
    w_pad = (np.arange(rows) < n).astype(np.float32)  # [rows]
    loss0, before = None, None
    for _ in range(steps):
      self.params, self.opt_state, loss, lg = _jit_bce_step(self._tx, self.params,
                                                            self.opt_state, h_pad, y_pad, w_pad)
      if before is None:
        loss0, before = float(loss), np.asarray(lg)[:n].astype(np.float64)
    scores = _sigmoid(before)  # [n]
    self.calibrator.update(scores, y)
    return {"loss": loss0, "acc": head_accuracy(scores, y),
            "auc": head_auc(scores, y), "pos_rate": float(y.mean()), "n": n}

  def end_step(self) -> None:
    self.step += 1

  def state_dict(self) -> dict[str, Any]:
    """A pytree of numpy arrays (orbax-ready): step, head params, Adam state, calibrator
    counts. `load_state_dict` of it resumes bit for bit."""
    return {"step": np.asarray(self.step, np.int64),
            "params": {k: np.asarray(v) for k, v in self.params.items()},
            "opt_state": jax.tree.map(np.asarray, self.opt_state),
            "calibrator": {"pos_counts": self.calibrator.pos_counts.copy(),
                           "neg_counts": self.calibrator.neg_counts.copy()}}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restore from `state_dict()` output (or an orbax restore of it). The optimizer state
    may come back as dicts instead of optax's named tuples: its leaves are matched in order
    and checked for shape and dtype."""
    missing = {"step", "params", "opt_state", "calibrator"} - set(state)
    if missing:
      raise ValueError(f"ArrolPruner.load_state_dict: missing {sorted(missing)}")
    params = {k: np.asarray(v) for k, v in dict(state["params"]).items()}
    check_quality_head(params, self.hidden_size)
    ref = jax.tree.leaves(self.opt_state)
    got = jax.tree.leaves(state["opt_state"])
    if len(ref) != len(got):
      raise ValueError(f"ArrolPruner.load_state_dict: opt_state has {len(got)} leaves: "
                       f"expected {len(ref)} (Adam on the head)")
    for i, (r, g) in enumerate(zip(ref, got)):
      if np.shape(r) != np.shape(g) or np.asarray(g).dtype != r.dtype:
        raise ValueError(f"ArrolPruner.load_state_dict: opt_state leaf {i} is "
                         f"{np.asarray(g).dtype}{list(np.shape(g))}: expected "
                         f"{r.dtype}{list(np.shape(r))}")
    calib = dict(self.calibrator.state_dict())
    calib.update({k: np.asarray(v) for k, v in dict(state["calibrator"]).items()})
    self.calibrator.load_state_dict(calib)
    for k, v in params.items():
      if v.dtype != self.params[k].dtype:
        raise ValueError(f"ArrolPruner.load_state_dict: params {k} dtype {v.dtype}: expected "
                         f"{self.params[k].dtype}")
    self.params = {k: jnp.asarray(v) for k, v in params.items()}
    self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state),
                                        [jnp.asarray(g) for g in got])
    self.step = int(np.asarray(state["step"]))


class ArrolHook:
  """The engine's prune hook (`sparrow_jax.engine.pruning.PruneHook`) for one rollout step:
  `pruner.decide` per prompt group, with draw keys (run seed, step, prompt, sample) taken
  from request ids `(prompt_index, sample_index)`; every decision is kept for the metrics."""

  def __init__(self, pruner: ArrolPruner, stop_ids: frozenset, *, seed: int, step: int):
    self.pruner = pruner
    self.detect_len = pruner.config.detect_len
    self.stop_ids = frozenset(int(t) for t in stop_ids)
    # The head runs inside the decode step only when its scores are used.
    self.head_params = pruner.params if pruner.config.mode == "head" else None
    self.seed, self.step = int(seed) & 0x7FFFFFFF, int(step)
    self.decisions: list[tuple[Any, list, Decision]] = []

  def decide(self, group, candidates) -> np.ndarray:
    keys = [(self.seed, self.step, *[int(x) for x in c.request_id]) for c in candidates]
    logits = None
    if self.head_params is not None:
      logits = np.asarray([c.logit for c in candidates], np.float64)
    d = self.pruner.decide(logits, keys)
    self.decisions.append((group, [c.request_id for c in candidates], d))
    return d.keep

  def metrics(self) -> dict[str, float]:
    """Mean shift delta over decided groups and the fraction of candidates kept."""
    if not self.decisions:
      return {"arrol/delta": float("nan"), "arrol/candidates": 0}
    keep = np.concatenate([d.keep for _, _, d in self.decisions])
    return {"arrol/delta": float(np.mean([d.delta for _, _, d in self.decisions])),
            "arrol/candidates": int(keep.size),
            "arrol/candidate_kept_frac": float(keep.mean())}


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
  y = _labels(labels, s.size, "head_accuracy")
  return float(np.mean((s > threshold) == y)) if s.size else float("nan")


def head_auc(scores, labels) -> float:
  """ROC AUC by Mann-Whitney: P(score of a positive > score of a negative), ties count 1/2.
  NaN when either class is absent (AUC is undefined without both)."""
  s = np.asarray(scores, np.float64).reshape(-1)
  y = _labels(labels, s.size, "head_auc")
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


# ----------------------------------------------------------------------------- stop tokens

_STOP_CHARS = (".", "!", "?", "\n")


def _ends_sentence(text: str) -> bool:
  # Trailing spaces/tabs after the punctuation still end the sentence within the token.
  t = text.rstrip(" \t")
  return bool(t) and t[-1] in _STOP_CHARS


def stop_token_ids(tokenizer) -> frozenset[int]:
  """Ids of tokens whose text ends with ".", "!", "?" or a newline (ignoring trailing spaces
  and tabs): the candidate detection points of ARRoL. Special tokens are excluded.

  Each id is decoded on its own, so byte-level BPE markers ("Ċ" for "\\n", "Ġ" for a space)
  and SentencePiece byte fallback ("<0x0A>") come out as the characters they stand for.
  Works for transformers tokenizers and `sparrow_jax.rl.tokenizers.ByteTokenizer` (any
  object with `decode(ids)` and `len()` or `vocab_size`). Scans the vocabulary once: call it
  once per tokenizer.
  """
  try:
    size = len(tokenizer)
  except TypeError:
    size = int(tokenizer.vocab_size)
  special = set(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
  for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
    v = getattr(tokenizer, name, None)
    if _is_int(v):
      special.add(int(v))
  ids = [i for i in range(size) if i not in special]
  if hasattr(tokenizer, "batch_decode"):
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
  else:
    texts = [tokenizer.decode([i]) for i in ids]
  return frozenset(i for i, t in zip(ids, texts) if _ends_sentence(t))


def detection_position(token_ids, stop_ids: frozenset[int], detect_len: int) -> int:
  """Index (into the generated tokens) of the hidden state the head scores: the last stop
  token among the first `detect_len` generated tokens, or `detect_len - 1` when there is
  none (then the head sees the state at L_detect). Needs len(token_ids) >= detect_len;
  rollouts that end earlier are not scored (they are kept)."""
  if not _is_int(detect_len) or detect_len < 1:
    raise ValueError(f"detection_position: detect_len={detect_len!r}: expected a positive int")
  t = np.asarray(token_ids).reshape(-1)
  if t.size < detect_len:
    raise ValueError(f"detection_position: {t.size} generated tokens < detect_len={detect_len}:"
                     " expected a rollout that reached the detection length")
  hits = np.flatnonzero(np.isin(t[:detect_len], np.fromiter(stop_ids, np.int64)))
  return int(hits[-1]) if hits.size else detect_len - 1
