"""MetricsLogger: named phases in the progress bar, TensorBoard tags equal to the metric names
of metrics.jsonl (`val/avg@4`), and the summary's count of steps below tau."""

import logging
import struct

import pytest

from sparrow_jax.run.metrics import MetricsLogger, summarize


def _tb_tags(tb_dir) -> dict[str, list[float]]:
  """Scalar tags -> values of every event file under `tb_dir` (TFRecord framing: length u64,
  its crc u32, the Event proto, its crc u32)."""
  from tensorboardX.proto.event_pb2 import Event
  out: dict[str, list[float]] = {}
  for f in sorted(tb_dir.iterdir()):
    data = f.read_bytes()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in ev.summary.value:
        out.setdefault(v.tag, []).append(v.simple_value)
  return out


def test_tensorboard_tags_are_the_metric_names(tmp_path):
  log = MetricsLogger(str(tmp_path), total_steps=2, quiet=True)
  log.log(1, {"reward/mean": 0.5, "val/avg@4": 0.25, "val/pass@4": 0.75, "note": "x"})
  log.log(2, {"reward/mean": 0.75})
  log.close()
  tags = _tb_tags(tmp_path / "tb")
  assert tags["val/avg@4"] == [0.25] and tags["val/pass@4"] == [0.75]
  assert tags["reward/mean"] == [0.5, 0.75]
  assert "val/avg_4" not in tags and "note" not in tags  # (strings are not scalars)


def test_phases_name_what_runs(tmp_path, capsys):
  pytest.importorskip("tqdm")
  log = MetricsLogger(str(tmp_path), total_steps=3, tensorboard=False)
  assert log.current_phase is None
  log.phase("warm start")
  assert log._bar.desc.startswith("train [warm start]")
  log.phase("compiling")
  log.log(1, {"reward/mean": 0.5})
  log.phase("rollout/update")
  log.phase("rollout/update")  # unchanged: nothing redrawn
  assert log._bar.desc.startswith("train [rollout/update]")
  assert log.current_phase == "rollout/update"
  pkg = logging.getLogger("sparrow_jax")
  assert not pkg.propagate  # while the bar is up, records are written above it
  logging.getLogger("sparrow_jax.rl.monitor").warning("tail below tau")
  log.close()
  assert pkg.propagate and not pkg.handlers
  err = capsys.readouterr().err
  assert "train [warm start]" in err and "train [compiling]" in err
  assert "\nWARNING:sparrow_jax.rl.monitor:tail below tau\n" in err.replace("\r", "\n")
  # Without a bar (no tqdm, or not a console) each change is one line on stderr; quiet: none.
  bare = MetricsLogger(str(tmp_path / "b"), total_steps=1, tensorboard=False)
  bare._bar.close()
  bare._bar = None
  capsys.readouterr()
  bare.phase("warm start")
  bare.phase("warm start")
  assert capsys.readouterr().err == "[warm start]\n"
  bare.close()
  quiet = MetricsLogger(str(tmp_path / "q"), total_steps=1, tensorboard=False, quiet=True)
  quiet.phase("warm start")
  assert capsys.readouterr().err == ""


def test_a_logger_left_open_does_not_double_the_warnings(tmp_path, capsys):
  """A run that died without closing its logger (an exception in a step) must not leave its
  bar's handler behind: the next run would print every warning twice."""
  pytest.importorskip("tqdm")
  dead = MetricsLogger(str(tmp_path / "dead"), total_steps=2, tensorboard=False)
  dead._bar.close()  # (never closed through close(): its handler is still attached)
  live = MetricsLogger(str(tmp_path / "live"), total_steps=2, tensorboard=False)
  pkg = logging.getLogger("sparrow_jax")
  assert len(pkg.handlers) == 1
  capsys.readouterr()
  logging.getLogger("sparrow_jax.rl.monitor").warning("tail below tau")
  assert capsys.readouterr().err.count("WARNING:sparrow_jax.rl.monitor:tail below tau") == 1
  live.release_logs()
  assert pkg.propagate and not pkg.handlers
  live.close()


def test_summary_counts_steps_below_tau():
  hist = [{"step": s, "reward/mean": 0.5, "mismatch/bins_below_tau": float(s % 3 == 0)}
          for s in range(1, 10)]
  assert summarize(hist)["steps_below_tau"] == 3
  assert "steps_below_tau" not in summarize([{"step": 1, "reward/mean": 0.5}])  # no monitor


def test_compile_clock_counts_compilations_not_cached_calls():
  """time/compile_s's source: lowering + XLA compilation seconds, grown by a new program (or a
  new shape of one), not by calling a compiled one again."""
  import jax
  import jax.numpy as jnp
  from sparrow_jax.run import compile_clock

  f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
  t0 = compile_clock.seconds()
  f(jnp.ones((8, 8))).block_until_ready()
  t1 = compile_clock.seconds()
  for _ in range(3):
    f(jnp.ones((8, 8))).block_until_ready()
  t2 = compile_clock.seconds()
  f(jnp.ones((16, 8))).block_until_ready()  # a new shape compiles again
  t3 = compile_clock.seconds()
  assert t1 > t0 and t2 == t1 and t3 > t2
