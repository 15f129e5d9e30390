"""Shared test helpers for the paged decode kernels: random paged caches with adversarial
garbage, and the Triton IR a kernel lowers to for CUDA (readable on a CPU-only machine)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import gpu_compile


def make_cache(rng, *, batch, heads, kv_heads, head_dim, lengths, max_pages, dtype,
               page_size=16, spare_pages=5):
  """Random paged cache: distinct shuffled physical pages per sequence, page 0 reserved (null),
  large garbage in the null page, in unallocated pages and in rows past the length (all must
  be masked). Table columns past a sequence's last page point to the null page.

  Returns q [B, H, D], k_pages, v_pages [K, P, S, D] in `dtype`, table [B, M] int32,
  lengths [B] int32.
  """
  s = page_size
  used = [-(-int(n) // s) for n in lengths]
  p = 1 + sum(used) + spare_pages
  k_pages = rng.standard_normal((kv_heads, p, s, head_dim))
  v_pages = rng.standard_normal((kv_heads, p, s, head_dim))
  perm = rng.permutation(np.arange(1, p))
  table = np.zeros((batch, max_pages), np.int32)
  start = 0
  for i, n in enumerate(used):
    if n == 0:
      continue
    table[i, :n] = perm[start:start + n]
    last = table[i, n - 1]
    rows = int(lengths[i]) - (n - 1) * s
    k_pages[:, last, rows:] = 50.0  # unwritten rows of the partial page
    v_pages[:, last, rows:] = 1e3
    start += n
  for spare in perm[start:]:
    v_pages[:, spare] = -1e3
  k_pages[:, 0] = 40.0
  v_pages[:, 0] = 1e4
  q = rng.standard_normal((batch, heads, head_dim))
  as_j = lambda x: jnp.asarray(x, dtype)
  return (as_j(q), as_j(k_pages), as_j(v_pages), jnp.asarray(table),
          jnp.asarray(np.asarray(lengths, np.int32)))


def triton_kernels(fn, *args):
  """Exports `fn(*args)` for CUDA (jax.export; the Triton lowering runs on CPU) and returns
  {kernel name: Triton IR text} of every Pallas Triton call in it. Skips (with the reason) only
  on a jaxlib that no longer emits the Triton IR on a CPU-only machine (> 0.10.2)."""
  return {c.name: c.ir for c in triton_calls_or_skip(fn, *args)}


def triton_calls_or_skip(fn, *args):
  try:
    return gpu_compile.triton_calls(fn, *args)
  except gpu_compile.TritonIRUnavailable as e:
    pytest.skip(str(e))


def dot_types(ttir: str):
  """(lhs, rhs, result) element types of every tt.dot in a Triton IR text."""
  return re.findall(r"tt\.dot .*: tensor<[\dx]+x(\w+)> \* tensor<[\dx]+x(\w+)> -> "
                    r"tensor<[\dx]+x(\w+)>", ttir)
