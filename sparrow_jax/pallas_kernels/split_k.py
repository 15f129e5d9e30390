"""Pieces shared by the split-K (flash-decoding) paged decode kernels for the GPU.

Both Pallas Triton kernels (`sparse_decode.py`: the selected pages; `paged_decode.py`: all of a
sequence's pages) launch one program per (sequence b, kv head k, split r). A program attends the
G query heads of kv head k to its share of the keys. The dot needs >= 16 rows, so the group is
zero padded to Gp rows in registers, but only Gr = next_pow2(G) rows of the float32 partials
(unnormalised output o, running sum l, running max m) are written: G = 2 (Qwen3-1.7B) writes 2
rows per split, not 16. `merge_partials` combines the R splits in XLA (flash-decoding's final
rescale-and-sum).

How many splits. A fixed R wastes the GPU either way: batch 4 x 8 kv heads x 8 splits is 256
programs where an H200 holds 396 at once (132 SMs x 3 resident blocks, what the kernels' ~150
registers and <= 72 KB of shared memory allow), while splits beyond the number of key blocks stay
empty. `num_splits` sizes R to the work with a wave model: a call takes about
ceil(B K R / resident) waves of ceil(blocks / R) + 1 key blocks each (one block's worth of
unhidden first load and partial write per program), and R is the fewest splits
within 5% of the best time, never more than the blocks of keys (the static page-table width for
dense, the selection slots for sparse), so no split of the longest sequence is empty. A config
may still fix `k_splits`.

Shared memory. With `num_stages >= 2` Triton's pipeliner stages the next K and V blocks in
shared memory (`cp.async`), so a block of `pages_per_block * page_size` keys costs at least
2 x block x head_dim x itemsize bytes there (measured with `gpu_compile`: 2.19-3.3x the K/V
block at every swept shape; the rest is layout-conversion scratch). `shared_bytes_lower_bound`
is that floor; a config whose floor is over the H200's 227 KiB per block is refused when it is
built with its block shape and when a kernel is called with it.

Axis legend: B batch, H query heads, K kv heads, G = H // K, Gp padded dot rows, Gr partial
rows, R = k_splits, D head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparrow_jax.pallas_kernels.reference import MASK_VALUE

MIN_DOT = 16  # Triton dot needs M, N, K >= 16
# The kernels' dots do not follow `jax_default_matmul_precision`: with "highest" a float32 dot
# becomes an FMA loop that spills and needs 264 KiB of shared memory at the default block. Pinned
# to DEFAULT they run on tensor cores: bf16 operands as they are, float32 ones as TF32 (what
# XLA's own float32 matmuls do on the GPU by default). Accumulation is float32 either way.
DOT_PRECISION = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
SHARED_LIMIT_BYTES = 227 * 1024  # H200 (sm_90) dynamic shared memory per block
NUM_SMS = 132  # H200
RESIDENT_PROGRAMS = 3 * NUM_SMS  # three resident blocks per SM (registers and shared memory)
MAX_SPLITS = 64
SPLIT_TOLERANCE = 1.05  # fewest splits whose modelled time is within 5% of the best


def is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def shared_bytes_lower_bound(*, pages_per_block: int, page_size: int, head_dim: int, dtype,
                             num_stages: int) -> int:
  """Shared memory a kernel block needs at least: the K and V blocks Triton's pipeliner
  stages there when num_stages >= 2 (0 with one stage: loads then go to registers)."""
  if num_stages < 2:
    return 0
  return 2 * pages_per_block * page_size * head_dim * jnp.dtype(dtype).itemsize


def check_shared_memory(config, *, page_size: int, head_dim: int, dtype) -> None:
  """ValueError when the config's blocks need more shared memory than an H200 block has."""
  need = shared_bytes_lower_bound(pages_per_block=config.pages_per_block, page_size=page_size,
                                  head_dim=head_dim, dtype=dtype,
                                  num_stages=config.num_stages)
  if need > SHARED_LIMIT_BYTES:
    raise ValueError(
        f"{type(config).__name__}(pages_per_block={config.pages_per_block}, "
        f"num_stages={config.num_stages}) at page_size={page_size}, head_dim={head_dim}, "
        f"{jnp.dtype(dtype).name}: the pipelined K and V blocks alone need {need} bytes of "
        f"shared memory, over the {SHARED_LIMIT_BYTES} bytes (227 KiB) an H200 block has; use "
        "fewer pages_per_block or num_stages=1")


