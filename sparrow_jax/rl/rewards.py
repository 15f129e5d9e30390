"""Verifiable rewards for GRPO: a registry of verifiers and DAPO's soft overlong punishment.
The pool that runs a verifier over a batch with a deadline is `verifier_pool.py`.

A reward function maps `(completion: str, answer: str) -> float` (the per-sequence reward r_i
that `grpo.group_advantages` turns into A_i); `reward=module.path:function` or
`reward=/path/to/file.py:function` loads one of your own (`custom_reward.py`). Built-ins:
  math_verify   the last `\\boxed{...}` (else a LaTeX/plain expression) parsed by the
                `math_verify` package and compared with the ground truth by `verify`
                (numeric and symbolic equivalence: `\\frac{1}{2}` == `0.5`).
  boxed_exact   the last `\\boxed{...}` (nested braces handled) compared as a normalised
                string; fast, no sympy.
  exact_match   the whole completion compared with the answer after light normalisation
                (whitespace, case, trailing period, `$`), for the raw synthetic task.
  boxed_or_last_number
                the last `\\boxed{...}` when the completion has one, else its last number
                (lm-eval's "flexible extract"), compared as boxed_exact does: for small
                models that answer correctly in prose but seldom box the answer.

DAPO soft overlong punishment (`overlong_penalty`), counted in tokens: with maximum length
L_max and buffer L_cache, a response of length L gets 0 when L <= L_max - L_cache,
((L_max - L_cache) - L) / L_cache * factor inside the buffer, and -factor beyond L_max.

math-verify's own timeouts use SIGALRM, which only works in the main thread, so the built-in
verifier disables them (`parsing_timeout=None`, `timeout_seconds=None`) and relies on the
deadline of the pool that runs it (`verifier_pool.RewardScorer`). Custom verifiers for the
pool's process backend must be module-level functions (importable by name in a fresh
interpreter; registering them at import time of their module makes `reward=<name>` work).
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Sequence

import numpy as np

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator adding `fn(completion, answer) -> float` to the registry under `name`."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"register_reward: name={name!r}; expected a non-empty string")

  def deco(fn: RewardFn) -> RewardFn:
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"register_reward: name={name!r} is already registered to "
                       f"{_REGISTRY[name]!r}; expected a new name")
    _REGISTRY[name] = fn
    return fn

  return deco


def get_reward(name: str) -> RewardFn:
  """A registered verifier, or a custom one given as `module.path:function` /
  `/path/to/file.py:function` (see `custom_reward.py` for the signature)."""
  from sparrow_jax.rl import custom_reward

  if name not in _REGISTRY and custom_reward.is_custom_spec(name):
    return custom_reward.load_reward(name)
  if name not in _REGISTRY:
    raise ValueError(f"get_reward: name={name!r} is not registered; expected one of "
                     f"{sorted(_REGISTRY)}, module.path:function or /path/to/file.py:function")
  return _REGISTRY[name]


def list_rewards() -> list[str]:
  return sorted(_REGISTRY)


def is_registered(name: str) -> bool:
  """True when `name` is a registered verifier (not a custom `module:function` spec)."""
  return name in _REGISTRY


# ----------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces balanced; None when
  there is none or its braces never close."""
  starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      c = text[i]
      if c == "{":
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 0:
          return text[start:i]
    # unbalanced: try an earlier box
  return None


def normalize_answer(text: str) -> str:
  """Light normalisation: strip `$`, surrounding whitespace and a trailing period, collapse
  inner whitespace, lower-case, drop `\\left`/`\\right` and thousands separators in numbers."""
  s = text.strip().strip("$").strip()
  s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "")
  s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
  s = re.sub(r"\s+", " ", s).rstrip(".").strip()
  return s.lower()


# ----------------------------------------------------------------------------- built-ins


@register_reward("exact_match")
def exact_match(completion: str, answer: str) -> float:
  return float(normalize_answer(completion) == normalize_answer(answer))


def _matches(pred: str | None, answer: str) -> float:
  """1.0 when `pred` equals the answer (its last box, if it has one) after normalisation."""
  if pred is None:
    return 0.0
  gold = last_boxed(answer)
  gold = answer if gold is None else gold
  return float(normalize_answer(pred) == normalize_answer(gold))


@register_reward("boxed_exact")
def boxed_exact(completion: str, answer: str) -> float:
  return _matches(last_boxed(completion), answer)


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> str | None:
  """The last number written in `text` (sign, thousands separators and decimals kept, a
  trailing period dropped), or None when there is none."""
  found = _NUMBER.findall(text)
  return found[-1] if found else None


@register_reward("boxed_or_last_number")
def boxed_or_last_number(completion: str, answer: str) -> float:
  pred = last_boxed(completion)
  return _matches(last_number(completion) if pred is None else pred, answer)


class _DropDisabledTimeoutWarning(logging.Filter):
  """math-verify warns once that its timeout is disabled; the scorer enforces its own."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


@register_reward("math_verify")
def math_verify_reward(completion: str, answer: str) -> float:
  """1.0 when `math_verify.verify(parse(gold), parse(completion))`; thread-safe (no signals)."""
  from math_verify import parse, verify  # sympy import is slow; pay it on first use

  gold_text = answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"
  gold = parse(gold_text, parsing_timeout=None)
  if not gold:
    return 0.0
  pred = parse(completion, parsing_timeout=None)
  if not pred:
    return 0.0
  return float(verify(gold, pred, timeout_seconds=None))


# ----------------------------------------------------------------------------- overlong


def overlong_penalty(lengths: np.ndarray | Sequence[int], *, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> np.ndarray:
  """DAPO soft overlong punishment for response lengths in tokens -> float32 [B] (<= 0)."""
  if not isinstance(max_len, int) or max_len <= 0:
    raise ValueError(f"overlong_penalty: max_len={max_len!r}; expected a positive int")
  if not isinstance(buffer_len, int) or not 0 < buffer_len <= max_len:
    raise ValueError(f"overlong_penalty: buffer_len={buffer_len!r}; expected an int in "
                     f"(0, max_len={max_len}]")
  if penalty_factor < 0:
    raise ValueError(f"overlong_penalty: penalty_factor={penalty_factor!r}; expected >= 0")
  lengths = np.asarray(lengths, dtype=np.float64)  # [B]
  start = max_len - buffer_len
  inside = (start - lengths) / buffer_len * penalty_factor
  pen = np.where(lengths <= start, 0.0, np.where(lengths <= max_len, inside, -penalty_factor))
  return pen.astype(np.float32)
