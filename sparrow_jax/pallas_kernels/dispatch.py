"""The one place that decides how decode attention runs: Pallas kernel or XLA.

`Backend` names the implementations; `resolve_backend` turns `AUTO` into a concrete one once
(Pallas Triton on a GPU, Pallas Mosaic on a TPU, XLA elsewhere) and refuses a backend that
cannot run here: there is no silent fallback. `sparse_decode_attention` (selected pages) and
`dense_decode_attention` (all of a sequence's pages) are the entry points the decoder calls.

                    sparse                                 dense
  XLA               `reference.sparse_decode_reference`    `blocked_decode.dense_decode_blocked`
                    (pure jnp, float32; also the           (page blocks in a loop, online
                    reference)                             softmax, no materialised gather;
                                                           cache-dtype operands, float32
                                                           accumulation; the CPU path)
  PALLAS            `sparse_decode.sparse_decode`          `paged_decode.paged_decode`
                    (Triton lowering, needs a GPU)         (Triton lowering, needs a GPU)
  PALLAS_INTERPRET  the same kernels in the Pallas interpreter (any platform; slow, for tests).
  PALLAS_TPU        `tpu_decode.sparse_decode_tpu`     `tpu_decode.dense_decode_tpu`
                    (Mosaic TPU, scalar-prefetched     (jax's `ops.tpu.paged_attention`;
                    pages, needs a TPU)                float32 caches: the block kernel)
  PALLAS_TPU_INTERPRET  the TPU kernels in TPU interpret mode (CPU; simulated DMAs; for tests).
  CPU               `cpu_kernels.decode_attention`     the same C++ loop, over all of a
                    (C++ through XLA's FFI, float32    slot's pages
                    online softmax over the selected
                    pages; the CPU platform only)

A Mosaic GPU kernel can be added later as another member without touching the callers.
"""

from __future__ import annotations

import enum

import jax

from sparrow_jax import cpu_kernels
from sparrow_jax.args import as_member
from sparrow_jax.pallas_kernels import split_k
from sparrow_jax.pallas_kernels.blocked_decode import dense_decode_blocked
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig, paged_decode
from sparrow_jax.pallas_kernels.reference import sparse_decode_reference
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig, sparse_decode
from sparrow_jax.pallas_kernels.tpu_decode import (TpuDecodeConfig, dense_decode_tpu,
                                                   sparse_decode_tpu)


class Backend(enum.Enum):
  """Implementation of decode attention."""
  AUTO = "auto"
  XLA = "xla"
  PALLAS = "pallas"
  PALLAS_INTERPRET = "pallas_interpret"
  PALLAS_TPU = "pallas_tpu"
  PALLAS_TPU_INTERPRET = "pallas_tpu_interpret"
  CPU = "cpu"


def _has(platform: str) -> bool:
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def _has_gpu() -> bool:
  return _has("gpu")


def is_tpu_backend(backend: Backend) -> bool:
  return backend in (Backend.PALLAS_TPU, Backend.PALLAS_TPU_INTERPRET)


def is_kernel_backend(backend: Backend) -> bool:
  """A Pallas backend (its selection is padded to the kernel's blocks)."""
  return backend not in (Backend.XLA, Backend.AUTO, Backend.CPU)


def default_config(backend: Backend, page_size: int):
  """The sparse launch config a resolved kernel backend runs with when none is given (what
  the sparse kernel itself defaults to for caches of `page_size`-token pages, so the
  selection is padded to the kernel's blocks)."""
  if is_tpu_backend(backend):
    return TpuDecodeConfig()
  if backend in (Backend.PALLAS, Backend.PALLAS_INTERPRET):
    return split_k.default_config(SparseDecodeConfig, page_size)
  return None


def page_scorer(backend: Backend) -> str:
  """`selection.select_decode_pages`' scorer for a resolved backend: the Triton page-score
  kernel with the Triton attention kernels (compiled or interpreted), XLA otherwise."""
  if backend is Backend.PALLAS:
    return "pallas"
  if backend is Backend.PALLAS_INTERPRET:
    return "pallas_interpret"
  return "xla"


def parse_backend(backend) -> Backend:
  """`backend` (a Backend or its string value) as a Backend; ValueError naming the choices."""
  return as_member(Backend, backend, "backend")


