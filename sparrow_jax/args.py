"""Checks of static (Python-side) arguments that several packages share; the lowest layer of
the project, it imports nothing of it.

  is_int       a count: a Python or numpy integer, never a bool.
  as_member    an implementation choice: an Enum member from itself or its string value, with
               a ValueError naming the choices (resolved once, then `match`ed).
  pow2_bucket  a compiled size: a row or token count padded to a power of two, so that a
               jitted function sees a few shapes only, not one per count.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import numpy as np

E = TypeVar("E", bound=enum.Enum)


def is_int(v) -> bool:
  """True for a Python or numpy integer that is not a bool."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def as_member(cls: type[E], value, what: str) -> E:
  """`value` (a member of `cls` or its value) as a member; the ValueError names `what`."""
  if isinstance(value, cls):
    return value
  try:
    return cls(value)
  except ValueError:
    raise ValueError(f"{what}={value!r}: expected a {cls.__name__} or one of "
                     f"{[m.value for m in cls]}") from None


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """max(minimum, the smallest power of two >= n), for a count n >= 1."""
  return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))
