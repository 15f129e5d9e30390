"""Training checkpoints with orbax: atomic, pruned, resumable onto any mesh.

One checkpoint step holds two orbax items:

  state     the training pytree: policy params, optimizer state, the LoRA tree and its
            optimizer state when present, RNG keys, data-loader position, step counter ...
            (any pytree of jax/numpy arrays and Python scalars, including nnx.State and optax
            states).
  metadata  a JSON dict: model/trainer config, schedule, anything human-readable.

How it is stored: the state is flattened to a nested dict keyed by its key path
("params/layers/0/attn/q_DNH"), so what lands on disk does not depend on how orbax handles
custom pytree nodes; `restore` rebuilds the caller's structure from `abstract_state`. Typed PRNG
keys (`jax.random.key`) are stored as their key data and re-wrapped with their implementation,
which is recorded in the metadata item.

Atomicity is orbax's: a step is written to `<dir>/<step>.orbax-checkpoint-tmp*` and renamed to
`<dir>/<step>` only when complete, so a process killed mid-save leaves the previous steps
intact and the partial one invisible (`all_steps` lists finalized steps only). Saves are
asynchronous by default; `wait()` blocks until the last one is on disk.

Paths are made absolute (orbax fails on relative paths, and only later in a background thread).
Saving over an existing step raises unless `force=True` (then the old step is deleted first).

Damaged steps (a truncated data or metadata file, from a full disk or a bad copy) are found on
restore: any read error becomes a `CheckpointDamagedError` naming the step, the file and the
first line of the cause, instead of orbax's long asynchronous tracebacks. `restore_latest_intact`
walks back to the newest step that reads, reporting the ones it skipped; `set_aside` moves a
damaged step to `<dir>.damaged/` so a resumed run can write that step number again.
`restore(..., partial=True)` reads only the leaves of `abstract_state` (e.g. the policy weights
of a training checkpoint, without the optimizer state).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import shutil
import sys
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sparrow_jax.run.sharding import path_str

log = logging.getLogger(__name__)

_RESERVED = "_checkpoint"  # key of our bookkeeping inside the metadata JSON
_FORMAT = 1
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's in-progress directory marker


class CheckpointDamagedError(ValueError):
  """A finalized checkpoint step that cannot be read: `step`, the `file` that failed (or the
  step directory when it cannot be told) and the first line of the underlying `reason`."""

  def __init__(self, step: int, file: str, reason: str):
    self.step, self.file, self.reason = step, file, reason
    super().__init__(f"checkpoint step {step} is damaged: {file}: {reason}")


def _first_line(e: BaseException, limit: int = 300) -> str:
  """The innermost cause's message, first line, shortened (orbax wraps tensorstore errors
  several times and appends the whole array spec)."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
  msg = f"{type(e).__name__}: {msg}" if not msg.startswith(type(e).__name__) else msg
  return msg if len(msg) <= limit else msg[:limit] + " ..."


# What a damaged file looks like from below: tensorstore status codes, JSON and OS errors.
_READ_ERROR = re.compile(r"OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|FAILED_PRECONDITION|Error reading|"
                         r"[Cc]orrupt|[Tt]runcat|[Dd]ecompress|[Cc]hecksum|Unexpected end")


def _is_read_error(e: BaseException) -> bool:
  chain = []
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
  return any(isinstance(x, (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError))
             or _READ_ERROR.search(str(x)) for x in chain)


