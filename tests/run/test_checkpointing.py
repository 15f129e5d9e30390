"""Tests for sparrow_jax.run.checkpointing: exact round trips, pruning, overwrite protection,
relative paths, structure errors, and a save killed before orbax's final rename."""

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.run.checkpointing import CheckpointDamagedError, Checkpointer, state_nbytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def train_state():
  """A realistic training pytree: nnx.State params, optax state, typed key, data position."""
  cfg = get_config("tiny")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

  @jax.jit  # one compilation instead of hundreds of op-by-op dispatches
  def make():
    params = nnx.split(init_model(cfg, seed=3))[1]
    opt = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    _, opt = tx.update(grads, opt, params)  # non-trivial moments
    lora = {"layers": {0: {"q": {"a": jnp.ones((64, 4)), "b": jnp.zeros((4, 4, 32))}}}}
    return params, opt, lora, optax.adam(1e-4).init(lora)

  params, opt, lora, lora_opt = make()
  lora["layers"][0]["q"]["scale"] = 2.0
  return {"params": params, "opt": opt, "lora": lora, "lora_opt": lora_opt,
          "rng": jax.random.key(11), "rng_data": jax.random.key_data(jax.random.key(5)),
          "data": {"epoch": 2, "index": np.int64(137), "seed": 7}, "step": 12,
          "lr": 3e-4}


