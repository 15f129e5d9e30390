"""Several hosts, one run: jax's multi-controller runtime for the trainer and the experiments.

One process per host runs the same program over one global mesh (DESIGN.md, "Several
hosts"). This module holds what that needs beyond the mesh itself:

  initialize()        join the job (`jax.distributed.initialize`) from `--coordinator
                      --num-processes --process-id`, jax's variables or a SLURM / Open MPI
                      launch; it must run before anything touches a jax backend, so the
                      experiments call it first thing. The Trainer never initialises: it
                      refuses (`require_initialized`) an environment that describes a job
                      nobody joined.
  prompt_range()      the contiguous share of a step's prompt groups a process rolls out.
  gather_completions  every process's completions all-gathered, so every process holds the
                      same batch in the single-process order (the packing into fixed-size
                      arrays is `run/completion_wire.py`'s).
  fetch()             host values of jitted outputs: a batch-sharded array spans devices of
                      other processes and is read with a collective, never `np.asarray`.
  agree_stop()        a stop flag agreed by all processes at the end of a step (a signal on
                      any one stops all after the same step).
  finish() / report_failure()  this process's final state for its peers' `Watchdog`
                      (`run/watchdog.py`: heartbeats through the coordination service; a
                      lost or failed peer ends the job with a line naming it), which
                      `initialize` starts.

Process 0 is the one writer of logs, plots, samples and exports (`is_writer`); checkpoints
are written by every process through orbax.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from sparrow_jax.run import completion_wire
from sparrow_jax.run.watchdog import Watchdog

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------- joining a job


def detect_distributed_env(env: Mapping[str, str] | None = None) -> tuple[dict | None, str]:
  """(kwargs for `jax.distributed.initialize` or None, reason).

  Initialise when (a) an explicit coordinator is set (JAX_COORDINATOR_ADDRESS or
  COORDINATOR_ADDRESS, with JAX_NUM_PROCESSES/NUM_PROCESSES and JAX_PROCESS_ID/PROCESS_ID),
  or (b) a SLURM or Open MPI launch of more than one task, which jax's own cluster detection
  then resolves. A single-task SLURM/MPI job is left alone.
  """
  env = os.environ if env is None else env

  def first(*names):
    for n in names:
      if env.get(n) not in (None, ""):
        return n, env[n]
    return None, None

  _, coord = first("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
  if coord:
    nname, nproc = first("JAX_NUM_PROCESSES", "NUM_PROCESSES")
    iname, pid = first("JAX_PROCESS_ID", "PROCESS_ID")
    if nproc is None or pid is None:
      missing = [n for n, v in (("JAX_NUM_PROCESSES", nproc), ("JAX_PROCESS_ID", pid))
                 if v is None]
      raise ValueError(f"coordinator address {coord!r} is set but {missing} is not; expected "
                       "JAX_NUM_PROCESSES and JAX_PROCESS_ID as well")
    kw = _explicit(coord, _int(nproc, nname), _int(pid, iname), names=(nname, iname))
    return kw, f"coordinator {coord} ({kw['num_processes']} processes)"
  slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                "SLURM_LOCALID")
  if all(v in env for v in slurm_vars) and int(env["SLURM_NTASKS"]) > 1:
    return {}, f"SLURM job {env['SLURM_JOB_ID']} with {env['SLURM_NTASKS']} tasks"
  if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return {}, f"Open MPI launch of {env['OMPI_COMM_WORLD_SIZE']} processes"
  return None, "no multi-process launcher environment"


def _int(val, what: str) -> int:
  try:
    return int(val)
  except (TypeError, ValueError):
    raise ValueError(f"{what}={val!r}: expected an integer") from None


def _explicit(coordinator, num_processes, process_id, *,
              names=("--num-processes", "--process-id")) -> dict:
  nname, iname = names
  if not isinstance(coordinator, str) or ":" not in coordinator:
    raise ValueError(f"--coordinator={coordinator!r}: expected HOST:PORT")
  if num_processes < 1:
    raise ValueError(f"{nname}={num_processes}: expected >= 1")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"{iname}={process_id}: expected 0 <= id < {nname}={num_processes}")
  return dict(coordinator_address=coordinator, num_processes=int(num_processes),
              process_id=int(process_id))


def add_cli_args(ap: argparse.ArgumentParser) -> None:
  """--coordinator / --num-processes / --process-id / --heartbeat-timeout."""
  g = ap.add_argument_group("several hosts (one process per host; see README)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="address of process 0's coordination service (default: from "
                      "JAX_COORDINATOR_ADDRESS, SLURM or Open MPI; none: one process)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="processes in the job (with --coordinator)")
  g.add_argument("--process-id", type=int, default=None,
                 help="this process's index, 0 .. num_processes-1 (with --coordinator)")
  g.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                 metavar="S", help="a peer silent for S seconds ends the job with an error "
                                   f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")


def cli_kwargs(args: argparse.Namespace) -> dict:
  """`initialize` keyword arguments from `add_cli_args`'s flags."""
  return dict(coordinator=args.coordinator, num_processes=args.num_processes,
              process_id=args.process_id, heartbeat_timeout_s=args.heartbeat_timeout)


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # (private API moved: let jax itself complain)
    return False


