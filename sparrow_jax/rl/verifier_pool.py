"""The verifier pool: runs a reward function over a batch in worker threads or processes with
a per-item deadline, so that a verifier that raises, hangs or crashes never stops training.

`score_batch` / `RewardScorer` take a verifier (a function `(completion, answer) -> float` or
a name `rewards.get_reward` resolves) and return a `ScoreResult`: an item that raises or runs
past its deadline (`timeout_s`) gets reward 0 and is counted in `num_errors` /
`num_timeouts`. A thread that hangs is abandoned (daemon; replaced by a fresh worker); a hung
process worker is killed. Use `backend="process"` when a verifier can hang inside C code
holding the GIL (e.g. sympy evaluating 2^(2^100)): only a process can be stopped then. The
trainer keeps one process pool for the whole run. Custom verifiers for the process backend
must be module-level functions (importable by name in a fresh interpreter).
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from typing import Sequence

import numpy as np

from sparrow_jax.rl.rewards import RewardFn, get_reward, is_registered

_START_TIMEOUT_S = 120.0  # a process worker must import its verifier within this


@dataclasses.dataclass(frozen=True)
class ScoreResult:
  """Rewards float32 [B] (0 where the verifier failed) and failure counts for the metrics."""

  rewards: np.ndarray
  num_errors: int
  num_timeouts: int
  errors: tuple[str, ...] = ()  # first few "index: ExcType: message", for logs

  def metrics(self, prefix: str = "reward/") -> dict[str, float]:
    return {f"{prefix}num_errors": float(self.num_errors),
            f"{prefix}num_timeouts": float(self.num_timeouts)}


def _call(fn: RewardFn, completion: str, answer: str) -> tuple[bool, float | str]:
  try:
    value = float(fn(completion, answer))
    if not np.isfinite(value):
      return False, f"ValueError: non-finite reward {value!r}"
    return True, value
  except BaseException as e:  # noqa: BLE001 - a verifier must never stop training
    return False, f"{type(e).__name__}: {e}"


def _thread_worker(fn: RewardFn, inbox: queue.Queue, outbox: queue.Queue, wid: int):
  while True:
    item = inbox.get()
    if item is None:
      return
    i, completion, answer = item
    outbox.put((wid, i) + _call(fn, completion, answer))


def _process_worker(fn: RewardFn | str, conn) -> None:
  if isinstance(fn, str):  # a custom spec (file.py:function): loaded here, not unpickled
    try:
      fn = get_reward(fn)
    except ValueError:
      return  # the parent reports a worker that exits while starting
  conn.send(("ready",))  # fn (and its module) is imported by now
  while True:
    try:
      item = conn.recv()
    except EOFError:
      return
    if item is None:
      return
    i, completion, answer = item
    conn.send((i,) + _call(fn, completion, answer))


class _ThreadWorker:
  ready = True  # a thread shares this process's imports: nothing to wait for

  def __init__(self, fn: RewardFn, outbox: queue.Queue, wid: int):
    self.wid = wid
    self.inbox: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=_thread_worker, args=(fn, self.inbox, outbox, wid),
                                   daemon=True, name=f"reward-worker-{wid}")
    self.thread.start()

  def submit(self, item):
    self.inbox.put(item)

  def abandon(self):
    self.inbox.put(None)  # it exits once (if ever) the hung call returns; result is ignored

  close = abandon


class _ProcessWorker:

  def __init__(self, fn: RewardFn, ctx, wid: int):
    self.wid = wid
    self.dead = False
    self.ready = False  # set once the child has imported `fn` and said so
    self.started_at = time.monotonic()
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_process_worker, args=(fn, child), daemon=True,
                            name=f"reward-worker-{wid}")
    try:
      self.proc.start()
    except Exception as e:  # e.g. a lambda or closure cannot be pickled for "spawn"
      raise ValueError(f"RewardScorer.fn={fn!r} cannot be sent to a worker process ({e}); "
                       f"expected a module-level function for backend='process'") from e
    finally:
      child.close()

  def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
    """Blocks until the child has imported `fn`, so start-up is not charged to a deadline."""
    if self.ready:
      return
    left = self.started_at + timeout_s - time.monotonic()
    if not self.conn.poll(max(left, 0.0)):
      self.abandon()
      raise RuntimeError(f"reward worker {self.wid} did not start within {timeout_s} s")
    self.on_message()

  def on_message(self):
    """Reads one message; the first is the start-up handshake (returns None), then results."""
    try:
      msg = self.conn.recv()
    except (EOFError, OSError):
      if not self.ready:
        self.abandon()
        raise RuntimeError(f"reward worker {self.wid} exited while starting (exit code "
                           f"{self.proc.exitcode}); could it import the reward function? "
                           "Custom verifiers must be module-level functions, and a script that "
                           "trains must guard its entry point with `if __name__ == "
                           "'__main__':` (workers are started with 'spawn', which imports the "
                           "main script)") from None
      raise
    if msg == ("ready",):
      self.ready = True
      return None
    return msg

  def submit(self, item):
    self.conn.send(item)

  def abandon(self):
    self.proc.kill()
    self.proc.join(timeout=5)
    self.conn.close()

  def close(self):
    try:
      self.conn.send(None)
    except (BrokenPipeError, OSError):
      pass
    self.proc.join(timeout=2)
    if self.proc.is_alive():
      self.proc.kill()
      self.proc.join(timeout=5)
    self.conn.close()


class RewardScorer:
  """Persistent pool that scores batches with a per-item deadline; reuse it across steps.

  `fn` must be picklable (a module-level function, or a registered name whose module registers
  it on import) for `backend="process"`; processes are started with "spawn" (fork is unsafe
  once JAX has started its threads). A process worker that runs past its deadline is killed
  and a replacement started at once without waiting for it: the other workers go on with the
  batch, and the replacement joins when it has imported `fn`. `close()` (or the context
  manager) stops the workers; an `atexit` hook does it for a pool left open.
  """

  def __init__(self, fn: RewardFn | str, *, timeout_s: float = 10.0, num_workers: int = 4,
               backend: str = "thread", max_logged_errors: int = 8):
    # A custom verifier given by spec (`/path/file.py:function`, `module:function`) is sent to
    # process workers as the spec, so each child loads it itself: a function loaded from a
    # file path cannot be unpickled by name in a fresh process.
    self._spec = None
    if isinstance(fn, str):
      from sparrow_jax.rl import custom_reward
      if custom_reward.is_custom_spec(fn) and not is_registered(fn):
        self._spec = fn
      fn = get_reward(fn)
    if not callable(fn):
      raise ValueError(f"RewardScorer.fn={fn!r}: expected a callable or a registered name")
    if not timeout_s > 0:
      raise ValueError(f"RewardScorer.timeout_s={timeout_s!r}: expected > 0 seconds")
    if not isinstance(num_workers, int) or num_workers <= 0:
      raise ValueError(f"RewardScorer.num_workers={num_workers!r}: expected a positive int")
    if backend not in ("thread", "process"):
      raise ValueError(f"RewardScorer.backend={backend!r}: expected 'thread' or 'process'")
    self.fn, self.timeout_s, self.backend = fn, float(timeout_s), backend
    self.max_logged_errors = max_logged_errors
    self._next_wid = 0
    self._outbox: queue.Queue = queue.Queue()
    self._ctx = multiprocessing.get_context("spawn") if backend == "process" else None
    self._workers = []
    atexit.register(self.close)
    try:
      for _ in range(num_workers):
        self._workers.append(self._new_worker())
      if backend == "process":
        for w in self._workers:  # started together, awaited together
          w.wait_ready()
    except Exception:
      self.close()
      raise

  def _new_worker(self):
    self._next_wid += 1
    if self.backend == "thread":
      return _ThreadWorker(self.fn, self._outbox, self._next_wid)
    return _ProcessWorker(self._spec or self.fn, self._ctx, self._next_wid)

  def _wait(self, busy: dict, starting: list, timeout: float
            ) -> list[tuple[int, int, bool, object]]:
    """Results ready within `timeout` as (worker id, index, ok, value); process workers that
    finish starting meanwhile are marked ready."""
    out = []
    if self.backend == "thread":
      try:
        out.append(self._outbox.get(timeout=max(timeout, 0.0)))
        while True:
          out.append(self._outbox.get_nowait())
      except queue.Empty:
        pass
      return out
    conns = {w.conn: w for w, _ in busy.values()}
    conns.update({w.conn: w for w in starting})
    for conn in multiprocessing.connection.wait(list(conns), timeout=max(timeout, 0.0)):
      w = conns[conn]
      if not w.ready:
        w.on_message()  # the handshake of a replacement (raises if it died starting)
        continue
      try:
        out.append((w.wid,) + w.on_message())
      except (EOFError, OSError):  # the worker died (e.g. os._exit in the verifier)
        w.dead = True
        out.append((w.wid, busy[w.wid][1][0], False, "WorkerDied: reward worker exited"))
    return out

  def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> ScoreResult:
    if len(completions) != len(answers):
      raise ValueError(f"score_batch: {len(completions)} completions but {len(answers)} "
                       f"answers; expected one answer per completion")
    if not self._workers:
      raise RuntimeError("RewardScorer is closed")
    n = len(completions)
    rewards = np.zeros(n, np.float32)  # [B]
    errors: list[str] = []
    num_errors = num_timeouts = 0
    todo = list(range(n - 1, -1, -1))  # popped from the end: index order
    idle = [w for w in self._workers if w.ready]
    starting = [w for w in self._workers if not w.ready]  # replacements still importing
    busy: dict[int, tuple[object, tuple[int, float]]] = {}  # wid -> (worker, (index, deadline))
    while todo or busy:
      while todo and idle:
        w, i = idle.pop(), todo.pop()
        w.submit((i, completions[i], answers[i]))
        busy[w.wid] = (w, (i, time.monotonic() + self.timeout_s))
      deadlines = [d for _, (_, d) in busy.values()]
      deadlines += [w.started_at + _START_TIMEOUT_S for w in starting]
      results = self._wait(busy, starting, min(deadlines) - time.monotonic())
      for w in [w for w in starting if w.ready]:
        starting.remove(w)
        idle.append(w)
      for w in starting:  # a replacement that never finished starting is an error
        if time.monotonic() > w.started_at + _START_TIMEOUT_S:
          w.wait_ready(0.0)
      if any(d <= time.monotonic() for _, (_, d) in busy.values()):
        # Drain once more: an answer may have arrived at the deadline.
        results += self._wait(busy, [], 0.0)
      for wid, i, ok, value in results:
        if wid not in busy:  # a late answer from an abandoned thread
          continue
        w, _ = busy.pop(wid)
        if ok:
          rewards[i] = value
        else:
          num_errors += 1
          if len(errors) < self.max_logged_errors:
            errors.append(f"{i}: {value}")
          if self.backend == "process" and (w.dead or not w.proc.is_alive()):
            starting.append(self._replace(w))
            continue
        idle.append(w)
      now = time.monotonic()
      for wid in [wid for wid, (_, (_, d)) in busy.items() if d <= now]:
        w, (i, _) = busy.pop(wid)
        num_timeouts += 1
        if len(errors) < self.max_logged_errors:
          errors.append(f"{i}: Timeout: verifier ran past timeout_s={self.timeout_s}")
        new = self._replace(w)
        (idle if new.ready else starting).append(new)
    return ScoreResult(rewards=rewards, num_errors=num_errors, num_timeouts=num_timeouts,
                       errors=tuple(errors))

  def _replace(self, worker):
    worker.abandon()
    new = self._new_worker()
    self._workers[self._workers.index(worker)] = new
    return new

  def close(self) -> None:
    for w in self._workers:
      w.close()
    self._workers = []
    atexit.unregister(self.close)

  def __enter__(self) -> "RewardScorer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def score_batch(fn: RewardFn | str, completions: Sequence[str], answers: Sequence[str], *,
                timeout_s: float = 10.0, num_workers: int = 4,
                backend: str = "thread") -> ScoreResult:
  """Scores a batch once with a fresh pool (see `RewardScorer` to keep the pool across steps).
  A verifier that raises or runs past `timeout_s` gives reward 0 and is counted."""
  with RewardScorer(fn, timeout_s=timeout_s, num_workers=num_workers, backend=backend) as s:
    return s(completions, answers)

