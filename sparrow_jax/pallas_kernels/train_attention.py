"""The one place that decides how training-side (whole-sequence) causal attention runs.

The dense recompute, the GRPO update, DistillSparse's dense layers, the ladder probe and the
engine's prefill all attend whole sequences causally. `TrainAttention` names the
implementations and `resolve_train_attention` turns `AUTO` into one of them, once per call,
from the platform and the compute dtype; asking for one that cannot run is a `ValueError`,
never a silent fallback. (Decode attention has its own enum, `dispatch.Backend`.)

  CUDNN      `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`: cuDNN's
             fused flash attention (forward and backward), bfloat16 / float16 operands with
             float32 accumulation inside cuDNN. GPU only.
  XLA        `flash_xla.flash_attention_causal`: query chunks over the key blocks up to each
             chunk, online float32 softmax, custom VJP; operands keep their dtype. Any
             platform (the CPU path, and the GPU path for float32 models).
  REFERENCE  `teacher_forced.dense_attention_causal_reference`: the previous full-key chunks
             in float32 (every chunk attends to all keys, the future masked). Tests and
             benchmarks compare against it; nothing selects it by itself.

`AUTO` -> CUDNN on a GPU when the compute dtype is bfloat16 or float16, XLA otherwise (cuDNN's
flash attention has no float32 kernel). The block-sparse teacher-forced path has no cuDNN
form (its mask is per query and page): it always runs `flash_xla` with its page mask.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from sparrow_jax.args import as_member
from sparrow_jax.pallas_kernels import teacher_forced

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class TrainAttention(enum.Enum):
  """Implementation of whole-sequence causal attention (training, prefill)."""
  AUTO = "auto"
  XLA = "xla"
  CUDNN = "cudnn"
  REFERENCE = "reference"


def as_train_attention(impl) -> TrainAttention:
  """`TrainAttention` from a member or its string value; ValueError naming the choices."""
  return as_member(TrainAttention, impl, "train attention")


def _is_gpu(platform: str) -> bool:
  return platform in ("gpu", "cuda", "rocm")


def resolve_train_attention(impl=TrainAttention.AUTO, *, dtype,
                            platform: str | None = None) -> TrainAttention:
  """Concrete implementation for `impl` at compute `dtype` on `platform` (default: jax's
  default backend, where jitted training steps run).

  AUTO -> CUDNN on a GPU with a bfloat16 / float16 compute dtype, else XLA. CUDNN off a GPU
  or with another dtype raises ValueError.
  """
  impl = as_train_attention(impl)
  platform = platform or jax.default_backend()
  dtype = jnp.dtype(dtype)
  match impl:
    case TrainAttention.AUTO:
      if _is_gpu(platform) and dtype in _CUDNN_DTYPES:
        return TrainAttention.CUDNN
      return TrainAttention.XLA
    case TrainAttention.CUDNN:
      if not _is_gpu(platform):
        raise ValueError(f"train attention='cudnn' needs a GPU, but the platform is "
                         f"{platform!r}; use 'xla' (or 'auto')")
      if dtype not in _CUDNN_DTYPES:
        raise ValueError(f"train attention='cudnn' needs bfloat16 or float16 operands, got "
                         f"dtype={dtype.name}; use 'xla' for {dtype.name} (or 'auto')")
      return impl
    case _:
      return impl


def causal_attention(q, k, v, *, lengths=None, impl=TrainAttention.AUTO, block: int = 128,
                     sm_scale=None, platform: str | None = None):
  """Causal GQA attention of whole sequences starting at position 0.

  Args:
    q: [B, T, H, D]; k, v: [B, T, K, D] (query head h uses kv head h // (H // K)).
    lengths: optional [B] valid tokens per row; outputs at t >= lengths are 0 (a query never
      sees keys after it, so padding does not change valid positions).
    impl: TrainAttention or its string value, resolved by `resolve_train_attention`.
    block: query chunk / key block of the XLA path (speed knob; same result).
    sm_scale: softmax scale, default 1/sqrt(D).
  Returns:
    [B, T, H, D] in q.dtype.
  """
  match resolve_train_attention(impl, dtype=q.dtype, platform=platform):
    case TrainAttention.XLA:
      return teacher_forced.dense_attention_causal(q, k, v, lengths=lengths, sm_scale=sm_scale,
                                                   query_chunk=block)
    case TrainAttention.REFERENCE:
      return teacher_forced.dense_attention_causal_reference(q, k, v, lengths=lengths,
                                                             sm_scale=sm_scale)
    case TrainAttention.CUDNN:
      teacher_forced.check_qkv(q, k, v, lengths)
      # cuDNN takes [B, T, N, H] with GQA (N a multiple of K) as is; the causal mask is
      # applied inside the kernel, which skips the blocks above the diagonal.
      out = jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=True,
                                         implementation="cudnn")
      return teacher_forced.zero_past_lengths(out, lengths)
    case other:
      raise AssertionError(f"unresolved train attention {other}")