_WATCHDOG: Watchdog | None = None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, env: Mapping[str, str] | None = None,
               heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
               watchdog: bool = True, init_fn: Callable[..., Any] | None = None) -> bool:
  """Join a multi-process job before anything touches a jax backend.

  Explicit arguments (the CLI flags) win over the environment (`detect_distributed_env`);
  with neither, or `num_processes=1`, nothing happens. Returns True if it joined a job here.
  Raises ValueError on incomplete or inconsistent arguments and when a backend is already
  running (jax then cannot join any more).
  """
  if not heartbeat_timeout_s > 0:
    raise ValueError(f"--heartbeat-timeout={heartbeat_timeout_s!r}: expected > 0 seconds")
  given = {"--coordinator": coordinator, "--num-processes": num_processes,
           "--process-id": process_id}
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing and not (num_processes == 1 and coordinator is None):
      raise ValueError(f"{', '.join(missing)} missing: a multi-process run needs "
                       "--coordinator HOST:PORT, --num-processes N and --process-id I")
    if num_processes == 1:
      return False
    kwargs, reason = _explicit(coordinator, num_processes, process_id), "command line"
  else:
    kwargs, reason = detect_distributed_env(env)
    if kwargs is None:
      return False
  if init_fn is None:
    if jax.distributed.is_initialized():
      return False
    if _backends_started():
      raise ValueError(f"a multi-process job ({reason}) must be joined before anything uses "
                       "jax; call sparrow_jax.run.distributed.initialize() first thing in the "
                       "program (experiments/train.py does)")
    init_fn = jax.distributed.initialize
  hb = int(np.ceil(heartbeat_timeout_s))
  host = kwargs.get("coordinator_address", "").rpartition(":")[0]
  if host in ("127.0.0.1", "localhost", "[::1]"):  # one machine: listen on loopback only
    kwargs = dict(kwargs, coordinator_bind_address=kwargs["coordinator_address"])
  log.info("joining a multi-process job: %s", reason)
  # The runtime's own heartbeat is the backstop: ours (below) fires first, with a message.
  init_fn(**kwargs, heartbeat_timeout_seconds=hb + 15, shutdown_timeout_seconds=hb + 15)
  if watchdog and init_fn is jax.distributed.initialize and jax.process_count() > 1:
    global _WATCHDOG
    try:
      _WATCHDOG = Watchdog(timeout_s=heartbeat_timeout_s)
    except (ImportError, AttributeError) as e:  # (a jax whose private client moved)
      log.warning("no heartbeat watchdog (%s): a lost process is found by the runtime's "
                  "own heartbeat, after %d s", e, hb + 15)
    else:
      _WATCHDOG.start()
  return True


def require_initialized(env: Mapping[str, str] | None = None) -> None:
  """Raise ValueError when the environment describes a multi-process job that this process
  has not joined (the trainer would otherwise train alone on its own devices)."""
  kwargs, reason = detect_distributed_env(env)
  if kwargs is not None and not jax.distributed.is_initialized():
    raise ValueError(f"the environment describes a multi-process job ({reason}) but "
                     "jax.distributed is not initialised; call "
                     "sparrow_jax.run.distributed.initialize() before anything uses jax "
                     "(experiments/train.py does it first thing)")


def is_multi() -> bool:
  return jax.process_count() > 1


def is_writer() -> bool:
  """Process 0 writes logs, samples, plots, summaries and exports."""
  return jax.process_index() == 0