def check_launch_config(config) -> None:
  """Validates the fields every split-K config has; the error names the config class, the
  field and the value. With its block shape (page_size, head_dim, dtype) all given, the config's
  shared memory is checked too."""
  cls = type(config).__name__
  if config.k_splits is not None and not _positive_int(config.k_splits):
    raise ValueError(f"{cls}.k_splits={config.k_splits!r}: expected a positive int or None "
                     "(sized to the work)")
  for name in ("pages_per_block", "num_warps", "num_stages", "resident_programs"):
    value = getattr(config, name)
    if not _positive_int(value):
      raise ValueError(f"{cls}.{name}={value!r}: expected a positive int")
  for name in ("pages_per_block", "num_warps"):
    value = getattr(config, name)
    if not is_pow2(value):
      raise ValueError(f"{cls}.{name}={value}: expected a power of two")
  shape = {name: getattr(config, name) for name in ("page_size", "head_dim", "dtype")}
  for name in ("page_size", "head_dim"):
    if shape[name] is not None and not (_positive_int(shape[name]) and is_pow2(shape[name])):
      raise ValueError(f"{cls}.{name}={shape[name]!r}: expected a power of two or None")
  if shape["dtype"] is not None:
    try:
      jnp.dtype(shape["dtype"])
    except TypeError:
      raise ValueError(f"{cls}.dtype={shape['dtype']!r}: expected a dtype name") from None
  if all(v is not None for v in shape.values()):
    check_shared_memory(config, **shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
  """Static launch parameters shared by the split-K Triton decode kernels (each kernel has its
  own subclass, so a config cannot be handed to the other kernel).

  k_splits: splits of the keys (flash-decoding split-K); None sizes them to the work
    (`num_splits`: whole waves of `resident_programs`, never more splits than key blocks).
  pages_per_block: pages per compute block; pages_per_block * page_size key rows per dot
    (a power of two, >= 16).
  num_warps, num_stages: Triton launch parameters.
  resident_programs: programs the GPU runs at once (SMs x resident blocks), the unit of a wave
    for the sized split count.
  page_size, head_dim, dtype: optional block shape the config is built for; when all three are
    given, a block whose shared memory is over an H200's 227 KiB is refused here (a kernel
    call always checks its own shapes).
  """
  k_splits: int | None = None
  pages_per_block: int = 8
  num_warps: int = 4
  num_stages: int = 2
  resident_programs: int = RESIDENT_PROGRAMS
  page_size: int | None = None
  head_dim: int | None = None
  dtype: str | None = None

  def __post_init__(self):
    check_launch_config(self)


def check_call_shapes(config, *, page_size: int, head_dim: int, dtype) -> None:
  """At a kernel call: the block shape the config was built for (if any) is the call's, and
  the call's blocks fit in shared memory."""
  cls = type(config).__name__
  for name, value in (("page_size", page_size), ("head_dim", head_dim)):
    want = getattr(config, name)
    if want is not None and want != value:
      raise ValueError(f"{cls}.{name}={want}: the kernel is called with {name}={value}")
  if config.dtype is not None and jnp.dtype(config.dtype) != jnp.dtype(dtype):
    raise ValueError(f"{cls}.dtype={config.dtype!r}: the kernel is called with a "
                     f"{jnp.dtype(dtype).name} cache")
  check_shared_memory(config, page_size=page_size, head_dim=head_dim, dtype=dtype)


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


def num_splits(k_splits, *, batch: int, kv_heads: int, num_blocks: int,
               resident_programs: int = RESIDENT_PROGRAMS) -> int:
  """Splits R per (sequence, kv head): `k_splits` when fixed, else sized to the work.

  Sized: the modelled time of R splits is ceil(B K R / resident_programs) waves of
  ceil(num_blocks / R) + 1 blocks (the + 1: a program's first block load is not hidden by the
  pipeline, and its partials are written and merged); R is the fewest in
  1..min(num_blocks, MAX_SPLITS) within SPLIT_TOLERANCE of the best (so no split of the longest
  sequence is empty).
  """
  if k_splits is not None:
    return k_splits
  programs = max(batch * kv_heads, 1)
  top = max(1, min(num_blocks, MAX_SPLITS))

  def waves_x_blocks(r):
    return math.ceil(programs * r / resident_programs) * (math.ceil(num_blocks / r) + 1)

  best = min(waves_x_blocks(r) for r in range(1, top + 1))
  return next(r for r in range(1, top + 1) if waves_x_blocks(r) <= SPLIT_TOLERANCE * best)


def padded_queries(q, kv_heads: int):
  """q [B, H, D] -> [B, K, Gp, D]: the GQA group of each kv head, zero padded to Gp rows
  (a power of two >= 16, what `plgpu.dot` accepts)."""
  b, h, d = q.shape
  g = h // kv_heads
  rows = max(MIN_DOT, next_pow2(g))
  q_rows = q.reshape(b, kv_heads, g, d)
  if rows != g:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  return q_rows


def partial_rows(group: int) -> int:
  """Rows Gr of the partials written per split: the group rounded up to a power of two."""
  return next_pow2(group)


def first_rows(x, rows: int):
  """The first `rows` rows of a [Gp, ...] value (Gp a multiple of rows), without a slice
  (Triton has none): rows past `rows` are zeroed and the row blocks summed, which adds exact
  zeros."""
  gp = x.shape[0]
  if gp == rows:
    return x
  keep = lax.broadcasted_iota(jnp.int32, x.shape, 0) < rows
  x = jnp.where(keep, x, jnp.zeros_like(x))
  return x.reshape(gp // rows, rows, *x.shape[1:]).sum(axis=0)


def online_softmax_block(carry, q, k, v, tok_ok, sm_scale: float):
  """One key block of a Triton kernel's flash-decoding loop: the Gp query rows `q [Gp, D]`
  scored against the block's keys `k [block, D]` (MASK_VALUE where `tok_ok [1, block]` is
  false), the running max and sum rescaled, the masked probabilities times `v [block, D]` added,
  all in float32. `carry` = (o [Gp, D], m [Gp], l [Gp]); returns the next carry."""
  from jax.experimental.pallas import triton as plgpu
  o_prev, m_prev, l_prev = carry
  logits = plgpu.dot(q, k, trans_b=True, precision=DOT_PRECISION) * sm_scale  # [Gp, block]
  logits = jnp.where(tok_ok, logits, MASK_VALUE)
  m_next = jnp.maximum(m_prev, logits.max(axis=-1))  # [Gp]
  corr = jnp.exp(m_prev - m_next)  # [Gp]
  p = jnp.where(tok_ok, jnp.exp(logits - m_next[:, None]), 0.0)  # [Gp, block]
  l_next = corr * l_prev + p.sum(axis=-1)
  pv = plgpu.dot(p.astype(v.dtype), v, precision=DOT_PRECISION)  # [Gp, D] float32
  return corr[:, None] * o_prev + pv, m_next, l_next


def accumulate_blocks(block, trips, o_ref, l_ref, m_ref, *, rows: int, head_dim: int):
  """Runs `block(t, carry)` (one `online_softmax_block` step) for t < trips from the empty
  state and stores the split's partials (`store_partials`)."""
  o0 = jnp.zeros((rows, head_dim), jnp.float32)
  m0 = jnp.full((rows,), MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((rows,), jnp.float32)
  o, m, l = lax.fori_loop(0, trips, block, (o0, m0, l0))
  store_partials(o_ref, l_ref, m_ref, o, l, m)  # the first Gr rows only


def store_partials(o_ref, l_ref, m_ref, o, l, m):
  """Writes the first Gr rows (the output refs' row count) of the split's o, l, m."""
  rows = o_ref.shape[0]
  o_ref[...] = first_rows(o, rows)
  l_ref[...] = first_rows(l, rows)
  m_ref[...] = first_rows(m, rows)


class KernelCall(NamedTuple):
  """What `prepare_call` settles for a kernel call."""
  config: LaunchConfig
  sm_scale: float
  rows: int  # Gr rows of partials per split
  args: list  # q rows [B, K, Gp, D] in the cache dtype, k/v pools, int32 table and lengths
  in_specs: list  # their block specs on the (B, K, splits) grid


def default_config(config_cls, page_size: int):
  """`config_cls()` with pages_per_block raised to MIN_DOT // page_size when the default's
  compute block would hold fewer than MIN_DOT key rows (small pages: 2-token pages need 8 per
  block). The sparse selection is padded to the same block (`slot_multiple`)."""
  config = config_cls()
  need = -(-MIN_DOT // page_size)
  if config.pages_per_block < need:
    config = dataclasses.replace(config, pages_per_block=next_pow2(need))
  return config


def prepare_call(config, config_cls, q, k_pages, v_pages, page_table, lengths,
                 sm_scale) -> KernelCall:
  """The common start of a split-K kernel call (inputs already checked): the config (default
  `default_config(config_cls, page_size)`; another class is refused), the kernel's block dims
  and shared memory at the call's shapes, the softmax scale (default 1/sqrt(D)), and the five
  inputs both kernels read first with their block specs."""
  _, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  config = default_config(config_cls, s) if config is None else config
  if not isinstance(config, config_cls):
    raise ValueError(f"config={config!r}: expected a {config_cls.__name__}")
  check_kernel_dims(d, s, config.pages_per_block)
  check_call_shapes(config, page_size=s, head_dim=d, dtype=k_pages.dtype)
  # [B, K, Gp, D] in the cache dtype (the dots take one operand dtype), GQA group padded.
  q_rows = padded_queries(q.astype(k_pages.dtype), kvh)
  in_specs = [
      pl.BlockSpec((None, None, q_rows.shape[2], d), lambda i, j, r: (i, j, 0, 0)),  # q
      pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, j, r: (j, 0, 0, 0)),  # k pool
      pl.BlockSpec((None, *v_pages.shape[1:]), lambda i, j, r: (j, 0, 0, 0)),  # v pool
      pl.BlockSpec((None, page_table.shape[1]), lambda i, j, r: (i, 0)),  # page table
      pl.BlockSpec((None,), lambda i, j, r: (i,)),  # lengths
  ]
  args = [q_rows, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32)]
  return KernelCall(config, float(d ** -0.5 if sm_scale is None else sm_scale),
                    partial_rows(h // kvh), args, in_specs)


def partial_outputs(b: int, kv_heads: int, splits: int, rows: int, d: int):
  """Output shapes and block specs of the (o, l, m) partials on a (B, K, R) grid."""
  out_shape = [
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows, d), jnp.float32),  # o [B, K, R, Gr, D]
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),  # l [B, K, R, Gr]
      jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),  # m [B, K, R, Gr]
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
    o: [B, K, R, Gr, D] unnormalised outputs; l, m: [B, K, R, Gr] running sum / max.
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


def launch_summary(config, *, batch: int, kv_heads: int, group: int, head_dim: int,
                   num_blocks: int) -> dict:
  """Programs launched and float32 partial bytes written (and read back by the merge) for one
  kernel call: what `BENCHMARKS.md` tabulates before/after sizing the splits."""
  splits = num_splits(config.k_splits, batch=batch, kv_heads=kv_heads, num_blocks=num_blocks,
                      resident_programs=config.resident_programs)
  rows = partial_rows(group)
  return dict(k_splits=splits, programs=batch * kv_heads * splits, partial_rows=rows,
              partial_bytes=batch * kv_heads * splits * rows * (head_dim + 2) * 4,
              empty_splits=max(splits - num_blocks, 0))