def resolve_backend(backend=Backend.AUTO) -> Backend:
  """Concrete backend for `backend` (a Backend or its string value) on this machine.

  AUTO -> PALLAS when a GPU is present, PALLAS_TPU when a TPU is, XLA otherwise. PALLAS
  without a GPU, PALLAS_TPU without a TPU and CPU where its C++ kernels cannot be built (or
  jax's default backend is not the CPU) raise ValueError.
  """
  backend = parse_backend(backend)
  match backend:
    case Backend.AUTO:
      if _has_gpu():
        return Backend.PALLAS
      return Backend.PALLAS_TPU if _has("tpu") else Backend.XLA
    case Backend.PALLAS:
      if not _has_gpu():
        raise ValueError(
            f"backend={backend.value!r}: the Pallas Triton kernel needs a GPU, but jax sees "
            f"only {sorted({d.platform for d in jax.devices()})}; use 'xla' or "
            "'pallas_interpret'")
      return backend
    case Backend.PALLAS_TPU:
      if not _has("tpu"):
        raise ValueError(
            f"backend={backend.value!r}: the Pallas Mosaic TPU kernel needs a TPU, but jax "
            f"sees only {sorted({d.platform for d in jax.devices()})}; use 'xla' or "
            "'pallas_tpu_interpret'")
      return backend
    case Backend.CPU:
      try:
        cpu_kernels.require("backend='cpu'")
      except RuntimeError as e:
        raise ValueError(f"{e}; use 'xla'") from None
      return backend
    case _:
      return backend


def _decode(backend, sparse: bool, args: tuple, sm_scale, config):
  """Runs decode attention on the resolved `backend`: the one `match` from backend to
  implementation for both entry points. `args` are the positional arrays (with the selection
  `page_idx`, `valid` when `sparse`); the Pallas implementations also take `config` and
  `interpret`."""
  backend = resolve_backend(backend)
  kernel = dict(config=config, interpret=backend in (Backend.PALLAS_INTERPRET,
                                                     Backend.PALLAS_TPU_INTERPRET))
  match backend:
    case Backend.XLA:
      fn, kw = (sparse_decode_reference if sparse else dense_decode_blocked), {}
    case Backend.PALLAS | Backend.PALLAS_INTERPRET:
      fn, kw = (sparse_decode if sparse else paged_decode), kernel
    case Backend.PALLAS_TPU | Backend.PALLAS_TPU_INTERPRET:
      fn, kw = (sparse_decode_tpu if sparse else dense_decode_tpu), kernel
    case Backend.CPU:
      fn, kw = cpu_kernels.decode_attention, {}
    case other:
      raise AssertionError(f"unresolved backend {other}")
  return fn(*args, sm_scale=sm_scale, **kw)


def sparse_decode_attention(q, k_pages, v_pages, page_table, lengths, page_idx, valid, *,
                            backend=Backend.AUTO, sm_scale=None,
                            config: SparseDecodeConfig | None = None):
  """Decode attention of one token per sequence over its selected pages.

  Args:
    q: [B, H, D] queries of the current token (already written into the cache).
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer.
    page_table: [B, M] int32 logical -> physical page ids.
    lengths: [B] int32 tokens in the cache including the current one.
    page_idx: [B, K, N] int32 selected logical page ids; valid: [B, K, N] bool (from
      `selection.select_pages`).
    backend: Backend or its string value (static); resolved by `resolve_backend`.
    sm_scale: softmax scale, default 1/sqrt(D).
    config: SparseDecodeConfig for the Pallas Triton backends, TpuDecodeConfig for the TPU
      ones (ignored by XLA).
  Returns:
    [B, H, D] in q.dtype.
  """
  return _decode(backend, True, (q, k_pages, v_pages, page_table, lengths, page_idx, valid),
                 sm_scale, config)


def dense_decode_attention(q, k_pages, v_pages, page_table, lengths, *, backend=Backend.AUTO,
                           sm_scale=None, config: PagedDecodeConfig | None = None):
  """Decode attention of one token per sequence over all of its cached tokens.

  Args:
    q: [B, H, D] queries of the current token (already written into the cache).
    k_pages, v_pages: [K, P, S, D] paged key/value pool of one layer, in the cache dtype.
    page_table: [B, M] int32 logical -> physical page ids; M may be bucketed to the longest
      active sequence (the XLA path reads all M columns, the kernel only each sequence's own).
    lengths: [B] int32 tokens in the cache including the current one (0 = empty slot,
      output 0).
    backend: Backend or its string value (static); resolved by `resolve_backend`.
    sm_scale: softmax scale, default 1/sqrt(D).
    config: PagedDecodeConfig for the Pallas Triton backends, TpuDecodeConfig for the TPU
      ones (ignored by XLA).
  Returns:
    [B, H, D] in q.dtype.
  """
  return _decode(backend, False, (q, k_pages, v_pages, page_table, lengths), sm_scale, config)