class _AbandonedReadFilter(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for orbax's array reads."""

  def filter(self, record: logging.LogRecord) -> bool:
    try:
      msg = record.getMessage()
    except Exception:  # a malformed record is not ours to judge
      return True
    return not ("never retrieved" in msg and ("orbax" in msg or "async_deserialize" in msg))


_MUTED = False


def _mute_abandoned_reads() -> None:
  """After a failed restore, orbax's other in-flight reads of that step finish on an event
  loop that is already closed: each one then reports `RuntimeError: Event loop is closed`
  (through sys.unraisablehook, from a tensorstore thread) or an unretrieved task exception
  (through the asyncio logger), thousands of lines for a real model. They carry no
  information beyond the CheckpointDamagedError already raised, so from the first damaged
  restore on, exactly those reports are dropped (process-wide, installed once)."""
  global _MUTED
  if _MUTED:
    return
  _MUTED = True
  logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())
  previous = sys.unraisablehook

  def hook(unraisable):
    exc, obj = unraisable.exc_value, unraisable.object
    if (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)) or (
        "orbax" in repr(obj) or "_read_array_index_and_device_put" in repr(obj)
        or "async_deserialize" in repr(obj)):
      return
    previous(unraisable)

  sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet_orbax():
  """Silence orbax/absl/asyncio loggers while a restore may fail: a damaged file otherwise
  floods stderr from the background event loop; the error we raise says what matters."""
  names = ("absl", "orbax", "asyncio", "jax._src.distributed", "tensorstore")
  loggers = [logging.getLogger(n) for n in names]
  old = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for lg, lvl in zip(loggers, old):
      lg.setLevel(lvl)


def _is_prng_key(x) -> bool:
  dt = getattr(x, "dtype", None)
  return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _segments(path) -> list[str]:
  segs = path_str(path).split("/") if path else []
  for s in segs:
    if not s or "." in s:
      raise ValueError(f"checkpoint key path {path_str(path)!r}: segment {s!r} is empty or "
                       "contains '.'; expected plain names")
  return segs


def _nest(flat: Mapping[str, Any]) -> dict:
  out: dict = {}
  for key, leaf in flat.items():
    node = out
    segs = key.split("/")
    for s in segs[:-1]:
      node = node.setdefault(s, {})
    node[segs[-1]] = leaf
  return out


def _flatten_paths(tree) -> list[tuple[str, Any]]:
  """[(path string, leaf)] with duplicate-path detection."""
  items, seen = [], set()
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = "/".join(_segments(p)) or "_root"
    if key in seen:
      raise ValueError(f"two checkpoint leaves map to the same path {key!r}")
    seen.add(key)
    items.append((key, leaf))
  return items


def _storable(key: str, leaf):
  """Leaf as orbax stores it; raises on types orbax cannot restore."""
  if isinstance(leaf, (jax.Array, np.ndarray)):
    return leaf
  if isinstance(leaf, np.generic):
    return np.asarray(leaf)  # orbax restores numpy scalars only as 0-d arrays
  if isinstance(leaf, (bool, int, float)):
    return leaf
  raise ValueError(f"checkpoint leaf {key!r} has type {type(leaf).__name__}; expected a jax or "
                   "numpy array or a Python int/float/bool (put strings in the JSON metadata)")