def finish() -> None:
  """This process ended its work normally: peers stop watching its heartbeat."""
  if _WATCHDOG is not None:
    _WATCHDOG.stop("done")


def report_failure(message: str) -> None:
  """This process fails with `message`: peers end with a line that names it and the cause
  (instead of waiting for its heartbeat to stop). Its own watchdog keeps watching: when the
  failure is a collective that lost a peer, it names that peer before this process ends."""
  if _WATCHDOG is not None:
    _WATCHDOG.stop("failed: " + " ".join(str(message).split())[:300], watch=True)


# ----------------------------------------------------------------------------- data


def prompt_range(n: int, index: int | None = None, count: int | None = None
                 ) -> tuple[int, int]:
  """[start, stop) of the `n` prompt groups process `index` of `count` rolls out: contiguous,
  in process order, sizes differing by at most one (the first `n % count` get one more)."""
  index = jax.process_index() if index is None else int(index)
  count = jax.process_count() if count is None else int(count)
  if not 0 <= index < count:
    raise ValueError(f"prompt_range: index={index}: expected 0 <= index < count={count}")
  base, extra = divmod(int(n), count)
  start = index * base + min(index, extra)
  return start, start + base + (index < extra)


def local_request_index(requests: Sequence[Any], *, index: int | None = None,
                        count: int | None = None) -> np.ndarray:
  """Positions of the requests this process generates: those whose prompt
  (`request_id[0]`) falls in its `prompt_range` of the prompts in order of appearance, so a
  group never straddles two processes."""
  keys = list(dict.fromkeys(r.request_id[0] for r in requests))
  lo, hi = prompt_range(len(keys), index, count)
  mine = set(keys[lo:hi])
  return np.asarray([j for j, r in enumerate(requests) if r.request_id[0] in mine], np.int64)


def allgather_host(tree):
  """Stack every process's host pytree (same structure, shapes and dtypes) on a new leading
  process axis, with a collective. Single process: a leading axis of 1."""
  if not is_multi():
    return jax.tree.map(lambda x: np.asarray(x)[None], tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=False))


def gather_completions(local: Sequence[Any], index: Sequence[int], requests: Sequence[Any], *,
                       topk: int, hidden: int = 0, make: Callable[..., Any],
                       allgather: Callable[[Any], Any] = allgather_host) -> list:
  """Every process's completions (`local`, at global request positions `index`) gathered so
  each process holds all of them, in request order (`completion_wire.gather_completions`
  over the host collective: every process calls it at the same point)."""
  return completion_wire.gather_completions(local, index, requests, topk=topk, hidden=hidden,
                                            make=make, allgather=allgather)


def merge_stats(stats: Mapping[str, float], keys: Sequence[str],
                allgather: Callable[[Any], Any] = allgather_host) -> dict[str, float]:
  """Engine counters of every process: work is summed (tokens, preemptions, slot-steps);
  fractions (`*_frac`) and loop counts (`decode_steps`: the processes decode side by side)
  take the maximum."""
  vals = allgather(np.asarray([float(stats.get(k, 0.0)) for k in keys], np.float32))  # [P, K]
  top = lambda k: k.endswith("_frac") or k == "decode_steps"
  return {k: float(vals[:, i].max() if top(k) else vals[:, i].sum())
          for i, k in enumerate(keys)}


# ----------------------------------------------------------------------------- arrays


def fetch(tree):
  """Host numpy values of a pytree of (jitted) outputs. An array sharded over devices of
  other processes is all-gathered (a collective: every process must call this in the same
  order); a replicated one is read from the local copy; everything else `jax.device_get`."""
  if not is_multi():
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)

  return jax.tree.map(one, tree)


def agree_stop(signame: str | None,
               allgather: Callable[[Any], Any] | None = None) -> str | None:
  """The stop flag of all processes at a step's end: the signal of the first process that
  got one (SIGINT/SIGTERM, by number), None when none did. A collective: every process calls
  it once per step."""
  import signal
  if allgather is None:
    if not is_multi():
      return signame
    allgather = allgather_host
  num = int(signal.Signals[signame]) if signame else 0
  nums = allgather(np.asarray([num], np.int32))[:, 0]
  hit = [int(x) for x in nums if x]
  return signal.Signals(hit[0]).name if hit else None
