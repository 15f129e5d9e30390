"""C++ CPU kernels for the decode step, called through XLA's FFI.

Why: at batch 1 XLA:CPU multiplies an activation by bfloat16 weights at ~1.5 GB/s (float32:
~25-40 GB/s) and gathers paged K/V at ~5 GB/s, so a CPU decode step spends most of its time
below the memory's rate (BENCHMARKS.md, issue 22). `kernels.cc` streams both:

* `packed_matmul(x, w_packed, n)`: `x [..., K] @ W [K, n]` with W stored as `pack_weight(W)`,
  panels of 64 output columns, float32 accumulation: float32 weights (float32 products) or
  bfloat16 ones (x rounded to bf16, AVX512-BF16 pair dot products where the CPU has them: the
  prefill's GEMM as well as the decode step's matrix-vector products).
* `packed_swiglu(x, w_packed, f)`: the MLP's `silu(x @ gate) * (x @ up)` from the fused
  gate|up packing, the SwiGLU applied to each register tile (the `[.., 2f]` products never
  written out).
* `decode_attention(q, k_pages, v_pages, page_table, lengths[, page_idx, valid])`: one query
  token per slot against a paged cache `[KV, pages, S, D]` (float32 or bfloat16), over all of
  a slot's pages or over each kv head's selected logical pages; the same contract as
  `pallas_kernels.dispatch`'s dense and sparse entry points (a slot with no valid token gets 0).

The library is compiled at first use with the machine's C++ compiler (`CXX`, default `c++`;
`-O3 -march=native`, plus `SPARROW_JAX_CXXFLAGS`) into `SPARROW_JAX_KERNEL_CACHE` (default
`~/.cache/sparrow_jax`), keyed
by a hash of the source, the flags, the compiler and jaxlib, and registered as XLA FFI targets
for the CPU platform. `available()` says whether that worked here; the callers that ask for
these kernels get a clear error naming why when it did not (no compiler, say). The kernels
run on the CPU platform only and have no autodiff rule: they serve inference (the engine's
decode), never the trained forward.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 64  # output columns per packed panel (kernels.cc's kNB)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cc")
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
          "-ffp-contract=fast", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-w"]
_TARGETS = ("sj_packed_matmul_f32", "sj_packed_matmul_bf16", "sj_packed_swiglu_f32",
            "sj_packed_swiglu_bf16", "sj_decode_attention_f32",
            "sj_decode_attention_bf16", "sj_causal_attention_f32", "sj_causal_attention_bf16",
            "sj_cache_write_token")

_lock = threading.Lock()
_state: dict = {}  # "lib" (ctypes handle) or "error" (str) once tried


def _cache_dir() -> str:
  d = os.environ.get("SPARROW_JAX_KERNEL_CACHE")
  return d or os.path.join(os.path.expanduser("~"), ".cache", "sparrow_jax")


def _compiler() -> str | None:
  cxx = os.environ.get("CXX", "c++")
  return shutil.which(cxx)


def _cpu_signature() -> str:
  """What `-march=native` depends on: the CPU's model and feature flags."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _extra_flags() -> list[str]:
  """`SPARROW_JAX_CXXFLAGS`: flags appended to the build's (e.g. `-mno-avx512bf16`)."""
  return os.environ.get("SPARROW_JAX_CXXFLAGS", "").split()


