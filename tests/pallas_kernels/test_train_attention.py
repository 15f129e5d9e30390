"""Which whole-sequence attention runs where (`train_attention`), and that each one is right.

On a GPU with a bfloat16 compute dtype the training path is cuDNN's flash attention; the
resolution is checked for platform "gpu" on this CPU, and the cuDNN program is lowered for
CUDA here (jax's cuDNN version check needs the CUDA plugin, so it is stubbed on machines
without one; with a GPU the real check runs) and must hold cuDNN's fused forward and backward
custom calls with the causal mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.pallas_kernels import teacher_forced as tf
from sparrow_jax.pallas_kernels import train_attention as ta
from sparrow_jax.pallas_kernels.train_attention import TrainAttention


@pytest.mark.parametrize("impl,platform,dtype,want", [
    ("auto", "gpu", jnp.bfloat16, TrainAttention.CUDNN),
    ("auto", "cuda", jnp.float16, TrainAttention.CUDNN),
    ("auto", "gpu", jnp.float32, TrainAttention.XLA),  # cuDNN flash has no float32 kernel
    ("auto", "cpu", jnp.bfloat16, TrainAttention.XLA),
    ("auto", "tpu", jnp.bfloat16, TrainAttention.XLA),
    ("xla", "gpu", jnp.bfloat16, TrainAttention.XLA),
    (TrainAttention.CUDNN, "gpu", jnp.bfloat16, TrainAttention.CUDNN),
    ("reference", "cpu", jnp.float32, TrainAttention.REFERENCE),
])
def test_resolution(impl, platform, dtype, want):
  assert ta.resolve_train_attention(impl, dtype=dtype, platform=platform) is want


def test_refusals_name_the_problem():
  with pytest.raises(ValueError, match="needs a GPU, but the platform is 'cpu'"):
    ta.resolve_train_attention("cudnn", dtype=jnp.bfloat16, platform="cpu")
  with pytest.raises(ValueError, match="bfloat16 or float16 operands, got dtype=float32"):
    ta.resolve_train_attention("cudnn", dtype=jnp.float32, platform="gpu")
  with pytest.raises(ValueError, match="train attention='flash'"):
    ta.resolve_train_attention("flash", dtype=jnp.float32)
  with pytest.raises(ValueError, match="flash"):
    attn_lib.Dense(train_backend="flash")
  with pytest.raises(ValueError, match="flash"):
    attn_lib.BlockSparse(max_budget=2, train_backend="flash")


def test_cpu_paths_agree_with_the_reference():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 45, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 45, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 45, 2, 16)), jnp.float32)
  lengths = jnp.asarray([45, 30])
  want = tf.dense_attention_causal_reference(q, k, v, lengths=lengths)
  for impl in ("auto", "xla", "reference"):
    got = ta.causal_attention(q, k, v, lengths=lengths, impl=impl, block=16)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=impl)
  assert float(jnp.abs(got[1, 30:]).max()) == 0.0


def _has_gpu():
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def test_gpu_path_lowers_to_cudnn_flash_attention(monkeypatch):
  from jax import export
  if not _has_gpu():  # jax asks the CUDA plugin for cuDNN's version while tracing
    from jax._src.cudnn import fused_attention_stablehlo
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  q = jax.ShapeDtypeStruct((2, 256, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  fwd = lambda q, k, v, n: ta.causal_attention(q, k, v, lengths=n, platform="gpu")

  def grad(q, k, v, n):
    return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, n).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 2))(q, k, v)

  skip = [export.DisabledSafetyCheck.custom_call(t)
          for t in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]
  for fn, targets in ((fwd, ["__cudnn$fmhaSoftmax("]),
                      (grad, ["__cudnn$fmhaSoftmax(", "__cudnn$fmhaSoftmaxBackward("])):
    text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=skip)(
        q, kv, kv, lengths).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    for target in targets:
      hits = [c for c in calls if target in c]
      assert hits, (target, [c[:120] for c in calls])
      assert all("CAUSAL" in c and "bf16" in c for c in hits)
