"""Rollouts sharded over 8 fake CPU devices equal a 1-device run (engine and trainer).

Runs `sharded_engine_check.py` in a subprocess: `--xla_force_host_platform_device_count=8`
only works if XLA_FLAGS is set before jax is imported.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded_engine")
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "engine",
                                                      "sharded_engine_check.py"), str(out)],
                        capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["dense_t0", "sparse_t1"])
def test_sharded_engine_equals_one_device(result, case):
  r = result["engine"][case]
  assert r["same_tokens"], r
  assert r["max_logprob_diff"] < 1e-5, r
  assert r["devices"] == 8 and r["global_pages"] == 8 * r["shard_pages"] == 8 * 24
  assert r["preemptions_1dev"] > 0  # the 1-device run had to preempt
  assert sum(x > 0 for x in r["admissions_per_device"]) == 8  # every device did work


@pytest.mark.parametrize("case", ["dense", "sparse"])
def test_sharded_append_path_equals_one_device(result, case):
  """Tool responses appended into the pages of sequences on 8 shards (6 trajectories, one
  slot per device): the trajectories of the 1-device engine."""
  r = result["agent"][case]
  assert r["same_tokens"] and r["same_mask"], r
  assert r["max_logprob_diff"] < 1e-5, r
  assert r["env_tokens"] > 0 and r["append_tokens_8dev"] == r["append_tokens_1dev"] > 0, r
  if r["preemptions_8dev"] == 0:  # only the prompts were prefilled: the history never was
    assert r["prefill_tokens_8dev"] == r["prompt_tokens"], r
  assert sum(x > 0 for x in r["admissions_per_device"]) == 6, r


def test_sharded_training_run_equals_one_device(result):
  t = result["trainer"]
  assert t["engine_devices"] == 8
  m = t["metrics"]
  for key in ("reward/mean", "response/len_mean", "rollout/tokens"):
    assert m[key][0] == m[key][1], (key, m[key])
  assert all(abs(x) > 1e-4 for x in m["grad_norm"][0]), m  # the update really did something
  for key in ("loss/total", "grad_norm"):
    np.testing.assert_allclose(m[key][0], m[key][1], rtol=1e-4, atol=1e-6, err_msg=key)
