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
