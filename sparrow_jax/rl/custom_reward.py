"""Reward functions named on the command line: `reward=module.path:function` or
`reward=/path/to/file.py:function` (a relative `.py` path is taken from the working directory).

The function has the signature of every verifier in `rewards.py`:

    def my_reward(completion: str, answer: str) -> float

`completion` is the decoded response (special tokens removed), `answer` the prompt's ground
truth as a string (the `answer_key` field of the data, default "answer"); the result is the
per-sequence reward r_i that GRPO turns into advantages (1.0 / 0.0 for a verifier, any float
otherwise). It runs in the scorer's worker threads with the `reward_timeout_s` deadline: an
exception or a timeout counts as reward 0 and is reported in `reward/verifier_errors` /
`reward/verifier_timeouts`, so it should be thread-safe and need no network.

Everything that can be checked without calling the function is checked when the config is
read (file, module, name, callable, two positional arguments), so a typo fails before any
model is loaded.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable

RewardFn = Callable[[str, str], float]


def is_custom_spec(name: str) -> bool:
  """`target:function` with a non-empty target and function name."""
  target, sep, fn = name.rpartition(":")
  return bool(sep and target and fn)


def _load_file(spec: str, target: str):
  path = os.path.abspath(os.path.expanduser(target))
  if not os.path.isfile(path):
    raise ValueError(f"reward={spec!r}: file {path} does not exist; expected "
                     "/path/to/file.py:function")
  # A module name unique to the file, so two reward files called `reward.py` do not clash.
  name = "sparrow_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
  if name in sys.modules:
    return sys.modules[name]
  mspec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(mspec)
  try:
    mspec.loader.exec_module(module)
  except Exception as e:
    raise ValueError(f"reward={spec!r}: importing {path} failed: {type(e).__name__}: "
                     f"{e}") from None
  sys.modules[name] = module
  return module


def _load_module(spec: str, target: str):
  try:
    return importlib.import_module(target)
  except ModuleNotFoundError as e:
    raise ValueError(f"reward={spec!r}: cannot import module {target!r} ({e}); expected "
                     "module.path:function (importable from the working directory or "
                     "PYTHONPATH) or /path/to/file.py:function") from None
  except Exception as e:
    raise ValueError(f"reward={spec!r}: importing {target!r} failed: {type(e).__name__}: "
                     f"{e}") from None


def load_reward(spec: str) -> RewardFn:
  """The function named by `spec` (module docstring), checked; ValueError names the problem."""
  if not is_custom_spec(spec):
    raise ValueError(f"reward={spec!r}: expected module.path:function or "
                     "/path/to/file.py:function")
  target, _, fn_name = spec.rpartition(":")
  is_file = target.endswith(".py") or os.sep in target or target.startswith(".")
  module = _load_file(spec, target) if is_file else _load_module(spec, target)
  fn = getattr(module, fn_name, None)
  if fn is None:
    found = sorted(n for n, v in vars(module).items()
                   if callable(v) and not n.startswith("_") and not inspect.isclass(v))
    raise ValueError(f"reward={spec!r}: {target} has no {fn_name!r}; functions there: "
                     f"{found[:12]}")
  if not callable(fn):
    raise ValueError(f"reward={spec!r}: {fn_name!r} has type {type(fn).__name__}, not a "
                     "function")
  try:
    inspect.signature(fn).bind("completion", "answer")
  except TypeError as e:
    raise ValueError(f"reward={spec!r}: {fn_name} cannot be called as fn(completion, answer) "
                     f"({e}); expected def {fn_name}(completion: str, answer: str) -> float"
                     ) from None
  except ValueError:  # builtins without a signature: accept
    pass
  return fn
