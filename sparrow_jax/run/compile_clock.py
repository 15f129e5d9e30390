"""Seconds this process has spent compiling: jax's lowering of traced programs to MLIR and
the backend's (XLA's) compilation, as `jax.monitoring` reports them.

The trainer logs the difference over each step as `time/compile_s`, so a step whose phase
times include a compilation (the first step; a batch whose padded length falls in a new
bucket; a ladder switch) reads as such. Tracing is not counted: jax reports a nested jit's
trace inside its caller's, so summing trace events would count it twice. Persistent-cache hits
cost no backend compilation and are not counted either.
"""

from __future__ import annotations

import threading

import jax

EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
          "/jax/core/compile/backend_compile_duration")

_lock = threading.Lock()
_total = 0.0
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  global _total
  if event in EVENTS:
    with _lock:
      _total += float(duration_secs)


def seconds() -> float:
  """Compilation seconds so far in this process (counted from the first call on)."""
  global _installed
  with _lock:
    if not _installed:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      _installed = True
    return _total
