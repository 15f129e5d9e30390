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
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  record = json.loads(out.read_text())
  meta = record["meta"]
  assert record["smoke"] is True
  assert meta["versions"]["jax"] and meta["versions"]["jaxlib"] and meta["date"]
  assert meta["device"] and meta["backend"] == "cpu"
  sections = record["sections"]
  # the sections that run jobs in their own processes first, then the rest in the order
  # they are registered (f last: what the time guard cuts first)
  assert list(sections) == ["g_main_job", "h_preset_step", "j_step_dense_vs_sparse",
                            "k_async_vs_sync", "a_kernels_vs_reference",
                            "b_copy_bandwidth", "c_sparse_bandwidth", "d_dense_baseline",
                            "e_engine_decode", "i_engine_profile",
                            "l_append_extend_vs_decode", "f_readmission_agreement"]
  assert all(s["status"] == "ok" for s in sections.values()), sections

  checks = sections["a_kernels_vs_reference"]["results"]["checks"]
  assert {c["impl"] for c in checks} == {"dense_kernel", "dense_xla", "sparse_kernel",
                                         "page_scores_kernel"}
  for c in checks:  # attention to bf16 rounding; float32 page scores to float32 rounding
    assert c["ok"] and c["rel_err"] <= (1e-5 if c["impl"] == "page_scores_kernel" else 2e-2)
    assert c["impl"] == "page_scores_kernel" or c["rel_err"] > 0

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
    assert _positive(r["kernel_ms_no_pages"])  # the call with no slot valid
    assert r["pct_of_copy_past_fixed"] is None or _positive(r["pct_of_copy_past_fixed"])
    # the sparse launch sweep (SMOKE.sparse_sweep: 2 pages per block) timed beside it
    assert [c["config"]["pages_per_block"] for c in r["sweep"]] == [2]
    assert all(_positive(c[k]) for c in r["sweep"] for k in ("kernel_ms", "kernel_gbps",
                                                             "pct_of_copy"))
  assert all(_positive(sparse[t][k]) for k in ("float32", "bfloat16")
             for t in ("score_ms", "score_kernel_ms"))
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
  assert engine["landmark_dtype"] == "float32"  # the tiny preset's (the GPU presets': bf16)
  for r in engine["rows"]:
    assert all(_positive(r[k]) for k in ("dense_ms", "sparse_ms", "dense_tok_s", "sparse_tok_s",
                                         "sparse_xla_scores_ms", "speedup_xla_scores"))
    assert r["budget_pages"] == 29  # the published table's first bin
    assert r["batch"] == 2 and math.isclose(r["dense_tok_s"], 2e3 / r["dense_ms"])

  readmit = sections["f_readmission_agreement"]["results"]
  assert [r["attention"] for r in readmit["rows"]] == ["dense", "sparse"]
  for r in readmit["rows"]:  # on CPU a readmission changes no token
    assert r["preempted_requests"] > 0 and r["identical_frac"] == r["prefix_agreement"] == 1.0

  prof = sections["i_engine_profile"]["results"]
  assert prof["context"] == 256 and prof["steps"] == 3 * 2  # three chunks of two steps
  for name in ("sparse", "dense"):
    assert _positive(prof[name]["wall_ms_per_step_profiled"])
    threads = prof[name]["threads"]
    assert threads and all(_positive(t["busy_us_per_step"]) and t["kernels"]
                           for t in threads.values())
    for t in threads.values():
      assert all(_positive(k["us_per_step"]) and _positive(k["calls_per_step"])
                 for k in t["kernels"] + t["groups"])
    # the interpreter's ops carry no kernel names: no page-score kernel time on CPU
    assert prof[name]["page_scores_us_per_step"] == prof[name]["page_scoring_share"] == 0.0

  append = sections["l_append_extend_vs_decode"]["results"]
  assert append["schedule"] == "qwen3-1.7b-0.86" and append["errors"] == {}
  assert (append["batch"], append["context"], append["chunks"]) == (2, 200, [16])
  assert [(r["attention"], r["chunk"]) for r in append["rows"]] == [("sparse", 16),
                                                                    ("dense", 16)]
  for r in append["rows"]:
    assert all(_positive(r[k]) for k in ("extend_ms", "decode_loop_ms", "decode_step_ms",
                                         "ratio", "extend_tok_s", "decode_tok_s"))
    assert math.isclose(r["ratio"], r["decode_loop_ms"] / r["extend_ms"])
    # the same logits both ways up to the bf16 model's rounding (float32: ~1e-7)
    assert 0 <= r["max_abs_logit_diff"] < 1e-2 and _positive(r["max_abs_logit"])

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

  _check_step_section(sections["j_step_dense_vs_sparse"]["results"])
  _check_async_section(sections["k_async_vs_sync"]["results"])


