"""The benchmark scripts refuse configurations that cannot measure what they report."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_rollout_benchmark_refuses_a_model_with_no_sparse_layer(capsys):
  # The tiny preset has 2 layers and the schedule keeps layers 0-1 dense: nothing is sparse,
  # so a "speedup" would be noise (issue 12, item 10).
  assert _load("rollout").main(["--config", "tiny", "--contexts", "64"]) == 2
  assert "nothing sparse to measure" in capsys.readouterr().err


def test_rollout_bytes_bound_counts_what_each_layer_reads():
  from sparrow_jax.models.config import get_config
  from sparrow_jax.schedule import constant
  bench = _load("rollout")
  mc = get_config("smollm2_135m")
  sched = constant(16)
  kv_tok = 2 * mc.num_kv_heads * mc.head_dim * 4
  dense = bench.bytes_per_step(mc, sched, batch=2, context=8192, dense=True)
  sparse = bench.bytes_per_step(mc, sched, batch=2, context=8192, dense=False)
  # Dense reads every token of every layer; sparse layers read 19 pages + 512 landmarks.
  assert dense - sparse == 28 * 2 * (8192 * kv_tok - 19 * 16 * kv_tok
                                     - 512 * mc.num_kv_heads * mc.head_dim * 4)
  # A context within budget + reserved pages reads everything: no gain is possible there.
  small = bench.bytes_per_step(mc, sched, batch=2, context=256, dense=False)
  assert small > bench.bytes_per_step(mc, sched, batch=2, context=256, dense=True)
  # bf16 weights (the C++ kernels' copy) over a float32 cache: the weights' bytes halve, the
  # K/V and landmark bytes stay; a bf16 cache halves the K/V but not the float32 landmarks.
  params = (dense - 30 * 2 * 8192 * kv_tok) / 4
  bf16_w = bench.bytes_per_step(mc, sched, batch=2, context=8192, dense=True, itemsize=2,
                                kv_itemsize=4)
  assert bf16_w == dense - 2 * params
  both = [bench.bytes_per_step(mc, sched, batch=2, context=8192, dense=d, itemsize=2,
                               kv_itemsize=2) for d in (True, False)]
  assert both[0] - both[1] == 28 * 2 * (8192 * kv_tok // 2 - 19 * 16 * kv_tok // 2
                                        - 512 * mc.num_kv_heads * mc.head_dim * 4)


def test_vs_transformers_refuses_an_unknown_dtype(capsys):
  assert _load("rollout").main(["--vs-transformers", "--vt-dtypes", "float32,float16"]) == 2
  assert "--vt-dtypes 'float32,float16'" in capsys.readouterr().err


def test_cpu_matmul_refuses_bad_rows(capsys):
  bench = _load("cpu_matmul")
  assert bench.main(["--rows", "1,x"]) == 2
  assert "--rows '1,x'" in capsys.readouterr().err
  assert bench.main(["--rows", "0,4"]) == 2


def test_landmark_alpha_is_one_when_the_budget_holds_every_page():
  """landmark_dtype.py --alpha's measurement: a budget that selects every page is the dense
  policy (alpha 1 at every position, both landmark dtypes); one page is not."""
  import numpy as np

  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model

  lm = _load("landmark_dtype")
  model = init_model(get_config("tiny", num_layers=3, dtype="float32"), seed=0)
  ids = list(np.random.default_rng(0).integers(3, 200, 128))  # 8 pages of 16
  dts = ("float32", "bfloat16")
  res = lm.alpha_rows(model, [ids], {"full": np.full(128, 8), "one": np.full(128, 1)},
                     landmark_dtypes=dts, temperature=1.0)
  full, one = res["full"], res["one"]
  for dt in dts:
    np.testing.assert_allclose(full[dt], 1.0, atol=1e-5)
  assert all(one[dt][64:].min() < 0.999 for dt in dts)
  np.testing.assert_allclose(one["float32"][:48], 1.0, atol=1e-5)  # <= 1 + bos + 2 recent
