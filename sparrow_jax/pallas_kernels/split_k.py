"""Pieces shared by the split-K (flash-decoding) paged decode kernels.

Both Pallas kernels (`sparse_decode.py`: the selected pages; `paged_decode.py`: all of a
sequence's pages) launch one program per (sequence b, kv head k, split r). A program attends the
G query heads of kv head k, padded to Gp rows for `plgpu.dot`, to its share of the keys and
writes three float32 partials: the unnormalised output o, the running softmax sum l and the
running max m. `merge_partials` combines the R splits in XLA (flash-decoding's final
rescale-and-sum). Everything here is launch plumbing and validation; the attention math lives in
the kernels.

Axis legend: B batch, H query heads, K kv heads, G = H // K, Gp padded group, R = k_splits,
D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MIN_DOT = 16  # Triton dot needs M, N, K >= 16


def is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def check_launch_config(config) -> None:
  """Validates the fields every split-K config has (k_splits, pages_per_block, num_warps,
  num_stages); the error names the config class, the field and the value."""
  cls = type(config).__name__
  for name in ("k_splits", "pages_per_block", "num_warps", "num_stages"):
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{cls}.{name}={value!r}: expected a positive int")
  for name in ("pages_per_block", "num_warps"):
    value = getattr(config, name)
    if not is_pow2(value):
      raise ValueError(f"{cls}.{name}={value}: expected a power of two")


def check_kernel_dims(head_dim: int, page_size: int, pages_per_block: int) -> None:
  """Shapes the Triton lowering needs: every loaded block a power of two, dots >= 16."""
  if not is_pow2(head_dim) or head_dim < MIN_DOT:
    raise ValueError(f"head_dim={head_dim}: the Pallas Triton kernel needs a power of two >= "
                     f"{MIN_DOT} (use the XLA backend for other head dims)")
  if not is_pow2(page_size):
    raise ValueError(f"page_size={page_size}: the Pallas Triton kernel needs a power of two")
  if pages_per_block * page_size < MIN_DOT:
    raise ValueError(f"pages_per_block * page_size = {pages_per_block} * {page_size}: expected "
                     f">= {MIN_DOT} key rows per compute block")


def padded_queries(q, kv_heads: int):
  """q [B, H, D] -> [B, K, Gp, D]: the GQA group of each kv head, zero padded to Gp rows
  (a power of two >= 16, what `plgpu.dot` accepts)."""
  b, h, d = q.shape
  g = h // kv_heads
  rows = max(MIN_DOT, 1 << (g - 1).bit_length())
  q_rows = q.reshape(b, kv_heads, g, d)
  if rows != g:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  return q_rows


def partial_outputs(b: int, kv_heads: int, splits: int, rows: int, d: int):
  """Output shapes and block specs of the (o, l, m) partials on a (B, K, R) grid."""
  out_shape = [
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows, d), jnp.float32),  # o [B, K, R, Gp, D]
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),  # l [B, K, R, Gp]
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),  # m [B, K, R, Gp]
  ]
  out_specs = [
      pl.BlockSpec((None, None, None, rows, d), lambda i, j, r: (i, j, r, 0, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, r: (i, j, r, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, r: (i, j, r, 0)),
  ]
  return out_shape, out_specs


def alias_poison(poison, args, in_specs, out_shape, out_specs):
  """Appends `poison` (o, l, m) buffers as inputs aliased to the outputs, so a test can fill
  them with NaN and see that the kernel writes every element. Returns (args, in_specs,
  input_output_aliases)."""
  if poison is None:
    return args, in_specs, {}
  if len(poison) != len(out_shape):
    raise ValueError(f"poison has {len(poison)} buffers: expected {len(out_shape)} (o, l, m)")
  aliases = {}
  args = list(args)
  for i, (buf, shape) in enumerate(zip(poison, out_shape)):
    if buf.shape != shape.shape or buf.dtype != shape.dtype:
      raise ValueError(f"poison[{i}] {buf.shape} {buf.dtype}: expected {shape.shape} "
                       f"{shape.dtype}")
    aliases[len(args)] = i
    args.append(buf)
  return args, list(in_specs) + list(out_specs), aliases


def launch(kernel, *, name: str, grid, args, in_specs, out_shape, out_specs, poison, config,
           interpret: bool):
  """`pallas_call` of a split-K decode kernel (grid (B, K, splits)) with the launch parameters
  of `config` (num_warps, num_stages) and the optional NaN-poisoned output buffers."""
  from jax.experimental.pallas import triton as plgpu
  args, in_specs, aliases = alias_poison(poison, args, in_specs, out_shape, out_specs)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*args)


def merge_partials(o, l, m, num_heads: int):
  """Merges per-split flash-decoding partials into the attention output.

  Args:
    o: [B, K, R, Gp, D] unnormalised outputs; l, m: [B, K, R, Gp] running sum / max.
    num_heads: H, the number of real query heads (K * G rows are kept).
  Returns:
    [B, H, D] float32; 0 for a row that saw no valid token.
  """
  b, kvh, _, _, d = o.shape
  g = num_heads // kvh
  o, l, m = o[..., :g, :], l[..., :g], m[..., :g]
  m_all = jnp.max(m, axis=2, keepdims=True)  # [B, K, 1, G]
  corr = jnp.exp(m - m_all)  # [B, K, R, G]
  l_all = jnp.sum(l * corr, axis=2)  # [B, K, G]
  o_all = jnp.sum(o * corr[..., None], axis=2)  # [B, K, G, D]
  out = jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None],
                  0.0)
  return out.reshape(b, num_heads, d)