def _check_step_section(res):
  """Section j's smoke: tiny model, 8 rollouts of 24-token prompts, responses forced to 8
  then 16 tokens, dense then the published schedule, one warm-up and one timed step each."""
  assert res["preset"] == "tiny" and res["skipped"] == [] and res["paper_table2"] is None
  assert [r["length"] for r in res["lengths"]] == [8, 16]
  for r in res["lengths"]:
    assert r["batch"] == 8 and r["group_size"] == 4 and r["forced_length"] is True
    fields = ("step_dense_s", "step_sparse_s", "rollout_dense_s", "rollout_sparse_s",
              "rollout_tokens_per_s_dense", "rollout_tokens_per_s_sparse", "rollout_speedup",
              "step_speedup")
    assert all(_positive(r[k]) for k in fields), r
    assert math.isclose(r["rollout_speedup"], r["rollout_dense_s"] / r["rollout_sparse_s"])
    assert math.isclose(r["step_speedup"], r["step_dense_s"] / r["step_sparse_s"])
    for mode in ("dense", "sparse"):
      eng = r[mode]
      assert r[f"step_{mode}_s"] == eng["step_s"] and r[f"rollout_{mode}_s"] == eng["rollout_s"]
      (warm, timed) = eng["steps"]
      # every rollout ran to exactly max_new_tokens: ignore_eos forced the length
      for st in (warm, timed):
        assert st["rollout/tokens"] == 8 * r["length"] and st["response/len_mean"] == r["length"]
        assert st["rollout/preemptions"] == 0  # the whole batch at once
      assert eng["step_s"] == timed["time/step_s"]  # the median of the one timed step
      assert math.isclose(r[f"rollout_tokens_per_s_{mode}"],
                          8 * r["length"] / timed["time/rollout_s"])
      # the phases are inside the step; the warm-up step compiled, and took longer for it
      assert eng["rollout_s"] + eng["update_s"] <= eng["step_s"]
      assert warm["time/compile_s"] > 0 and warm["time/step_s"] > timed["time/step_s"]


def test_step_batch_is_what_the_pool_holds_at_the_longest_sequence(suite):
  """Section j's batch for qwen3_1p7b on an H200 (planned, nothing allocated): the plan's
  sequences of the longest length, above the preset's 64 slots at 8K (the slot cap lifted),
  rounded to the preset's mini-batch of 64 or, where fewer fit, to groups of 8."""
  from sparrow_jax.run.builders import model_config
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.dry_run import plan_for_model

  batches = {}
  for length in (8192, 16384):
    cfg = get_train_config("qwen3_1p7b", [f"max_new_tokens={length}", "max_prompt_len=512"])
    batch, pool = suite.pool_batch(cfg, device_bytes=141e9)
    assert pool["sequences_held"] >= batch > 0 and pool["kv_pool_pages"] > 0
    unit = 64 if pool["sequences_held"] >= 64 else 8
    assert batch % unit == 0 and pool["sequences_held"] - batch < unit
    # the engine the job builds (one slot per rollout) holds them all at the longest length
    plan = plan_for_model(cfg.replace(num_slots=batch), model_config(cfg), 1,
                          device_bytes=141e9, activation_dtype="float32")
    assert plan.concurrency["at_max"] >= batch
    batches[length] = (batch, pool["sequences_held"])
  assert batches[8192][1] > 64 and batches[8192][0] == 64  # more than the preset's slots
  assert batches[16384][1] < 64 and batches[16384][0] % 8 == 0
  assert batches[16384][1] < batches[8192][1]


