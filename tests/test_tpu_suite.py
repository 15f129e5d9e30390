"""The TPU suite (benchmarks/tpu_suite.py, the GPU suite's twin): its --smoke run in TPU
interpret mode writes every section, and it refuses a full run without a TPU."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tpu_suite.py")


def _positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # ~2-5 min: the TPU interpreter traces every kernel call
def test_smoke_run_writes_every_section(tmp_path):
  out = tmp_path / "suite.json"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], env=env,
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  record = json.loads(out.read_text())
  sections = record["sections"]
  assert list(sections) == ["a_kernels_vs_reference", "b_copy_bandwidth",
                            "c_sparse_bandwidth", "d_dense_baseline", "e_engine_decode"]
  assert all(s["status"] == "ok" for s in sections.values()), sections
  checks = sections["a_kernels_vs_reference"]["results"]["checks"]
  assert {c["impl"] for c in checks} == {"dense_kernel", "dense_xla", "sparse_kernel"}
  assert all(c["ok"] and 0 < c["rel_err"] <= 2e-2 for c in checks)
  sparse = sections["c_sparse_bandwidth"]["results"]
  assert sparse["config"] == {"pages_per_block": 2}
  assert [r["budget"] for r in sparse["rows"]] == [1, 2]
  assert all(_positive(r["kernel_ms"]) and _positive(r["topk_ms"]) for r in sparse["rows"])
  dense = sections["d_dense_baseline"]["results"]
  assert [r["impl"] for r in dense["rows"]] == ["dense_kernel", "dense_xla"]
  assert dense["rel_diff_vs_xla"]["dense_kernel"] < 2e-2
  engine = sections["e_engine_decode"]["results"]
  assert all(_positive(r["sparse_ms"]) and _positive(r["dense_ms"]) for r in engine["rows"])


def test_full_run_needs_a_tpu(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("tpu_suite", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = str(tmp_path / "r.json")
  if module.jax.default_backend() != "tpu":
    assert module.main(["--out", out]) == 2
    assert "needs a TPU" in capsys.readouterr().err
  assert module.main(["--smoke", "--sections", "a,x", "--out", out]) == 2
  assert "'x'" in capsys.readouterr().err
  assert not os.path.exists(out)