def _build() -> str:
  """Path of the compiled library (compiled now unless the cache has it)."""
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} is not on PATH "
                       "(set CXX or install g++)")
  import jaxlib
  include = jax.ffi.include_dir()
  with open(_SOURCE, "rb") as f:
    source = f.read()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  flags = _FLAGS + _extra_flags()
  key = hashlib.sha256(b"\0".join([
      source, " ".join(flags).encode(), version.encode(), jaxlib.__version__.encode(),
      platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
  out_dir = _cache_dir()
  path = os.path.join(out_dir, f"sparrow_cpu_kernels-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  try:
    proc = subprocess.run([cxx, *flags, f"-I{include}", _SOURCE, "-o", tmp],
                          capture_output=True, text=True)
    if proc.returncode != 0:
      raise RuntimeError(f"compiling {_SOURCE} failed ({cxx}, rc {proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: concurrent builders (test workers) agree on the file
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def _load():
  with _lock:
    if "lib" in _state or "error" in _state:
      return _state.get("lib")
    try:
      lib = ctypes.cdll.LoadLibrary(_build())
      for name in _TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                    platform="cpu")
      _state["lib"] = lib
    except (OSError, RuntimeError, AttributeError) as e:
      _state["error"] = f"{type(e).__name__}: {e}"
    return _state.get("lib")


def available() -> bool:
  """Whether the kernels compiled and registered here (tries once per process)."""
  return _load() is not None


def unavailable_reason() -> str | None:
  _load()
  return _state.get("error")


def require(what: str = "the CPU kernels") -> None:
  """Raise a RuntimeError naming why the kernels cannot be used here."""
  if not available():
    raise RuntimeError(f"{what} need sparrow_jax's C++ CPU kernels, which are unavailable: "
                       f"{unavailable_reason()}")
  if jax.default_backend() != "cpu":
    raise RuntimeError(f"{what} run on the CPU platform only; jax's default backend is "
                       f"{jax.default_backend()!r}")


# ---- packed matmul -------------------------------------------------------------------------

def pack_weight(w, dtype=None):
  """`[K, N]` weight -> panels of 64 output columns (zero-padded columns), in `dtype` (float32
  or bfloat16; default the weight's own). float32: `[ceil(N / 64), K, 64]`. bfloat16:
  `[ceil(N / 64), ceil(K / 2), 128]`, each k pair of a column adjacent (element (k, c) of a
  panel at `[k // 2, 2 c + k % 2]`), the operand layout of AVX512-BF16's pair dot product."""
  w = jnp.asarray(w)
  dtype = jnp.dtype(dtype or w.dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"pack_weight: dtype {dtype} not supported (float32 or bfloat16)")
  if w.ndim != 2:
    raise ValueError(f"pack_weight: expected a [K, N] matrix, got shape {w.shape}")
  k, n = w.shape
  p = -(-n // PANEL)
  if dtype == jnp.bfloat16:
    k2 = -(-k // 2)
    w = jnp.pad(w.astype(dtype), ((0, 2 * k2 - k), (0, p * PANEL - n)))
    # [k2, 2, p, 64] -> [p, k2, 64, 2]
    return jnp.transpose(w.reshape(k2, 2, p, PANEL), (2, 0, 3, 1)).reshape(p, k2, 2 * PANEL)
  w = jnp.pad(w.astype(dtype), ((0, 0), (0, p * PANEL - n)))
  return jnp.transpose(w.reshape(k, p, PANEL), (1, 0, 2))


def _packed_operands(x, w_packed):
  """(panels, bf16, whether `x [..., K]` and the `pack_weight` panels fit each other)."""
  p, kp, panel = w_packed.shape
  bf16 = w_packed.dtype == jnp.bfloat16
  k = x.shape[-1]
  fits = panel == (2 * PANEL if bf16 else PANEL) and kp == (-(-k // 2) if bf16 else k)
  return p, bf16, fits


def packed_matmul(x, w_packed, n: int):
  """`x [..., K]` times a `pack_weight` weight -> float32 `[..., n]`. float32 panels: float32
  products. bfloat16 panels: x rounded to bfloat16, bf16 x bf16 products summed in float32
  (an XLA dot of bfloat16 operands with `preferred_element_type=float32`)."""
  p, bf16, fits = _packed_operands(x, w_packed)
  if not fits or not 0 < n <= p * PANEL:
    raise ValueError(f"packed_matmul: x {x.shape} and packed weight {w_packed.shape} "
                     f"{w_packed.dtype} (n={n}) do not match")
  require("packed_matmul")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  name = "sj_packed_matmul_bf16" if bf16 else "sj_packed_matmul_f32"
  y = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x2.shape[0], p * PANEL), jnp.float32))(
      x2, w_packed)
  if n != p * PANEL:
    y = y[:, :n]
  return y.reshape(*lead, n)


def packed_swiglu(x, w_packed, f: int):
  """`silu(x @ gate) * (x @ up)` -> float32 `[..., f]` from the fused `pack_weight` of
  `concatenate([gate, up], axis=1)` (`pack_decode_weights`' "gate_up"), `f` the MLP width, a
  multiple of 64 (`swiglu_supported`). The products are `packed_matmul`'s (bf16 panels: x
  rounded to bfloat16, float32 sums); silu in float32 inside the kernel, so the `[..., 2f]`
  products are never written out."""
  p, bf16, fits = _packed_operands(x, w_packed)
  if not fits or not swiglu_supported(f) or p * PANEL != 2 * f:
    raise ValueError(f"packed_swiglu: x {x.shape} and packed gate|up weight {w_packed.shape} "
                     f"{w_packed.dtype} (f={f}) do not match (f a multiple of {PANEL}, "
                     f"2 f / {PANEL} panels)")
  require("packed_swiglu")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  name = "sj_packed_swiglu_bf16" if bf16 else "sj_packed_swiglu_f32"
  y = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x2.shape[0], f), jnp.float32))(x2, w_packed)
  return y.reshape(*lead, f)


def swiglu_supported(f: int) -> bool:
  """Whether `packed_swiglu` takes an MLP of width `f` (its gate and up panels then split at
  a panel boundary)."""
  return f > 0 and f % PANEL == 0


# ---- paged decode attention ----------------------------------------------------------------

def decode_attention(q, k_pages, v_pages, page_table, lengths, page_idx=None, valid=None, *,
                     sm_scale=None):
  """One token per slot: `q [B, H, D]` against the pool `[KV, P, S, D]` -> `[B, H, D]` in
  q.dtype. Dense over each slot's `ceil(lengths / S)` pages, or over the logical pages
  `page_idx [B, KV, N]` where `valid` (the selection of `selection.select_pages`)."""
  b, h, d = q.shape
  kvh = k_pages.shape[0]
  if k_pages.dtype != v_pages.dtype or k_pages.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"decode_attention: cache dtype {k_pages.dtype}/{v_pages.dtype}; "
                     "expected float32 or bfloat16 for both")
  require("decode_attention")
  sparse = page_idx is not None
  if sparse:
    page_idx = page_idx.astype(jnp.int32)
    valid = (jnp.ones(page_idx.shape, jnp.int32) if valid is None
             else valid.astype(jnp.int32))
  else:
    page_idx = jnp.zeros((b, kvh, 1), jnp.int32)
    valid = page_idx
  scale = float(d ** -0.5 if sm_scale is None else sm_scale)
  name = ("sj_decode_attention_bf16" if k_pages.dtype == jnp.bfloat16
          else "sj_decode_attention_f32")
  out = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((b, h, d), jnp.float32))(
      q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32),
      lengths.astype(jnp.int32), page_idx, valid, sm_scale=np.float32(scale), sparse=sparse)
  return out.astype(q.dtype)


