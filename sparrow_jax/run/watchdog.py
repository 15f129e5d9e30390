"""Heartbeats of a multi-process job: a lost or failed peer ends every process, in bounded time.

`Watchdog` writes this process's counter to the coordination service's key-value store and
watches the others'. A peer that stops beating (killed, hung, lost its host) or reports a
failure ends this process with exit status 1 and one line naming it, also while the main
thread waits in a collective that will never complete. `run/distributed.py` starts one when
it joins a job (`initialize`) and writes this process's final state (`finish`,
`report_failure`); the runtime's own heartbeat timeout stays a little longer as the backstop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import jax

_KV_PREFIX = "sparrow_jax/heartbeat/"


class Watchdog:
  """Heartbeats of every process through the coordination service's key-value store.

  A daemon thread writes this process's counter every `interval_s`; a peer whose counter
  has not moved for `timeout_s`, or that wrote a failure, ends this process (exit status 1,
  one line on stderr naming the peer) — also while the main thread is blocked in a
  collective that will never complete. A peer that wrote "done" is no longer watched. Losing
  the coordinator (process 0) makes the store unreachable: that ends the process as well.
  """

  def __init__(self, *, timeout_s: float, interval_s: float = 1.0, client=None,
               index: int | None = None, count: int | None = None,
               on_lost: Callable[[str], None] | None = None, clock=time.monotonic):
    if client is None:
      from jax._src import distributed as _dist
      client = _dist.global_state.client
      if client is None or not hasattr(client, "key_value_try_get"):
        raise AttributeError("jax's distributed client has no key-value store here")
    self.client, self.timeout_s, self.interval_s, self.clock = client, timeout_s, interval_s, clock
    self.index = jax.process_index() if index is None else index
    self.count = jax.process_count() if count is None else count
    self.on_lost = on_lost or (lambda msg: _die(msg, self.index))
    self._beat = 0
    self._stopped: str | None = None  # final state written: no more beats
    self._watching = True
    self._seen = {j: (None, clock()) for j in range(self.count) if j != self.index}
    self._thread = threading.Thread(target=self._run, name="sparrow-watchdog", daemon=True)

  def start(self) -> None:
    self.beat()
    self._thread.start()  # (a daemon: it keeps watching while the interpreter exits)

  def beat(self) -> None:
    if self._stopped is None:
      self._beat += 1
      self.client.key_value_set(f"{_KV_PREFIX}{self.index}", str(self._beat),
                                allow_overwrite=True)

  def stop(self, state: str, *, watch: bool = False) -> None:
    """Write a final state ("done" or "failed: ...") and stop beating (and watching, unless
    `watch`)."""
    self._watching = watch
    if self._stopped is None:
      self._stopped = state
      try:
        self.client.key_value_set(f"{_KV_PREFIX}{self.index}", state, allow_overwrite=True)
      except Exception:  # the coordinator may be gone already: nothing left to tell
        pass

  def check(self) -> str | None:
    """One look at the peers: a message naming a lost or failed peer, or None."""
    now = self.clock()
    for j, (last, since) in list(self._seen.items()):
      try:
        val = self.client.key_value_try_get(f"{_KV_PREFIX}{j}")
      except Exception as e:  # NOT_FOUND before its first beat; anything else: store gone
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
          val = None
        else:
          return (f"lost the coordinator (process 0): the coordination service stopped "
                  f"answering ({str(e).splitlines()[0][:200]})")
      if val == "done":
        del self._seen[j]
        continue
      if val is not None and val.startswith("failed"):
        return f"process {j} of {self.count} {val}"
      if val != last:
        self._seen[j] = (val, now)
      elif now - since > self.timeout_s:
        return (f"lost process {j} of {self.count}: no heartbeat for {now - since:.0f} s "
                f"(--heartbeat-timeout {self.timeout_s:g})")
    return None

  def _run(self) -> None:
    while self._watching:
      time.sleep(self.interval_s)
      if not self._watching:
        return
      try:
        self.beat()
      except Exception as e:
        msg = (f"lost the coordinator (process 0): the coordination service stopped "
               f"answering ({str(e).splitlines()[0][:200]})")
      else:
        msg = self.check()
      if msg is not None and self._watching:
        self.on_lost(msg)
        return


def _die(message: str, index: int) -> None:
  # (no jax call here: the main thread may be tearing the backend down)
  print(f"error: {message}; this process (index {index}) stops. Resume the run with "
        "--resume once every host is back.", file=sys.stderr, flush=True)
  os._exit(1)