def test_engine_batch_is_what_the_preset_pool_holds(suite):
  from sparrow_jax.run.config import PRESETS
  from sparrow_jax.run.dry_run import memory_plan

  run = suite.Run(suite.FULL, False, 60.0)
  assert run.engine["batch"] == "pool"
  pages = memory_plan(PRESETS["qwen3_1p7b"], 1, device_bytes=141e9).kv_pool_pages
  got = {}
  for ctx in (32768, 16384, 8192):
    b = suite.engine_batch(run, ctx, 7, 16, device_bytes=141e9)
    per_seq = -(-suite._engine_seq_len(run, ctx, 7, 16) // 16)
    assert b * per_seq <= pages - 1 and (b == 64 or (b + 1) * per_seq > pages - 1)
    got[ctx] = b
  assert 16 < got[32768] < got[16384] <= got[8192] == 64  # more than runs 1-6's 16 at 32K
  fixed = suite.Run(suite.FULL, False, 60.0, engine=dict(suite.FULL_ENGINE, batch=16))
  assert suite.engine_batch(fixed, 32768, 7, 16) == 16


def test_append_section_cache_fits_an_h100_beside_the_model(suite):
  """Section l's cache at Qwen3-1.7B shapes (32 sequences x 8K tokens + the widest chunk, bf16
  K/V and the sparse attention's bf16 landmarks; one cache at a time): ~31 GB, with the bf16
  weights (~4 GB) well inside an H100's 78 GiB."""
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.kv_cache import kv_bytes_per_page
  from sparrow_jax.schedule import get_schedule

  z, sched_ = suite.FULL_APPEND, get_schedule("qwen3-1.7b-0.86")
  assert suite.FULL_ENGINE["model"] == "qwen3_1p7b" and max(z["chunks"]) == 64
  mcfg = get_config("qwen3_1p7b")
  per_seq = -(-(z["context"] + max(z["chunks"])) // sched_.page_size)
  pages = z["batch"] * per_seq + 1
  nbytes = pages * kv_bytes_per_page(
      num_layers=mcfg.num_layers, num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
      page_size=sched_.page_size, dtype="bfloat16", landmark=sched_.landmark,
      landmark_dtype="bfloat16")
  assert 25e9 < nbytes < 0.45 * 78 * 2 ** 30


def test_page_scoring_share_of_the_busiest_stream(suite):
  kernel = lambda group, us: dict(group=group, us_per_step=us, calls_per_step=1.0)
  threads = {"gpu / stream 7": dict(busy_us_per_step=1000.0, kernels=[], groups=[
      kernel("page_scores", 150.0), kernel("sparse_paged_decode", 400.0),
      kernel("page_scores_quest", 50.0)]),
      "gpu / stream 9": dict(busy_us_per_step=10.0, kernels=[],
                             groups=[kernel("page_scores", 10.0)])}
  assert suite.page_scoring_share(threads) == dict(page_scores_us_per_step=200.0,
                                                   page_scoring_share=0.2)
  assert suite.page_scoring_share({}) == dict(page_scores_us_per_step=0.0,
                                              page_scoring_share=0.0)


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


def test_full_run_leaves_out_the_sections_that_need_a_call_of_their_own(suite, tmp_path,
                                                                        monkeypatch):
  """Without --smoke the default sections are those of the 10-minute run: the step section
  (j, minutes per 8K step) and the async comparison (k, two trainers' steps) only when asked
  for; --smoke runs them all."""
  assert sorted(k for k, s in suite.SECTIONS.items() if s.own_call) == ["j", "k"]
  monkeypatch.setattr(suite, "SECTIONS", {
      "x": suite.Section("x", "short", 10, lambda r: dict(budget=r.total_deadline)),
      "y": suite.Section("y", "long", 10, lambda r: {}, own_process=True, own_call=True)})
  monkeypatch.setattr(suite.jax, "default_backend", lambda: "gpu")
  for argv, want in ((["--out"], ["x_short"]), (["--smoke", "--out"], ["y_long", "x_short"]),
                     (["--sections", "y", "--out"], ["y_long"])):
    out = tmp_path / "r.json"
    assert suite.main([*argv, str(out)]) == 0
    assert list(json.loads(out.read_text())["sections"]) == want


def test_bad_arguments_exit_2(suite, tmp_path, capsys):
  out = str(tmp_path / "r.json")
  assert suite.main(["--smoke", "--sections", "a,q", "--out", out]) == 2
  assert "'q'" in capsys.readouterr().err
  assert suite.main(["--smoke", "--out", str(tmp_path / "missing" / "r.json")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert suite.main(["--smoke", "--budget-s", "0", "--out", out]) == 2
  for bad in ("0", "8192,x", ""):
    assert suite.main(["--smoke", "--contexts", bad, "--out", out]) == 2
    assert "--contexts" in capsys.readouterr().err
    assert suite.main(["--smoke", "--step-lengths", bad, "--out", out]) == 2
    assert "--step-lengths" in capsys.readouterr().err
  for flag, bad in (("--step-batch", "0"), ("--engine-batch", "0"), ("--engine-batch", "all")):
    assert suite.main(["--smoke", flag, bad, "--out", out]) == 2
    assert flag in capsys.readouterr().err
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


@pytest.mark.parametrize("kind", ["mean", "quest", "none"])
def test_context_filler_writes_every_page_and_its_landmarks_in_pieces(suite, kind):
  jnp = suite.jnp
  k = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)  # [kv heads, pages, page size, head dim]
  n_lm = {"mean": 1, "quest": 2, "none": 0}[kind]
  lms = tuple(jnp.zeros((2, 8, 16), jnp.bfloat16) for _ in range(n_lm))
  # 3-page pieces over 8 pages: the last piece overlaps the one before it
  k2, v2, lm2 = suite.make_fill_layer(kind, piece_pages=3)(k, jnp.zeros_like(k), lms,
                                                            suite.jax.random.key(1))
  assert k2.dtype == v2.dtype == jnp.bfloat16 and k2.shape == v2.shape == k.shape
  for x in (k2, v2):  # every page holds random values, K and V differ
    assert bool(jnp.all(jnp.any(x != 0, axis=(0, 2, 3))))
  assert not bool(jnp.array_equal(k2, v2))
  # the landmarks are those of the keys now in the pool (pieces written where they belong)
  want = suite.landmarks.compute_landmarks(k2, jnp.full((2, 8), 4), kind) if n_lm else ()
  want = want if isinstance(want, tuple) else (want,)
  assert len(lm2) == n_lm
  for got, ref in zip(lm2, want):
    # up to the keys' bf16 rounding (half an ulp below 4: 2**-8): XLA may average the random
    # keys before rounding them (excess precision); a misplaced piece is off by ~0.5
    assert got.dtype == jnp.bfloat16
    suite.np.testing.assert_allclose(got.astype(jnp.float32), ref, rtol=2 ** -7, atol=2 ** -7)


def test_context_filler_temporaries_stay_a_piece_at_qwen3_1p7b_32k(suite):
  """16 sequences x 32K tokens of Qwen3-1.7B: a layer's K is 1.08 GB of bf16. The filler runs
  donated (outputs alias the pool) with temporaries a fraction of one layer: a whole layer's
  float32 keys (2.16 GB) did not find room beside the 60 GB pool on the H200."""
  jax, jnp = suite.jax, suite.jnp
  pages = 16 * (32768 + 160) // 16  # the suite's engine pool at 32K
  k = jax.ShapeDtypeStruct((8, pages, 16, 128), jnp.bfloat16)
  lm = (jax.ShapeDtypeStruct((8, pages, 128), jnp.bfloat16),)
  key = jax.eval_shape(lambda: jax.random.key(0))
  mem = suite.make_fill_layer("mean").lower(k, k, lm, key).compile().memory_analysis()
  layer = 8 * pages * 16 * 128 * 2
  assert mem.alias_size_in_bytes == 2 * layer + 8 * pages * 128 * 2  # K, V, landmarks in place
  assert mem.temp_size_in_bytes < 0.6 * layer, mem.temp_size_in_bytes


def test_trace_summary_sums_device_kernels_per_step_and_groups_layer_copies(suite, tmp_path):
  import gzip
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #14"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "python"}},
  ]
  for step in range(2):  # two decode steps, two layers each
    for layer in (41, 57):
      events.append({"ph": "X", "pid": 1, "tid": 7, "name": f"sort_{layer}_1", "dur": 20.0,
                     "args": {"hlo_op": f"sort.{layer}", "other": "dropped"}})
    events.append({"ph": "X", "pid": 1, "tid": 7, "name": "sparse_paged_decode", "dur": 100.0})
    events.append({"ph": "X", "pid": 1, "tid": 7, "name": "end: sparse_paged_decode", "dur": 5})
    events.append({"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(f)", "dur": 999.0})
  path = tmp_path / "plugins" / "profile" / "run"
  path.mkdir(parents=True)
  with gzip.open(path / "host.perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  out = suite.trace_summary(str(tmp_path), steps=2)
  assert list(out) == ["/device:GPU:0 / Stream #14"]  # the host process is not a device
  t = out["/device:GPU:0 / Stream #14"]
  assert t["busy_us_per_step"] == 140.0
  assert t["kernels"][0] == dict(name="sparse_paged_decode", us_per_step=100.0,
                                 calls_per_step=1.0)
  assert t["kernels"][1] == dict(name="sort_41_1", us_per_step=20.0, calls_per_step=1.0,
                                 hlo_op="sort.41")
  assert t["groups"] == [dict(group="sparse_paged_decode", us_per_step=100.0, calls_per_step=1.0),
                         dict(group="sort", us_per_step=40.0, calls_per_step=2.0)]
  with pytest.raises(suite.CheckFailed, match="no perfetto trace"):
    suite.trace_summary(str(tmp_path / "plugins" / "profile" / "missing"), steps=1)


def test_kernel_group_strips_xla_numbering(suite):
  assert suite.kernel_group("sort_57_1") == "sort"
  assert suite.kernel_group("gemm_fusion_dot_111") == "gemm_fusion_dot"
  assert suite.kernel_group("loop_select_fusion_2") == "loop_select_fusion"
  assert suite.kernel_group("while.67") == "while"
  assert suite.kernel_group("sparse_paged_decode") == "sparse_paged_decode"
  assert suite.kernel_group("fusion_3023") == "fusion"


def _check_async_section(res):
  """Section k's smoke: async_throughput.py --smoke, its JSON line and per-mode lines."""
  assert res["command"] == "python benchmarks/async_throughput.py --smoke"
  r = res["result"]
  assert r["smoke"] is True and r["max_staleness"] == 1
  assert _positive(r["sync_tokens_per_s"]) and _positive(r["async_tokens_per_s"])
  assert r["ratio"] == r["async_tokens_per_s"] / r["sync_tokens_per_s"]
  assert 0 < r["sync_occupancy"] <= 1 and 0 < r["async_occupancy"] <= 1
  assert [l.split(" (")[0].split(":")[0] for l in res["modes"]] == ["sync", "async",
                                                                  "response lengths"]
  assert _positive(res["wall_s"])


def test_async_section_alone_in_smoke(tmp_path):
  """`--sections k` (a call of its own on a GPU) runs the async comparison's smoke on CPU."""
  out = tmp_path / "k.json"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--sections", "k", "--out",
                         str(out)], env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  sections = json.loads(out.read_text())["sections"]
  assert list(sections) == ["k_async_vs_sync"] and sections["k_async_vs_sync"]["status"] == "ok"
  _check_async_section(sections["k_async_vs_sync"]["results"])
