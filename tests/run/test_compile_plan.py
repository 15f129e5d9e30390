"""`--dry-run --compile` (run/compile_plan.py, run/dry_run.py): the decode chunk's CPU-only
compiler options are applied, change what XLA:CPU holds, and are reported beside the default
compile; nothing changes on a GPU mesh."""

import io
import json
import types

import jax
import jax.numpy as jnp

from sparrow_jax.run import compile_plan
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.dry_run import dry_run


def _decode_like():
  """A decode chunk in miniature: a loop over steps around a loop over stacked bf16 layer
  weights. XLA:CPU converts each layer's weights to float32 for its dot; with loop-invariant
  code motion the convert of the whole stack is hoisted out of the step loop."""
  layers, d = 8, 256

  def f(w, x):
    def step(i, x):
      return jax.lax.fori_loop(0, layers, lambda j, x: (x @ w[j]).astype(jnp.bfloat16), x)
    return jax.lax.fori_loop(0, 3, step, x)

  args = (jax.ShapeDtypeStruct((layers, d, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((4, d), jnp.bfloat16))
  return jax.jit(f), args, layers * d * d * 4  # bytes of the stack's float32 copy


def test_decode_options_drop_the_hoisted_float32_weight_copy():
  fn, args, f32_copy = _decode_like()
  plain = compile_plan._analyse("decode", fn, args, "toy")
  assert plain.options is None and plain.default_peak is None
  assert plain.temporaries >= f32_copy  # the hoisted float32 copy of every layer
  pm = compile_plan._analyse("decode", fn, args, "toy", compile_plan.CPU_DECODE_OPTIONS)
  assert pm.options == {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
  # the default compile is kept beside it, and is the plain compile's figure
  assert pm.default_peak == plain.peak and pm.default_temporaries == plain.temporaries
  assert pm.temporaries < f32_copy // 2  # one layer's copy at a time, not the stack's
  assert pm.default_peak - pm.peak >= f32_copy - pm.temporaries


def test_decode_options_only_on_a_cpu_mesh():
  mesh = compile_plan.make_compile_mesh(get_train_config("tiny", []), 1)
  assert compile_plan.decode_options(mesh) == compile_plan.CPU_DECODE_OPTIONS
  for platform in ("gpu", "cuda", "tpu"):
    fake = types.SimpleNamespace(devices=types.SimpleNamespace(
        flat=[types.SimpleNamespace(platform=platform)]))
    assert compile_plan.decode_options(fake) is None


def test_dry_run_compile_reports_the_cpu_only_options():
  cfg = get_train_config("tiny", ["distill=false", "num_slots=8"])
  out = io.StringIO()
  assert dry_run(cfg, num_devices=1, compile=True, as_json=True, out=out) == 0
  text = out.getvalue()
  record = json.loads(text.strip().splitlines()[-1])
  assert record["cpu_only_compiler_options"] == {
      "rollout_decode": compile_plan.CPU_DECODE_OPTIONS}
  decode = record["phases"]["rollout_decode"]
  assert decode["compiler_options"] == compile_plan.CPU_DECODE_OPTIONS
  assert decode["compiled_peak_bytes_default"] >= decode["compiled_peak_bytes"] > 0
  assert decode["temporaries_bytes_default"] >= decode["temporaries_bytes"]
  # only the decode chunk is compiled with them
  assert all("compiler_options" not in v for k, v in record["phases"].items()
             if k != "rollout_decode")
  assert ("^ rollout_decode: compiled with "
          "xla_disable_hlo_passes=while-loop-invariant-code-motion (CPU only") in text
  assert "as compiled by default: peak" in text
