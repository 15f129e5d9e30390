"""Launching `experiments/train.py` as several jax processes on this machine (loopback
only), for `test_multihost.py`: one coordinator port per job, XLA host devices per process,
hard time limits, and every child killed in a `finally`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "experiments", "train.py")
REWARD = os.path.join(REPO, "tests", "run", "multihost_reward.py") + ":byte_parity"

# The tiny preset cut to a few seconds per step on a 2-core machine; `byte_parity` gives a
# random-init policy rewards of both values, so the GRPO loss and gradient are not zero.
TINY = ["--config", "tiny", "--quiet", "mesh=data=2,fsdp=4", "warmstart_steps=0",
        "prompts_per_step=4", "group_size=4", "max_new_tokens=4", "num_slots=4",
        "distill=false", "tensorboard=false", "sample_every=0", "save_every=1",
        "keep_last=3", "adam_eps=1e-6", f"reward={REWARD}", "reward_workers=1",
        "entropy_coeff=0.01"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, extra: dict | None = None) -> dict:
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(extra or {}))
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
    env.pop(k, None)
  return env


def start(num_processes: int, args: list[str], log_dir: str, *, devices: int | None = None,
          heartbeat: float = 10.0, env: dict | None = None
          ) -> list[tuple[subprocess.Popen, str]]:
  """Start `num_processes` train.py processes (8 devices in all) with `args` and `env` on
  top of the environment; stdout and stderr of process i go to log_dir/proc{i}.log.
  Returns [(popen, log path)]."""
  devices = devices or 8 // num_processes
  os.makedirs(log_dir, exist_ok=True)
  port = free_port()
  procs = []
  for i in range(num_processes):
    flags = ([] if num_processes == 1 else
             ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
              "--process-id", str(i), "--heartbeat-timeout", str(heartbeat)])
    path = os.path.join(log_dir, f"proc{i}.log")
    with open(path, "w") as log:
      procs.append((subprocess.Popen([sys.executable, TRAIN, *flags, *args], cwd=REPO,
                                     env=_env(devices, env), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True),
                    path))
  return procs


def kill_all(procs) -> None:
  for p, _ in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def wait_all(procs, timeout: float) -> list[tuple[int, str]]:
  """(exit status, output) of each process; all killed if any runs past `timeout`."""
  deadline = time.monotonic() + timeout
  try:
    for p, _ in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    kill_all(procs)
    raise AssertionError(f"processes ran past {timeout} s:\n" + "\n".join(
        open(path).read()[-3000:] for _, path in procs)) from None
  finally:
    kill_all(procs)
  return [(p.returncode, open(path).read()) for p, path in procs]


def run(num_processes: int, args: list[str], log_dir: str, timeout: float = 300,
        **kw) -> list[tuple[int, str]]:
  """start + wait_all; raises with the logs when a process fails."""
  res = wait_all(start(num_processes, args, log_dir, **kw), timeout)
  for i, (rc, out) in enumerate(res):
    assert rc == 0, f"process {i} exited {rc}:\n{out[-4000:]}"
  return res
