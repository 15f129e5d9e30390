"""The one-shot GPU suite (benchmarks/gpu_suite.py): its --smoke run on CPU writes a complete
JSON, and its driver records failures, time-guard skips and bad arguments as documented."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_suite.py")


@pytest.fixture(scope="module")
def suite():
  spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_suite"] = module  # dataclasses look their module up there
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    del sys.modules["gpu_suite"]


def _positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_smoke_run_writes_every_section(tmp_path):
  out = tmp_path / "suite.json"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  record = json.loads(out.read_text())
  meta = record["meta"]
  assert record["smoke"] is True
  assert meta["versions"]["jax"] and meta["versions"]["jaxlib"] and meta["date"]
  assert meta["device"] and meta["backend"] == "cpu"
  sections = record["sections"]
  # the sections that run jobs in their own processes first, then the rest in letter order
  assert list(sections) == ["g_main_job", "h_preset_step", "a_kernels_vs_reference",
                            "b_copy_bandwidth", "c_sparse_bandwidth", "d_dense_baseline",
                            "e_engine_decode", "f_readmission_agreement"]
  assert all(s["status"] == "ok" for s in sections.values()), sections

  checks = sections["a_kernels_vs_reference"]["results"]["checks"]
  assert {c["impl"] for c in checks} == {"dense_kernel", "dense_xla", "sparse_kernel"}
  assert all(c["ok"] and 0 < c["rel_err"] <= 2e-2 for c in checks)

  copy = sections["b_copy_bandwidth"]["results"]
  assert _positive(copy["gbps"]) and _positive(copy["ms"])

  sparse = sections["c_sparse_bandwidth"]["results"]
  assert [r["budget"] for r in sparse["rows"]] == [1, 2]
  selected = [r["selected_pages"] for r in sparse["rows"]]
  assert selected[0] < selected[1]  # a larger budget reads more pages
  for r in sparse["rows"]:
    assert all(_positive(r[k]) for k in ("kernel_ms", "kernel_gbps", "pct_of_copy", "step_ms",
                                         "topk_ms", "step_ms_bf16_landmarks"))
    assert r["kv_bytes"] == 2 * r["selected_pages"] * 16 * 16 * 2  # K+V, S=16, D=16, bf16
  assert all(_positive(sparse["score_ms"][k]) for k in ("float32", "bfloat16"))
  lm_bytes = sparse["landmark_bytes"]
  assert lm_bytes["float32"] == 2 * lm_bytes["bfloat16"] > 0  # bf16 landmarks: half the bytes

  dense = sections["d_dense_baseline"]["results"]
  assert [r["impl"] for r in dense["rows"]] == ["dense_kernel", "jax_paged_attention",
                                                "dense_xla"]
  assert all(_positive(r["ms"]) and _positive(r["gbps"]) for r in dense["rows"])
  # the three implementations compute the same attention (bf16 outputs)
  assert set(dense["rel_diff_vs_xla"]) == {"dense_kernel", "jax_paged_attention"}
  assert all(d < 2e-2 for d in dense["rel_diff_vs_xla"].values())
  # the dense kernel over section c's sparse step at each budget, measured in this run
  speedup = dense["dense_over_sparse_step"]
  assert sorted(map(int, speedup)) == [1, 2] and all(_positive(v) for v in speedup.values())

  engine = sections["e_engine_decode"]["results"]
  assert engine["schedule"] == "qwen3-1.7b-0.86" and [r["context"] for r in engine["rows"]] == [256]
  for r in engine["rows"]:
    assert all(_positive(r[k]) for k in ("dense_ms", "sparse_ms", "dense_tok_s", "sparse_tok_s"))
    assert r["budget_pages"] == 29  # the published table's first bin

  readmit = sections["f_readmission_agreement"]["results"]
  assert [r["attention"] for r in readmit["rows"]] == ["dense", "sparse"]
  for r in readmit["rows"]:  # on CPU a readmission changes no token
    assert r["preempted_requests"] > 0 and r["identical_frac"] == r["prefix_agreement"] == 1.0

  job = sections["g_main_job"]["results"]
  assert job["command"] == "python experiments/train.py --config tiny num_steps=1 warmstart_steps=0"
  assert job["summary"]["steps"] == 1 and job["summary"]["generated_tokens"] > 0
  assert _positive(job["wall_s"])

  preset = sections["h_preset_step"]["results"]  # smoke: the tiny model from an HF directory
  assert preset["command"].startswith("python experiments/train.py --config tiny num_steps=1")
  assert preset["summary"]["steps"] == 1 and preset["checkpoints"] == ["1"]
  (step,) = preset["steps"]
  assert step["step"] == 1 and step["rollout/tokens"] == preset["summary"]["generated_tokens"]
  assert all(_positive(step[k]) for k in ("time/step_s", "time/rollout_s", "time/update_s",
                                          "rollout/tokens_per_s", "time/compile_s"))
  assert step["time/compile_s"] < step["time/step_s"]  # the first step compiles, among others


def test_failures_and_time_guard_are_recorded(suite, tmp_path, monkeypatch):
  def failing(run):
    raise suite.CheckFailed("dense_kernel rel_err 0.5")

  def crashing(run):
    raise RuntimeError("boom")

  def guarded(run):
    done = [i for i in range(3) if run.has_time(f"item {i}")]
    return dict(done=done)

  monkeypatch.setitem(suite.SECTIONS, "x", suite.Section("x", "fails", 10, failing))
  monkeypatch.setitem(suite.SECTIONS, "y", suite.Section("y", "crashes", 10, crashing))
  monkeypatch.setitem(suite.SECTIONS, "z", suite.Section("z", "no_time", 0, guarded))
  out = tmp_path / "r.json"
  assert suite.main(["--smoke", "--sections", "x,crashes,z", "--out", str(out)]) == 1
  sections = json.loads(out.read_text())["sections"]
  assert sections["x_fails"]["status"] == "failed"
  assert "rel_err 0.5" in sections["x_fails"]["error"]
  assert sections["y_crashes"]["status"] == "error"
  assert "RuntimeError: boom" in sections["y_crashes"]["error"]
  assert sections["z_no_time"]["status"] == "partial"
  assert sections["z_no_time"]["results"] == {"done": []}
  assert sections["z_no_time"]["skipped"] == ["item 0", "item 1", "item 2"]


def test_bad_arguments_exit_2(suite, tmp_path, capsys):
  out = str(tmp_path / "r.json")
  assert suite.main(["--smoke", "--sections", "a,q", "--out", out]) == 2
  assert "'q'" in capsys.readouterr().err
  assert suite.main(["--smoke", "--out", str(tmp_path / "missing" / "r.json")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert suite.main(["--smoke", "--budget-s", "0", "--out", out]) == 2
  if suite.jax.default_backend() != "gpu":  # the full suite refuses to run without a GPU
    assert suite.main(["--out", out]) == 2
    assert "needs a GPU" in capsys.readouterr().err
  assert not os.path.exists(out)


def test_job_sections_report_a_failed_or_stuck_job_with_its_last_output(suite, tmp_path,
                                                                         monkeypatch):
  run = suite.Run(suite.SMOKE, True, 60.0)
  run.start_section(60.0)
  proc, wall = suite._run_job(run, "ok job", ["-c", "print('hello')"])
  assert proc.stdout.strip() == "hello" and wall > 0
  with pytest.raises(suite.CheckFailed, match=r"bad job exited 3: .*went wrong"):
    suite._run_job(run, "bad job", ["-c", "import sys; print('went wrong', file=sys.stderr); "
                                          "sys.exit(3)"])
  run.start_section(3.0)  # the guard ends the job and keeps what it printed
  with pytest.raises(suite.CheckFailed, match=r"stuck job did not finish in \d+ s; its last "
                                              r"output: .*started"):
    suite._run_job(run, "stuck job", ["-c", "import sys, time; print('started', "
                                            "file=sys.stderr, flush=True); time.sleep(60)"])
  # the steps a training run wrote before it stopped
  (tmp_path / "metrics.jsonl").write_text(
      json.dumps({"step": 1, "time/step_s": 2.5, "other": 1}) + "\n")
  assert suite._read_steps(str(tmp_path)) == [{"step": 1, "time/step_s": 2.5}]
  assert suite._read_steps(str(tmp_path / "none")) == []
  # the suite does not preallocate the GPU itself and may grow to 90% of it; a job gets the
  # user's environment back
  names = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
  for name in names:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(suite, "_SET_ENV", [])
  show = f"import os; print([os.environ.get(n) for n in {names!r}])"
  monkeypatch.setitem(suite.SECTIONS, "x", suite.Section(
      "x", "env", 10, lambda r: dict(job=suite._run_job(r, "env job", ["-c", show])[0]
                                     .stdout.strip(), suite=[os.environ[n] for n in names])))
  out = tmp_path / "r.json"
  assert suite.main(["--smoke", "--sections", "x", "--out", str(out)]) == 0
  res = json.loads(out.read_text())["sections"]["x_env"]["results"]
  assert res == {"job": "[None, None]", "suite": ["false", "0.9"]}
