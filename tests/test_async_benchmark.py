"""benchmarks/async_throughput.py --smoke runs both modes and ends with its JSON line."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_async_throughput_smoke():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "async_throughput.py"),
                        "--smoke"], capture_output=True, text=True, timeout=1800, check=True)
  lines = out.stdout.strip().splitlines()
  res = json.loads(lines[-1])
  assert {"sync_tokens_per_s", "async_tokens_per_s", "ratio", "sync_occupancy",
          "async_occupancy", "p99_over_p50"} <= set(res)
  assert res["sync_tokens_per_s"] > 0 and res["async_tokens_per_s"] > 0
  assert res["ratio"] == res["async_tokens_per_s"] / res["sync_tokens_per_s"]
  assert 0 < res["sync_occupancy"] <= 1 and 0 < res["async_occupancy"] <= 1
  assert res["p99_over_p50"] >= 1 and res["smoke"] is True
  assert any(l.startswith("response lengths") for l in lines)


def test_occupancy_simulation_keeps_each_rules_bound():
  """benchmarks/async_occupancy_sim.py: the per-token rule never trains a token older than N,
  the admission-only rule (AReaL's) does on a long tail; both beat the synchronous step's
  occupancy, the admission rule more."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "async_occupancy_sim", os.path.join(ROOT, "benchmarks", "async_occupancy_sim.py"))
  sim = importlib.util.module_from_spec(spec)
  sys.modules["async_occupancy_sim"] = sim  # dataclasses look their module up there
  try:
    spec.loader.exec_module(sim)
  finally:
    del sys.modules["async_occupancy_sim"]
  kw = dict(staleness=1, steps=40, seed=0)
  sync, token, admit = (sim.simulate(m, **kw) for m in ("sync", "per_token", "admission"))
  assert sync["max_age"] == 0 and token["max_age"] <= 1 and token["frac_age_over_n"] == 0
  assert admit["max_age"] > 1 and admit["frac_age_over_n"] > 0
  assert 0 < sync["occupancy"] < token["occupancy"] < admit["occupancy"] <= 1
  assert sync["tokens_per_decode_step"] < token["tokens_per_decode_step"]