def _abstract_leaf(key: str, leaf):
  """What orbax's StandardRestore should produce for `leaf` (its sharding kept)."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if _is_prng_key(leaf):
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  if isinstance(leaf, np.ndarray):
    return np.empty(leaf.shape, leaf.dtype)
  if isinstance(leaf, np.generic):
    return np.empty((), leaf.dtype)
  if isinstance(leaf, (bool, int, float)):
    return leaf
  raise ValueError(f"abstract leaf {key!r} has type {type(leaf).__name__}; expected an array, "
                   "a jax.ShapeDtypeStruct or a Python scalar")


class Checkpointer:
  """Save/restore training state every `save_every` steps, keeping the last `keep_last`.

  ```python
  ckpt = Checkpointer("runs/x/ckpt", keep_last=3, save_every=50)
  ckpt.save(step, {"params": state, "opt": opt_state, "rng": key, "data": pos}, {"cfg": ...})
  state, meta = ckpt.restore(abstract_state=abstract)   # latest step, onto its shardings
  ```
  """

  def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3,
               save_every: int = 1, async_save: bool = True, read_only: bool = False):
    """`read_only=True` (evaluation, export, generation from a run that may still be
    training): the directory is neither created nor swept of unfinished saves, and `save`
    refuses."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
      raise ValueError(f"Checkpointer keep_last={keep_last!r}: expected a positive int or None")
    if not isinstance(save_every, int) or save_every < 1:
      raise ValueError(f"Checkpointer save_every={save_every!r}: expected a positive int")
    self.directory = os.path.abspath(os.fspath(directory))
    self.keep_last = keep_last
    self.save_every = save_every
    self.read_only = read_only
    if not read_only:  # another process may be writing a step we would take for debris
      self._remove_partial_saves()
    # Orbax's own cleanup_tmp_directories runs in a background future that can outlive a short
    # process; the synchronous sweep above does the same job deterministically.
    # (orbax's own read_only option only logs warnings; `save` guards instead)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last, create=not read_only, enable_async_checkpointing=async_save)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "metadata": ocp.JsonCheckpointHandler()})

  def _remove_partial_saves(self):
    """Delete `<step>.orbax-checkpoint-tmp*` directories left by a killed save (process 0)."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if _TMP_SUFFIX in name:
        log.warning("removing unfinished checkpoint %s", os.path.join(self.directory, name))
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # --- queries --------------------------------------------------------------------------
  def all_steps(self) -> list[int]:
    """Finalized steps, ascending (in-progress or crashed saves are not listed)."""
    return sorted(int(s) for s in self._mgr.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  # --- save -----------------------------------------------------------------------------
  def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Save `state` (pytree) and `metadata` (JSON dict) as `step`.

    Without `force`, steps off the `save_every` interval are skipped (returns False) and an
    existing step raises ValueError. With `force`, the step is saved regardless and an
    existing one is replaced. Returns True when a save was started.
    """
    if self.read_only:
      raise ValueError(f"Checkpointer({self.directory}) is read-only: cannot save step {step}")
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
      raise ValueError(f"checkpoint step={step!r}: expected a non-negative int")
    step = int(step)
    if not force and not self.should_save(step):
      return False
    metadata = dict(metadata or {})
    if _RESERVED in metadata:
      raise ValueError(f"checkpoint metadata key {_RESERVED!r} is reserved")
    # Validate everything before orbax starts: a failing save leaves its threads waiting.
    flat, impls = {}, {}
    for key, leaf in _flatten_paths(state):
      if _is_prng_key(leaf):
        impls[key] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
      flat[key] = _storable(key, leaf)
    metadata[_RESERVED] = {"format": _FORMAT, "step": step, "prng_impls": impls}
    try:
      json.dumps(metadata, allow_nan=True)
    except (TypeError, ValueError) as e:
      raise ValueError(f"checkpoint metadata is not JSON-serialisable: {e}") from None
    if step in self.all_steps():
      if not force:
        raise ValueError(f"checkpoint step {step} already exists in {self.directory}; "
                         "pass force=True to overwrite it")
      self.wait()
      log.info("overwriting checkpoint step %d in %s", step, self.directory)
      self._mgr.delete(step)
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_nest(flat)), metadata=ocp.args.JsonSave(metadata)),
        force=True)
    return True

  def wait(self):
    """Block until pending asynchronous saves are on disk (and raise their errors)."""
    self._mgr.wait_until_finished()

  def close(self):
    self._mgr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc):
    self.close()

  # --- restore --------------------------------------------------------------------------
  def _resolve_step(self, step: int | None) -> int:
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"checkpoint step {step} not found in {self.directory}; "
                       f"available steps: {steps}")
    return int(step)

  def metadata(self, step: int | None = None) -> dict:
    """The JSON metadata of `step` (default latest); CheckpointDamagedError if unreadable."""
    step = self._resolve_step(step)
    meta = self._read_metadata(step)
    meta.pop(_RESERVED, None)
    return meta

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _read_metadata(self, step: int) -> dict:
    """The metadata item, parsed here so a damaged file is named (orbax would only say
    `Expecting value: line 1 column 21`)."""
    file = os.path.join(self._step_dir(step), "metadata", "metadata")
    try:
      with open(file) as f:
        meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointDamagedError(step, file, _first_line(e)) from None
    if not isinstance(meta, dict):
      raise CheckpointDamagedError(step, file, f"expected a JSON object, found "
                                               f"{type(meta).__name__}")
    return meta

  # orbax's own JSON files of a step: parsed here first, so a truncated one is named with its
  # step and file (orbax would report only the state folder and a JSONDecodeError).
  _ORBAX_JSON = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/_sharding",
                 "state/array_metadatas/process_0")

  def _check_orbax_json(self, step: int) -> None:
    for rel in self._ORBAX_JSON:
      file = os.path.join(self._step_dir(step), *rel.split("/"))
      if not os.path.isfile(file):  # optional in some orbax versions; orbax reports absence
        continue
      try:
        with open(file) as f:
          json.load(f)
      except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamagedError(step, file, _first_line(e)) from None

  def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    self._check_orbax_json(step)
    try:
      with _quiet_orbax():
        md = self._mgr.item_metadata(step)["state"]
    except Exception as e:  # truncated _METADATA, missing files, ...
      raise CheckpointDamagedError(step, os.path.join(self._step_dir(step), "state"),
                                   _first_line(e)) from None
    if md is None:
      raise CheckpointDamagedError(step, os.path.join(self._step_dir(step), "state"),
                                   "no readable array metadata")
    tree = getattr(md, "tree", md)
    return {"/".join(_segments(p)): tuple(getattr(leaf, "shape", ()) or ())
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

  def _orbax_restore(self, step: int, read: Callable[[], Any]) -> Any:
    """`read()` (an orbax restore of `step`) with read errors turned into
    CheckpointDamagedError; other errors (a wrong target, a bug) propagate unchanged."""
    with _quiet_orbax():
      try:
        return read()
      except Exception as e:
        if not _is_read_error(e):
          raise
        reason = _first_line(e)
      # The other array reads of this restore were abandoned mid-flight: collect them now,
      # while their noise is muted (otherwise one "Event loop is closed" per array later).
      _mute_abandoned_reads()
      gc.collect()
    # tensorstore names the array and the OCDBT database it failed to read.
    m = re.search(r'Error reading "([^"]+)" in OCDBT database at local file "([^"]+)"', reason)
    file = (f"{m.group(2).rstrip('/')} (array {m.group(1)!r})" if m
            else os.path.join(self._step_dir(step), "state"))
    raise CheckpointDamagedError(step, file, reason)

  def restore(self, step: int | None = None, abstract_state: Any = None, *,
              partial: bool = False) -> tuple[Any, dict]:
    """Restore `step` (default latest) -> (state, metadata).

    `abstract_state` gives the structure, shapes, dtypes and shardings to restore onto (a
    pytree of `jax.ShapeDtypeStruct` with `sharding`, or of concrete arrays whose shardings
    are reused). Without it, the raw nested dict is returned (arrays on the default device).
    A structure or shape mismatch raises ValueError naming the differing paths; with
    `partial=True`, saved leaves absent from `abstract_state` are skipped (not read) instead.
    An unreadable step raises CheckpointDamagedError (a ValueError) naming the file.
    """
    step = self._resolve_step(step)
    raw_meta = self._read_metadata(step)  # cheap, and names a damaged metadata file
    if abstract_state is None:
      self._check_orbax_json(step)
      out = self._orbax_restore(step, lambda: self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(), metadata=ocp.args.JsonRestore())))
      meta = dict(out["metadata"])
      meta.pop(_RESERVED, None)
      return out["state"], meta

    leaves = _flatten_paths(abstract_state)
    treedef = jax.tree.structure(abstract_state)
    saved = self._saved_shapes(step)
    want = {k: leaf for k, leaf in leaves}
    missing = sorted(set(want) - set(saved))
    extra = [] if partial else sorted(set(saved) - set(want))
    if missing or extra:
      raise ValueError(
          f"checkpoint step {step} in {self.directory} does not match the expected structure: "
          f"missing from checkpoint {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
          f"not expected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    abstract_flat = {k: _abstract_leaf(k, leaf) for k, leaf in leaves}
    bad = [f"{k}: saved {saved[k]} expected {tuple(np.shape(a))}"
           for k, a in abstract_flat.items()
           if hasattr(a, "shape") and tuple(a.shape) != saved[k]]
    if bad:
      raise ValueError(f"checkpoint step {step} in {self.directory}: shape mismatch for "
                       f"{len(bad)} leaves: {bad[:8]}")

    if partial and set(saved) - set(want):
      # Only the wanted leaves are read: the PyTree handler under orbax's StandardCheckpoint
      # handler (same on-disk format) restores a subtree with `partial_restore`.
      target = _nest(abstract_flat)
      args = ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True)
      state_dir = os.path.join(self._step_dir(step), "state")
      state = self._orbax_restore(
          step, lambda: ocp.PyTreeCheckpointHandler().restore(epath.Path(state_dir), args=args))
      out = {"state": state, "metadata": raw_meta}
    else:
      out = self._orbax_restore(step, lambda: self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_nest(abstract_flat)),
          metadata=ocp.args.JsonRestore())))
    meta = dict(out["metadata"])
    impls = meta.pop(_RESERVED, {}).get("prng_impls", {})
    restored_flat = dict(_flatten_paths(out["state"]))
    result = []
    for key, leaf in leaves:
      value = restored_flat[key]
      if _is_prng_key(leaf):
        if key not in impls:
          raise ValueError(f"checkpoint leaf {key!r} was saved as raw data, not a PRNG key")
        value = jax.random.wrap_key_data(value, impl=impls[key])
      elif isinstance(leaf, np.generic):
        value = leaf.dtype.type(np.asarray(value))
      elif isinstance(leaf, bool):
        value = bool(value)
      elif isinstance(leaf, int):
        value = int(value)
      elif isinstance(leaf, float):
        value = float(value)
      result.append(value)
    return jax.tree.unflatten(treedef, result), meta


  def restore_latest_intact(self, abstract_state: Any = None, *, partial: bool = False,
                            report: Callable[[str], None] | None = None
                            ) -> tuple[int, Any, dict, list[CheckpointDamagedError]]:
    """Restore the newest step that reads -> (step, state, metadata, damaged newer steps).

    Each damaged step is reported through `report` (one line) and skipped. Structure or shape
    mismatches are not damage and still raise. When no step reads, raises
    CheckpointDamagedError for the newest one, listing every step tried.
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
    damaged: list[CheckpointDamagedError] = []
    for step in reversed(steps):
      try:
        state, meta = self.restore(step, abstract_state, partial=partial)
      except CheckpointDamagedError as e:
        damaged.append(e)
        if report is not None:
          older = [s for s in steps if s < step]
          report(f"warning: {e}; " + (f"trying step {older[-1]}" if older
                                      else "no older checkpoint"))
        continue
      if damaged and report is not None:
        report(f"warning: restored step {step}, the newest intact checkpoint (damaged: "
               f"{', '.join(str(d.step) for d in damaged)})")
      return step, state, meta, damaged
    newest = damaged[0]
    raise CheckpointDamagedError(
        newest.step, newest.file,
        newest.reason + f" (and no intact older step: tried {sorted(d.step for d in damaged)})")

  def set_aside(self, step: int) -> str:
    """Move step `step` to `<directory>.damaged/<step>[.n]` (kept for inspection, out of
    orbax's view) so that the step number can be written again. Returns the new path."""
    self.wait()
    src = self._step_dir(step)
    dst_root = self.directory.rstrip(os.sep) + ".damaged"
    os.makedirs(dst_root, exist_ok=True)
    dst, n = os.path.join(dst_root, str(step)), 0
    while os.path.exists(dst):
      n += 1
      dst = os.path.join(dst_root, f"{step}.{n}")
    shutil.move(src, dst)
    self._mgr.reload()
    return dst


def state_nbytes(tree) -> int:
  """Total bytes of the array leaves of a pytree (for logging checkpoint sizes)."""
  return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and not _is_prng_key(x))
