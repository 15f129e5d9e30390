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

The rooms of ARRoL in rl/:
  arrol.py       this file: `ArrolConfig`, the `ArrolPruner` (head, its Adam state, the
                 calibrator, the step counter), the engine's prune hook `ArrolHook`, the stop
                 tokens and the detection position.
  arrol_math.py  the calibrator, the survival probabilities, the seeded keep draws and the
                 metrics (rho_hat, accuracy, AUC), with the paper's symbols.
  arrol_head.py  the quality head's training: mean BCE, optax's Adam.

L_detect, the detection length in generated tokens, is `detect_len` (512 in the paper).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from sparrow_jax.args import is_int
from sparrow_jax.rl import arrol_head
from sparrow_jax.rl.arrol_math import (STEER_MODES, BinnedCalibrator, check_labels,
                                       head_accuracy, head_auc, is_num, keep_draws,
                                       rho_hat_stats, sigmoid, survival_probabilities)

__all__ = ["ARROL_MODES", "STEER_MODES", "ArrolConfig", "ArrolHook", "ArrolPruner",
           "Decision", "detection_position", "rho_hat_stats", "stop_token_ids"]

ARROL_MODES = ("head", "random")


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
      if not is_num(getattr(self, f)):
        raise ValueError(f"ArrolConfig.{f}={getattr(self, f)!r}: expected a finite number")
      object.__setattr__(self, f, float(getattr(self, f)))
    for f in ("num_bins", "detect_len", "head_width"):
      v = getattr(self, f)
      if not is_int(v) or v < 1:
        raise ValueError(f"ArrolConfig.{f}={v!r}: expected a positive int")
    if not is_int(self.warmup_steps) or self.warmup_steps < 0:
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


# ----------------------------------------------------------------------------- pruner


@dataclasses.dataclass(frozen=True)
class Decision:
  """Pruning decision for the scored members of one prompt group."""

  keep: np.ndarray  # [n] bool
  p: np.ndarray  # [n] float64 survival probability (1 during warm-up)
  q: np.ndarray  # [n] float64 calibrated success probability (NaN without logits)
  delta: float  # the group's bisection shift (0 during warm-up and in random mode)


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
    if not is_int(seed):
      raise ValueError(f"ArrolPruner seed={seed!r}: expected an int")
    self.config = config
    self.hidden_size = int(hidden_size)
    self.params, self.opt_state = arrol_head.init_head(self.hidden_size, config.head_width,
                                                       config.head_lr, int(seed))
    self.calibrator = BinnedCalibrator(config.num_bins)
    self.step = 0

  @property
  def warming_up(self) -> bool:
    return self.step < self.config.warmup_steps

  def logits(self, hidden) -> np.ndarray:
    """float32 `[...]` head logits of final-normed hidden states `[..., D]` (host copy)."""
    return arrol_head.head_logits(self.params, hidden)

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
      q = self.calibrator.posterior(sigmoid(lg))
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
    if not is_int(steps) or steps < 1:
      raise ValueError(f"ArrolPruner.train: steps={steps!r}: expected a positive int")
    h = np.asarray(hidden)
    if h.ndim != 2 or h.shape[1] != self.hidden_size:
      raise ValueError(f"ArrolPruner.train: hidden shape {h.shape}: expected [N, "
                       f"{self.hidden_size}]")
    y = check_labels(labels, h.shape[0], "ArrolPruner.train")
    n = h.shape[0]
    if n == 0:
      nan = float("nan")
      return {"loss": nan, "acc": nan, "auc": nan, "pos_rate": nan, "n": 0}
    self.params, self.opt_state, loss0, before = arrol_head.train_head(
        self.params, self.opt_state, h, y, lr=self.config.head_lr, steps=steps)
    scores = sigmoid(before)  # [n]
    self.calibrator.update(scores, y)
    return {"loss": loss0, "acc": head_accuracy(scores, y),
            "auc": head_auc(scores, y), "pos_rate": float(y.mean()), "n": n}

  def end_step(self) -> None:
    self.step += 1

  def state_dict(self) -> dict[str, Any]:
    """A pytree of numpy arrays (orbax-ready): step, head params, Adam state, calibrator
    counts. `load_state_dict` of it resumes bit for bit."""
    return {"step": np.asarray(self.step, np.int64),
            **arrol_head.head_state(self.params, self.opt_state),
            "calibrator": {"pos_counts": self.calibrator.pos_counts.copy(),
                           "neg_counts": self.calibrator.neg_counts.copy()}}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restore from `state_dict()` output (or an orbax restore of it). The optimizer state
    may come back as dicts instead of optax's named tuples: `arrol_head.restore_head` matches
    its leaves in order and checks their shapes and dtypes."""
    missing = {"step", "params", "opt_state", "calibrator"} - set(state)
    if missing:
      raise ValueError(f"ArrolPruner.load_state_dict: missing {sorted(missing)}")
    params, opt_state = arrol_head.restore_head(self.params, self.opt_state, state["params"],
                                                state["opt_state"], self.hidden_size)
    calib = dict(self.calibrator.state_dict())
    calib.update({k: np.asarray(v) for k, v in dict(state["calibrator"]).items()})
    self.calibrator.load_state_dict(calib)
    self.params, self.opt_state = params, opt_state
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
    if is_int(v):
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
  if not is_int(detect_len) or detect_len < 1:
    raise ValueError(f"detection_position: detect_len={detect_len!r}: expected a positive int")
  t = np.asarray(token_ids).reshape(-1)
  if t.size < detect_len:
    raise ValueError(f"detection_position: {t.size} generated tokens < detect_len={detect_len}:"
                     " expected a rollout that reached the detection length")
  hits = np.flatnonzero(np.isin(t[:detect_len], np.fromiter(stop_ids, np.int64)))
  return int(hits[-1]) if hits.size else detect_len - 1
