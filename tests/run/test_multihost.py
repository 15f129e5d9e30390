"""Several processes, one run (issue 17): the pieces in-process, then `experiments/train.py` as
2 processes x 4 CPU devices on loopback against 1 process x 8 devices.

The end-to-end test shares four launches between every acceptance check: the 1x8 and 2x4
runs (compared step by step over 3 steps; the 2x4 one then gets SIGTERM on process 1 and
both of its processes stop after the same step), a 1-process resume from the 2-process
step-2 checkpoint and a 2-process resume from the 1-process one (each compared with the
uninterrupted run of its process count), and that 2-process resume, run on past step 3, is
where one process is killed. The children share a persistent compilation cache, so the
resumed runs mostly reuse the programs of the first two.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from sparrow_jax.engine.config import Completion, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.run import completion_wire as wire
from sparrow_jax.run import distributed as dist
from sparrow_jax.run import watchdog
from sparrow_jax.run.metrics import MetricsLogger, read_jsonl
from tests.run import multihost_helpers as H


# ----------------------------------------------------------------------------- pieces


def test_detect_distributed_env():
  assert dist.detect_distributed_env({})[0] is None
  kw, _ = dist.detect_distributed_env({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
                                       "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"})
  assert kw == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
  kw, _ = dist.detect_distributed_env({"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2",
                                       "PROCESS_ID": "0"})
  assert kw["num_processes"] == 2
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    dist.detect_distributed_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match="expected 0 <= id"):
    dist.detect_distributed_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                 "JAX_PROCESS_ID": "2"})
  slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
  assert dist.detect_distributed_env(slurm)[0] == {}
  assert dist.detect_distributed_env({**slurm, "SLURM_NTASKS": "1"})[0] is None
  assert dist.detect_distributed_env({"SLURM_JOB_ID": "7"})[0] is None
  assert dist.detect_distributed_env({"OMPI_MCA_orte_hnp_uri": "x",
                                      "OMPI_COMM_WORLD_SIZE": "4"})[0] == {}


def test_initialize_flags_env_and_errors():
  calls = []
  init = lambda **kw: calls.append(kw)
  assert dist.initialize(env={}, init_fn=init) is False  # nothing to join
  assert dist.initialize(num_processes=1, env={}, init_fn=init) is False
  assert dist.initialize("127.0.0.1:5", 2, 1, env={}, init_fn=init, heartbeat_timeout_s=7)
  env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2"}
  assert dist.initialize(env=env, init_fn=init)
  assert calls == [  # the runtime's own heartbeat is the backstop behind the watchdog's
      dict(coordinator_address="127.0.0.1:5", num_processes=2, process_id=1,
           coordinator_bind_address="127.0.0.1:5",  # loopback: listen on nothing else
           heartbeat_timeout_seconds=22, shutdown_timeout_seconds=22),
      dict(coordinator_address="h:1", num_processes=3, process_id=2,
           heartbeat_timeout_seconds=45, shutdown_timeout_seconds=45)]
  with pytest.raises(ValueError, match="--process-id missing"):
    dist.initialize("h:1", 2, env={}, init_fn=init)
  with pytest.raises(ValueError, match="HOST:PORT"):
    dist.initialize("h", 2, 0, env={}, init_fn=init)
  with pytest.raises(ValueError, match=r"--process-id=2: expected 0 <= id"):
    dist.initialize("h:1", 2, 2, env={}, init_fn=init)
  with pytest.raises(ValueError, match="heartbeat"):
    dist.initialize(env={}, heartbeat_timeout_s=0)
  jax.devices()  # a backend runs in this process: joining now is refused, clearly
  with pytest.raises(ValueError, match="must be joined before anything uses jax"):
    dist.initialize("127.0.0.1:5", 2, 0, env={})
  with pytest.raises(ValueError, match="not initialised"):
    dist.require_initialized(env)
  dist.require_initialized({})


def test_dry_run_counts_every_process_devices():
  import argparse
  from experiments.train import _dry_run_devices
  ns = lambda n, d, *ov: argparse.Namespace(num_processes=n, num_devices=d, config="qwen3_14b",
                                            overrides=list(ov))
  assert _dry_run_devices(ns(4, 32)) == 32
  assert _dry_run_devices(ns(4, None, "mesh=data=2,fsdp=16")) == 32  # the mesh's size
  assert _dry_run_devices(ns(None, 8)) == 8 and _dry_run_devices(ns(1, None)) is None
  with pytest.raises(ValueError, match="--num-processes 3: 32 devices do not split"):
    _dry_run_devices(ns(3, 32))


def test_prompt_ranges_partition_groups():
  for n, count in [(4, 2), (5, 2), (7, 3), (2, 4), (16, 8)]:
    ranges = [dist.prompt_range(n, i, count) for i in range(count)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1, (n, count, sizes)
  with pytest.raises(ValueError, match="index=2"):
    dist.prompt_range(4, 2, 2)
  reqs = [Request([1], SamplingParams(), (i, g)) for i in range(5) for g in range(3)]
  parts = [dist.local_request_index(reqs, index=i, count=2) for i in range(2)]
  assert np.array_equal(np.concatenate(parts), np.arange(15))
  assert {reqs[j].request_id[0] for j in parts[0]} == {0, 1, 2}  # groups stay whole


def _completions(reqs, rng, topk):
  out = []
  for r in reqs:
    n = int(rng.integers(0, 6))
    out.append(Completion(
        request_id=r.request_id, prompt_ids=np.asarray(r.prompt_ids, np.int32),
        token_ids=rng.integers(0, 50, n).astype(np.int32),
        logprobs=rng.normal(size=n).astype(np.float32),
        finish_reason=["stop", "length", "context", "pruned"][int(rng.integers(4))],
        topk_ids=rng.integers(0, 50, (n, topk)).astype(np.int32),
        topk_logprobs=rng.normal(size=(n, topk)).astype(np.float32),
        preemptions=int(rng.integers(3)), pruned=bool(rng.integers(2)),
        quality_logit=None if rng.integers(2) else float(np.float32(rng.normal())),
        detect_hidden=rng.normal(size=3).astype(np.float32), detect_index=int(rng.integers(5))))
  return out


def test_completion_gather_round_trip():
  rng = np.random.default_rng(0)
  reqs = [Request(list(rng.integers(1, 9, 1 + i % 3)), SamplingParams(), (i, g))
          for i in range(5) for g in range(2)]
  comps = _completions(reqs, rng, topk=2)
  parts = [dist.local_request_index(reqs, index=i, count=2) for i in range(2)]
  rows = max(len(p) for p in parts)
  packs = [wire.pack_completions([comps[j] for j in p], p, rows=rows, length=6, topk=2,
                                 hidden=3) for p in parts]
  stacked = {k: np.stack([p[k] for p in packs]) for k in packs[0]}  # what allgather returns
  back = wire.unpack_completions(stacked, reqs, topk=2, make=Completion)
  for a, b in zip(comps, back):
    assert a.request_id == b.request_id and a.finish_reason == b.finish_reason
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    for f in ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "detect_hidden"):
      np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert (a.preemptions, a.pruned, a.quality_logit, a.detect_index) == (
        b.preemptions, b.pruned, b.quality_logit, b.detect_index)
  with pytest.raises(ValueError, match=r"no process returned requests \[6, 7, 8, 9\]"):
    wire.unpack_completions({k: v[:1] for k, v in stacked.items()}, reqs, topk=2,
                            make=Completion)  # (process 1's pack lost)
  with pytest.raises(ValueError, match="came back twice"):
    wire.unpack_completions({k: np.concatenate([v, v]) for k, v in stacked.items()}, reqs,
                            topk=2, make=Completion)
  # One process: the gather is the identity (padding to the longest, no top-k kept).
  plain = _completions(reqs[:3], rng, topk=0)
  for c in plain:
    c.topk_ids = c.topk_logprobs = c.detect_hidden = None
  got = dist.gather_completions(plain, np.arange(3), reqs[:3], topk=0, make=Completion)
  assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in plain]
  assert got[0].topk_ids is None and got[0].detect_hidden is None
  stats = dist.merge_stats({"decode_steps": 3, "preemptions": 1, "pool_high_water_frac": .5},
                           ["decode_steps", "preemptions", "pool_high_water_frac"],
                           allgather=lambda x: np.stack([x, x * 2]))
  assert stats == {"decode_steps": 6.0, "preemptions": 3.0, "pool_high_water_frac": 1.0}


def test_single_process_fetch_and_stop_pass_through():
  x = jax.numpy.arange(4.0)
  np.testing.assert_array_equal(dist.fetch({"a": x})["a"], np.arange(4.0))
  assert dist.agree_stop("SIGTERM") == "SIGTERM" and dist.agree_stop(None) is None
  # Process 1 of 3 got SIGTERM: everyone stops, with its signal's name.
  others = lambda x: np.stack([np.zeros_like(x), np.full_like(x, 15), np.zeros_like(x)])
  assert dist.agree_stop(None, allgather=others) == "SIGTERM"
  assert dist.agree_stop(None, allgather=lambda x: np.stack([x, x])) is None


class _FakeStore:
  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.kv[key] = value

  def key_value_try_get(self, key):
    if key not in self.kv:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.kv[key]


def test_watchdog_names_the_lost_or_failed_peer():
  now = [0.0]
  store = _FakeStore()
  mk = lambda i: watchdog.Watchdog(timeout_s=5, client=store, index=i, count=3,
                                   clock=lambda: now[0])
  w0, w1, w2 = mk(0), mk(1), mk(2)
  for w in (w0, w1, w2):
    w.beat()
  assert w0.check() is None
  for t in (2.0, 4.0, 6.0):
    now[0] = t
    w0.beat()
    w2.beat()  # process 1 is silent from t=0 on
    w0.check()
  now[0] = 6.5
  assert w0.check() == "lost process 1 of 3: no heartbeat for 6 s (--heartbeat-timeout 5)"
  w1.stop("done")  # finished normally: no longer watched
  assert w0.check() is None and 1 not in w0._seen
  w2.stop("failed: ValueError: bad config")
  assert w0.check() == "process 2 of 3 failed: ValueError: bad config"

  class Gone(_FakeStore):
    def key_value_try_get(self, key):
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

  lone = watchdog.Watchdog(timeout_s=5, client=Gone(), index=1, count=2)
  assert lone.check().startswith("lost the coordinator (process 0)")


def test_metrics_logger_non_writer_writes_nothing(tmp_path):
  log = MetricsLogger(str(tmp_path / "run"), total_steps=2, quiet=True, tensorboard=False,
                      writer=False)
  log.log(1, {"reward/mean": 0.5})
  log.samples(1, [{"prompt": "p", "response": "r", "reward": 1.0}])
  summary = log.close()
  assert not (tmp_path / "run").exists()  # not even the folder: process 0 makes it
  assert summary["last_step"] == 1


# ----------------------------------------------------------------------------- end to end

_EXACT = ("reward/mean", "reward/std", "response/len_mean", "response/len_max",
          "rollout/tokens", "rollout/preemptions", "batch/micro_batches")
_CLOSE = ("loss/total", "loss/policy", "grad_norm", "loss/entropy", "mismatch/p5_overall")


def _same_step(a: dict, b: dict, what: str) -> None:
  for k in _EXACT:
    assert a[k] == b[k], (what, a["step"], k, a[k], b[k])
  for k in _CLOSE:
    if k in a:  # relative 1e-3, with an absolute floor for values at rounding level
      assert abs(a[k] - b[k]) <= 1e-3 * max(abs(a[k]), abs(b[k])) + 1e-6, (
          what, a["step"], k, a[k], b[k])


def _copy_run(src, dst, step: int) -> None:
  """A run folder as it was after `step`: config, metrics, checkpoints up to `step`."""
  os.makedirs(os.path.join(dst, "checkpoints"))
  shutil.copy(os.path.join(src, "config.json"), dst)
  with open(os.path.join(src, "metrics.jsonl")) as f, \
      open(os.path.join(dst, "metrics.jsonl"), "w") as g:
    g.writelines(ln for ln in f if json.loads(ln)["step"] <= step)
  for s in os.listdir(os.path.join(src, "checkpoints")):
    if s.isdigit() and int(s) <= step:
      shutil.copytree(os.path.join(src, "checkpoints", s), os.path.join(dst, "checkpoints", s))


def _wait_for_step(path: str, step: int, procs, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path) and step in read_jsonl(path):
      return
    if any(p.poll() is not None for p, _ in procs):
      raise AssertionError("a process ended early:\n" + "\n".join(
          open(f).read()[-3000:] for _, f in procs))
    time.sleep(0.5)
  raise AssertionError(f"step {step} not logged in {timeout} s")


@pytest.mark.slow
def test_two_processes_match_one_resume_across_counts_and_survive_a_kill(tmp_path):
  cache = str(tmp_path / "xla_cache")  # shared by every child: the resumes reuse programs
  extra = {"JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  args = lambda out, steps: H.TINY + [f"num_steps={steps}", f"out_dir={out}"]
  # The 2-process run is set for 50 steps, so that a lost signal shows as a run to the end.
  # SIGTERM to process 1 once step 3 is logged stops both after the same step, with one
  # checkpoint of it: the step in flight, or the next one when the signal lands inside a
  # step-end stop agreement (a signal there was once lost: the job ran to its last step).
  procs2 = H.start(2, args(two, 50), two + "_logs", env=extra)
  procs = H.start(1, args(one, 3), one + "_logs", env=extra) + procs2
  try:
    _wait_for_step(os.path.join(two, "metrics.jsonl"), 3, procs2, timeout=400)
    logged = max(read_jsonl(os.path.join(two, "metrics.jsonl")))  # >= 3
    os.kill(procs2[1][0].pid, signal.SIGTERM)
    res = H.wait_all(procs, timeout=300)
  finally:
    H.kill_all(procs)
  assert res[0][0] == 0, res[0][1][-4000:]
  for rc, out in res[1:]:
    assert rc == 130, out[-4000:]
  assert "SIGTERM: stopped after step" in res[1][1]  # process 0 stopped for process 1
  a = read_jsonl(os.path.join(one, "metrics.jsonl"))
  b = read_jsonl(os.path.join(two, "metrics.jsonl"))
  last = max(b)
  # Process 1 may be one step behind the logged one, and a signal inside an agreement waits
  # for the next: the last step is at most two past the one logged at the kill.
  assert sorted(a) == [1, 2, 3] and logged <= last <= logged + 2, (logged, last)
  assert sorted(b) == list(range(1, last + 1))
  assert max(int(s) for s in os.listdir(os.path.join(two, "checkpoints"))) == last
  # One writer: one metrics.jsonl (a record per step), one config.json, nothing else.
  with open(os.path.join(two, "metrics.jsonl")) as f:
    assert len(f.read().splitlines()) == last
  assert sorted(os.listdir(two)) == sorted(os.listdir(one))
  assert b[1]["reward/std"] > 0 and b[1]["grad_norm"] > 0  # a real signal is compared
  for step in (1, 2, 3):
    _same_step(a[step], b[step], "2 processes vs 1")

  # Resume across process counts: 2 -> 1 from the 2-process step 2, and 1 -> 2 from the
  # 1-process step 2 (set for 50 steps, so that it is mid-run when process 1 is killed once
  # step 3 is logged).
  two_to_one, one_to_two = str(tmp_path / "two_to_one"), str(tmp_path / "one_to_two")
  _copy_run(two, two_to_one, 2)
  _copy_run(one, one_to_two, 2)
  resumed1 = H.start(1, ["--quiet", "--resume", f"out_dir={two_to_one}", "num_steps=3"],
                     two_to_one + "_logs", env=extra)
  resumed2 = H.start(2, ["--quiet", "--resume", f"out_dir={one_to_two}", "num_steps=50"],
                     one_to_two + "_logs", env=extra, heartbeat=10)
  try:
    _wait_for_step(os.path.join(one_to_two, "metrics.jsonl"), 3, resumed2, timeout=300)
    os.killpg(resumed2[1][0].pid, signal.SIGKILL)  # process 1 dies mid-run (step 4 or later)
    t_kill = time.monotonic()
    survivor = resumed2[0][0]
    survivor.wait(timeout=60)  # raises TimeoutExpired if it hangs
    t_exit = time.monotonic() - t_kill
    res1 = H.wait_all(resumed1, timeout=300)
  finally:
    H.kill_all(resumed1 + resumed2)
  out0 = open(resumed2[0][1]).read()
  assert survivor.returncode != 0, out0[-3000:]
  assert "lost process 1 of 2" in out0, out0[-3000:]
  assert t_exit < 60
  assert res1[0][0] == 0, res1[0][1][-4000:]
  c = read_jsonl(os.path.join(two_to_one, "metrics.jsonl"))
  d = read_jsonl(os.path.join(one_to_two, "metrics.jsonl"))
  assert sorted(c) == [1, 2, 3]
  _same_step(c[3], a[3], "2 -> 1 resume vs uninterrupted 1-process run")
  _same_step(d[3], b[3], "1 -> 2 resume vs uninterrupted 2-process run")
  print(json.dumps({"survivor_exit_s": round(t_exit, 1), "survivor_rc": survivor.returncode,
                    "grad_norm": [b[s]["grad_norm"] for s in (1, 2, 3)]}))