def cache_write_token(k_buf, v_buf, k_rows, v_rows, dest, off):
  """Caches `[KV, P, S, D]` with `rows [KV, B, D]` written at `buf[:, dest[b], off[b]]`
  (entries out of range write nothing): `buf.at[:, dest, off].set(rows, mode="drop")` for K
  and V in one call, in place (the results alias the caches). For 16-bit caches on the CPU,
  where XLA widens the scatter to float32 and rewrites the whole buffer twice."""
  for buf, rows in ((k_buf, k_rows), (v_buf, v_rows)):
    if rows.dtype != k_buf.dtype or buf.dtype != k_buf.dtype or rows.ndim != 3 or \
        buf.shape != k_buf.shape or rows.shape != k_rows.shape or buf.ndim != 4 or \
        rows.shape[0] != buf.shape[0] or rows.shape[2] != buf.shape[3]:
      raise ValueError(f"cache_write_token: rows {rows.shape} {rows.dtype} do not fit the "
                       f"cache {buf.shape} {buf.dtype}")
  require("cache_write_token")
  out = jax.ShapeDtypeStruct(k_buf.shape, k_buf.dtype)
  return jax.ffi.ffi_call("sj_cache_write_token", (out, out),
                          input_output_aliases={0: 0, 1: 1})(
      k_buf, v_buf, k_rows, v_rows, dest.astype(jnp.int32), off.astype(jnp.int32))


# ---- causal prefill attention --------------------------------------------------------------

def causal_attention_supported(q) -> bool:
  """Whether `causal_attention` takes these queries (head dim a multiple of 64)."""
  return q.shape[-1] % 64 == 0


def causal_attention(q, k, v, lengths=None, *, sm_scale=None):
  """Causal GQA attention of whole sequences from position 0 (the prefill's):
  `q [B, T, H, D]`, `k, v [B, T, KV, D]` -> `[B, T, H, D]` in q.dtype; outputs at t >= lengths
  are 0. float32 k/v (any other dtype is widened): float32 products. bfloat16 k and v: q and
  each row's probabilities rounded to bf16 too, bf16 x bf16 products (AVX512-BF16 pair dot
  products where the CPU has them) with float32 softmax statistics and sums. The contract of `train_attention.causal_attention`, without
  a gradient (inference only). D must be a multiple of 64."""
  require("causal_attention")
  b, t, h, d = q.shape
  if not causal_attention_supported(q):
    raise ValueError(f"causal_attention: head dim {d} is not a multiple of 64")
  if lengths is None:
    lengths = jnp.full((b,), t, jnp.int32)
  scale = float(d ** -0.5 if sm_scale is None else sm_scale)
  f32 = lambda a: a.astype(jnp.float32)
  bf16 = k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16
  name = "sj_causal_attention_bf16" if bf16 else "sj_causal_attention_f32"
  kv = (k, v) if bf16 else (f32(k), f32(v))
  out = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((b, t, h, d), jnp.float32))(
      f32(q), *kv, lengths.astype(jnp.int32), sm_scale=np.float32(scale))
  return out.astype(q.dtype)