def _comparable(tree):
  """Typed keys -> their data, so chex can compare bit for bit."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if (
      hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)) else x, tree)


def _assert_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  chex.assert_trees_all_equal(_comparable(a), _comparable(b), strict=True)
  for x, y in zip(jax.tree.leaves(_comparable(a)), jax.tree.leaves(_comparable(b))):
    assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), \
        (type(x), type(y))
    if hasattr(x, "dtype"):
      assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_bit_identical_after_reopen(tmp_path, train_state):
  ck = Checkpointer(tmp_path / "ck", keep_last=3)
  assert ck.latest_step() is None
  assert ck.save(12, train_state, {"config": {"model": "tiny"}, "schedule": [1, 2]})
  ck.wait()
  del ck  # a fresh object, as after a restart
  ck2 = Checkpointer(tmp_path / "ck")
  assert ck2.all_steps() == [12] and ck2.latest_step() == 12
  restored, meta = ck2.restore(abstract_state=train_state)
  assert meta == {"config": {"model": "tiny"}, "schedule": [1, 2]}
  _assert_identical(restored, train_state)
  assert isinstance(restored["params"], nnx.State)
  assert jax.random.key_impl(restored["rng"]) == jax.random.key_impl(train_state["rng"])
  # Restoring onto abstract shapes (with shardings) works the same way.
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, train_state)
  restored2, _ = ck2.restore(12, abstract)
  _assert_identical(restored2, train_state)
  # The same random stream continues from the restored key.
  np.testing.assert_array_equal(jax.random.normal(restored["rng"], (3,)),
                                jax.random.normal(train_state["rng"], (3,)))
  assert ck2.metadata() == meta
  raw, _ = ck2.restore()  # no abstract: the nested dict as stored
  np.testing.assert_array_equal(raw["params"]["embed_VD"],
                                train_state["params"]["embed_VD"].value)
  assert state_nbytes(train_state) > 3 * 4 * get_config("tiny").num_params()


def test_keep_last_and_save_every(tmp_path):
  ck = Checkpointer(tmp_path / "ck", keep_last=2, save_every=2)
  state = {"w": jnp.arange(4.0)}
  saved = [ck.save(s, {"w": state["w"] + s}) for s in range(1, 8)]
  ck.wait()
  assert saved == [False, True, False, True, False, True, False]
  assert ck.all_steps() == [4, 6]
  assert ck.save(7, {"w": state["w"] + 7}, force=True)  # off-interval, forced
  ck.wait()
  assert ck.all_steps() == [6, 7]
  restored, _ = Checkpointer(tmp_path / "ck").restore(abstract_state=state)
  np.testing.assert_array_equal(restored["w"], np.arange(4.0) + 7)


def test_overwrite_needs_force(tmp_path):
  ck = Checkpointer(tmp_path / "ck")
  ck.save(3, {"w": jnp.zeros(2)}, {"v": 1})
  ck.wait()
  with pytest.raises(ValueError, match="step 3 already exists .* pass force=True"):
    ck.save(3, {"w": jnp.ones(2)}, {"v": 2})
  assert ck.save(3, {"w": jnp.ones(2)}, {"v": 2}, force=True)
  state, meta = ck.restore(abstract_state={"w": jnp.zeros(2)})
  np.testing.assert_array_equal(state["w"], np.ones(2))
  assert meta == {"v": 2} and ck.all_steps() == [3]


def test_relative_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  ck = Checkpointer("runs/rel_ck")
  assert os.path.isabs(ck.directory)
  assert ck.directory == os.path.join(str(tmp_path), "runs", "rel_ck")
  ck.save(1, {"x": jnp.arange(3)})
  ck.wait()
  assert os.path.isdir(tmp_path / "runs" / "rel_ck" / "1")
  state, _ = Checkpointer("runs/rel_ck").restore(abstract_state={"x": jnp.zeros(3, jnp.int32)})
  np.testing.assert_array_equal(state["x"], np.arange(3))


def test_clear_errors(tmp_path):
  empty = Checkpointer(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no finalized checkpoint in .*empty"):
    empty.restore(abstract_state={"x": jnp.zeros(1)})
  ck = Checkpointer(tmp_path / "ck")
  state = {"params": {"w": jnp.zeros((2, 3))}, "step": 1}
  # Invalid inputs are refused before anything is written, and the manager stays usable.
  with pytest.raises(ValueError, match="leaf 'name' has type str"):
    ck.save(1, {**state, "name": "run"})
  with pytest.raises(ValueError, match="not JSON-serialisable"):
    ck.save(1, state, {"f": object()})
  with pytest.raises(ValueError, match="reserved"):
    ck.save(1, state, {"_checkpoint": 1})
  with pytest.raises(ValueError, match="expected a non-negative int"):
    ck.save(-1, state)
  assert ck.all_steps() == []
  ck.save(1, state)
  ck.wait()
  with pytest.raises(ValueError, match=r"step 9 not found .* available steps: \[1\]"):
    ck.restore(9, state)
  with pytest.raises(ValueError,
                     match=r"missing from checkpoint \['params/b'\]; not expected \[\]"):
    ck.restore(abstract_state={**state, "params": {"w": state["params"]["w"],
                                                   "b": jnp.zeros(3)}})
  with pytest.raises(ValueError, match=r"not expected \['step'\]"):
    ck.restore(abstract_state={"params": state["params"]})
  with pytest.raises(ValueError, match=r"params/w: saved \(2, 3\) expected \(3, 2\)"):
    ck.restore(abstract_state={**state, "params": {"w": jnp.zeros((3, 2))}})
  with pytest.raises(ValueError, match="keep_last"):
    Checkpointer(tmp_path / "x", keep_last=0)


_CRASH = textwrap.dedent("""
    import os, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from sparrow_jax.run.checkpointing import Checkpointer

    ck = Checkpointer(sys.argv[1], keep_last=5)
    for s in (1, 2):
      ck.save(s, {"w": jnp.arange(6.0) * s, "step": s}, {"step": s})
    ck.wait()

    async def die(self, *a, **k):  # killed after writing, before the commit rename
      os._exit(17)

    atomicity.AtomicRenameTemporaryPath.finalize = die
    ck.save(3, {"w": jnp.arange(6.0) * 3, "step": 3}, {"step": 3})
    ck.wait()
    os._exit(0)  # not reached
