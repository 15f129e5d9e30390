"""Verifiers for trainer tests, in a light module: the trainer's verifier processes import
them by name (spawn), so this file imports nothing heavier than the rewards module."""

import re

from sparrow_jax.rl import rewards as rewards_lib

HANG_MARK = "<<hang>>"


def _register(name):
  """`register_reward` that tolerates a second import of this module under another name."""
  def deco(fn):
    if name not in rewards_lib.list_rewards():
      rewards_lib.register_reward(name)(fn)
    return fn
  return deco


@_register("test_flaky_exact")
def flaky_exact(completion: str, answer: str) -> float:
  if len(completion) % 2:
    raise RuntimeError("verifier exploded")
  return rewards_lib.exact_match(completion, answer)


@_register("test_gil_hang")
def gil_hang(completion: str, answer: str) -> float:
  """exact_match, except that a completion carrying HANG_MARK runs a regex with catastrophic
  backtracking (2^60 steps) inside C code that holds the GIL, like sympy on 2^(2^100): no
  thread-based deadline can interrupt it, only killing the process does."""
  if HANG_MARK in completion:
    re.match(r"(a+)+$", "a" * 60 + "b")
  return rewards_lib.exact_match(completion, answer)


@_register("test_parity")
def parity(completion: str, answer: str) -> float:
  """1 for an even-length completion: a deterministic reward whose groups are sometimes
  informative and sometimes not, even for an untrained model (dynamic-sampling tests)."""
  return float(len(completion) % 2 == 0)