""")


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
  d = tmp_path / "ck"
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-c", _CRASH, str(d)], env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 17, proc.stderr[-3000:]
  partial = [n for n in os.listdir(d) if n.startswith("3") and "tmp" in n]
  assert partial, os.listdir(d)  # the unfinished step-3 directory is there...
  ck = Checkpointer(d)  # ...but is neither listed nor restored, and is swept away
  assert ck.all_steps() == [1, 2] and ck.latest_step() == 2
  assert not [n for n in os.listdir(d) if "tmp" in n]
  abstract = {"w": jnp.zeros(6), "step": 0}
  state, meta = ck.restore(abstract_state=abstract)
  np.testing.assert_array_equal(state["w"], np.arange(6.0) * 2)
  assert state["step"] == 2 and meta == {"step": 2}
  ck.save(3, {"w": jnp.arange(6.0) * 3, "step": 3})  # the step can be written again
  ck.wait()
  assert ck.all_steps() == [1, 2, 3]


def test_async_save_survives_donation_of_saved_buffers(tmp_path):
  """The trainer donates its state to the next jitted step right after `save` returns."""
  ck = Checkpointer(tmp_path / "ck")
  w = jnp.arange(1 << 16, dtype=jnp.float32)
  expected = np.asarray(w)
  ck.save(1, {"w": w})
  step = jax.jit(lambda x: x * 2.0, donate_argnums=0)
  w2 = step(w)  # `w` is donated (deleted where the backend supports it)
  if not w.is_deleted():  # CPU may ignore donation: delete explicitly
    w.delete()
  ck.wait()
  state, _ = ck.restore(abstract_state={"w": jax.ShapeDtypeStruct(w2.shape, w2.dtype)})
  np.testing.assert_array_equal(state["w"], expected)


def _truncate(path, keep=0.5):
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(int(size * keep))


def _largest_data_file(step_dir):
  files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, "state"))
           for n in ns if os.path.basename(r) == "d"]
  return max(files, key=os.path.getsize)


def test_damaged_step_is_named_and_skipped(tmp_path):
  d = tmp_path / "ck"
  ck = Checkpointer(d)
  for s in (1, 2, 3):
    ck.save(s, {"w": jnp.arange(50_000.0) * s, "b": jnp.ones(3), "opt": jnp.zeros(4)},
            {"step": s})
  ck.wait()
  data_file = _largest_data_file(d / "3")
  _truncate(data_file)
  _truncate(d / "2" / "metadata" / "metadata")
  ck = Checkpointer(d)
  with pytest.raises(CheckpointDamagedError, match=r"step 3 is damaged: .*3/state.*'w"):
    ck.restore(3, {"w": jnp.zeros(50_000), "b": jnp.zeros(3), "opt": jnp.zeros(4)})
  with pytest.raises(CheckpointDamagedError, match=r"step 2 is damaged: .*2/metadata/metadata"):
    ck.metadata(2)
  said = []
  step, state, meta, damaged = ck.restore_latest_intact(
      {"w": jnp.zeros(50_000), "b": jnp.zeros(3)}, partial=True, report=said.append)
  assert step == 1 and meta == {"step": 1} and [e.step for e in damaged] == [3, 2]
  assert set(state) == {"w", "b"}  # partial: the optimizer leaf was not read
  np.testing.assert_array_equal(state["w"], np.arange(50_000.0))
  assert len(said) == 3 and "trying step 2" in said[0] and "restored step 1" in said[2]
  # A wrong target is not damage: it still raises the structure error.
  with pytest.raises(ValueError, match="missing from checkpoint"):
    ck.restore_latest_intact({"w": jnp.zeros(50_000), "x": jnp.zeros(1)})
  # Set aside, the damaged steps can be written again; nothing is deleted.
  moved = ck.set_aside(3)
  assert os.path.isfile(os.path.join(moved, "state", os.path.relpath(
      data_file, d / "3" / "state")))
  assert ck.all_steps() == [1, 2]
  ck.save(3, {"w": jnp.zeros(2)})
  ck.wait()
  assert ck.all_steps() == [1, 2, 3]


def test_truncated_orbax_json_names_step_and_file(tmp_path):
  """A truncated `_METADATA` (or another of orbax's JSON files) is named with its step and
  file, not only its folder."""
  tree = {"w": jnp.zeros(3), "b": jnp.ones(3)}
  for i, rel in enumerate(("state/_METADATA", "state/_sharding", "_CHECKPOINT_METADATA")):
    d = tmp_path / f"ck{i}"
    ck = Checkpointer(d)
    ck.save(7, tree, {"step": 7})
    ck.wait()
    _truncate(d / "7" / rel)
    with pytest.raises(CheckpointDamagedError,
                       match=rf"step 7 is damaged: .*ck{i}/7/{rel}: JSONDecodeError"):
      Checkpointer(d).restore(7, tree)


def test_resume_from_a_damaged_run_says_so_in_a_few_lines(tmp_path, capfd):
  """The CLI falls back to the newest intact step; stderr stays a few lines (orbax's
  asynchronous tracebacks and event-loop noise are not shown)."""
  import shutil

  import experiments.train as train_cli
  small = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
           "tensorboard=false", "distill=false", "save_every=1", "--quiet"]
  base = tmp_path / "base"
  assert train_cli.main(small + [f"out_dir={base}", "num_steps=2"]) == 0
  capfd.readouterr()
  for what in ("data", "metadata"):
    run = tmp_path / what
    shutil.copytree(base, run)
    step2 = run / "checkpoints" / "2"
    bad = (_largest_data_file(step2) if what == "data"
           else str(step2 / "metadata" / "metadata"))
    _truncate(bad)
    assert train_cli.main(["--resume", f"out_dir={run}", "num_steps=3", "--quiet"]) == 0
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("WARNING:sparrow")]
    assert len(lines) <= 6, err[:3000]
    assert "checkpoint step 2 is damaged" in err and "trying step 1" in err, err
    assert (os.path.relpath(bad, run).split("/state/")[0] if what == "data"
            else "2/metadata/metadata") in err
    assert "restored step 1" in err and "checkpoints.damaged" in err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3"]  # 2 redone
    assert sorted(os.listdir(str(run / "checkpoints") + ".damaged")) == ["2"]
  # Nothing intact at all: a clear error, exit 2.
  only = tmp_path / "only"
  shutil.copytree(base, only)
  shutil.rmtree(only / "checkpoints" / "1")
  _truncate(only / "checkpoints" / "2" / "metadata" / "metadata")
  assert train_cli.main(["--resume", f"out_dir={only}", "--quiet"]) == 2
  err = capfd.readouterr().err
  assert "error: checkpoint step 2 is damaged" in err and "no intact older step" in err
  assert len(err.splitlines()) <= 4, err


def test_read_only_checkpointer_leaves_a_live_run_alone(tmp_path):
  """Evaluation/export open a run that may still be training: its in-progress save is not
  swept away, no directory is created, nothing can be saved."""
  d = tmp_path / "ck"
  ck = Checkpointer(d)
  ck.save(1, {"w": jnp.arange(3.0)})
  ck.wait()
  busy = d / "2.orbax-checkpoint-tmp-123"  # another process is writing step 2
  busy.mkdir()
  ro = Checkpointer(d, read_only=True)
  assert busy.is_dir() and ro.all_steps() == [1]
  with pytest.raises(ValueError, match="read-only"):
    ro.save(3, {"w": jnp.zeros(3)})
  state, _ = ro.restore(abstract_state={"w": jnp.zeros(3)})
  np.testing.assert_array_equal(state["w"], np.arange(3.0))
  assert Checkpointer(tmp_path / "none", read_only=True).all_steps() == []
  assert not (tmp_path / "none").exists()
