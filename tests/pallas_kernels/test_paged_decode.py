"""Tests of dense paged decode: the Pallas kernel (interpret mode), the XLA path and dispatch.

Kernel (Pallas interpreter) = XLA path = float32 jnp reference = float64 numpy on random paged
caches: shuffled physical pages, garbage in the null page, in spare pages and in rows past the
length; lengths that end mid-page, length 1, and a length spanning the whole page table; GQA
groups 1-8, head dims 64/128, page sizes 16/8, float32 and bfloat16 caches. Interpret mode is
slow, so the kernel runs on a covering subset and the (cheap) XLA path on the full product.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import dispatch
from sparrow_jax.pallas_kernels import paged_decode as pd
from sparrow_jax.pallas_kernels import reference
from tests.pallas_kernels.paged_cases import dot_types, make_cache, triton_kernels

M = 13  # page-table width


def lengths_for(page_size):
  # whole table (M full pages); one token; ends mid-page; short, mid-page
  return (M * page_size, 1, 10 * page_size - 3, 3 * page_size + 5)


def numpy_dense_decode(q, k_pages, v_pages, table, lengths):
  """float64 reference written with loops, independent of the jnp code."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  table, lengths = np.asarray(table), np.asarray(lengths)
  b, h, d = q.shape
  kvh, _, s, _ = k_pages.shape
  g = h // kvh
  out = np.zeros((b, h, d))
  for i in range(b):
    if lengths[i] == 0:
      continue
    n_pages = -(-int(lengths[i]) // s)
    for kh in range(kvh):
      keys = np.concatenate([k_pages[kh, table[i, j]] for j in range(n_pages)])[:lengths[i]]
      vals = np.concatenate([v_pages[kh, table[i, j]] for j in range(n_pages)])[:lengths[i]]
      for hh in range(kh * g, (kh + 1) * g):
        logits = keys @ q[i, hh] / np.sqrt(d)
        w = np.exp(logits - logits.max())
        out[i, hh] = (w / w.sum()) @ vals
  return out


@functools.partial(jax.jit, static_argnames=("config",))
def run_kernel(q, k_pages, v_pages, table, lengths, config):
  return pd.paged_decode(q, k_pages, v_pages, table, lengths, config=config, interpret=True)


def _check(out, want, dtype):
  out = np.asarray(out, np.float64)
  assert np.all(np.isfinite(out))
  if dtype == jnp.float32:
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  else:
    rel = np.max(np.abs(out - want)) / np.max(np.abs(want))
    assert rel <= 2e-2, f"bfloat16 relative error {rel}"


def _case(seed, group, head_dim, page_size, dtype, kv_heads=2):
  rng = np.random.default_rng(seed)
  return make_cache(rng, batch=4, heads=kv_heads * group, kv_heads=kv_heads,
                    head_dim=head_dim, lengths=lengths_for(page_size), max_pages=M,
                    dtype=dtype, page_size=page_size)


def _config(page_size):
  # 32 or 16 key rows per block; 7 blocks of the full-table sequence over 2 splits
  return pd.PagedDecodeConfig(k_splits=2, pages_per_block=2)


# (group, head_dim, page_size): every group, both head dims, both page sizes.
@pytest.mark.parametrize("group,head_dim,page_size",
                         [(1, 64, 16), (2, 128, 8), (4, 64, 8), (8, 128, 16)])
def test_kernel_equals_references_float32(group, head_dim, page_size):
  case = _case(10 * group + head_dim + page_size, group, head_dim, page_size, jnp.float32)
  want = numpy_dense_decode(*case)
  out = run_kernel(*case, _config(page_size))
  chex.assert_shape(out, case[0].shape)
  assert out.dtype == jnp.float32
  _check(reference.dense_decode_reference(*case), want, jnp.float32)
  _check(pd.dense_decode_xla(*case), want, jnp.float32)
  _check(out, want, jnp.float32)


@pytest.mark.parametrize("group,head_dim,page_size", [(2, 128, 16), (8, 64, 8)])
def test_kernel_equals_references_bfloat16(group, head_dim, page_size):
  case = _case(7 + group + head_dim, group, head_dim, page_size, jnp.bfloat16)
  want = numpy_dense_decode(*case)
  out = run_kernel(*case, _config(page_size))
  assert out.dtype == jnp.bfloat16
  _check(out, want, jnp.bfloat16)
  _check(pd.dense_decode_xla(*case), want, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_xla_path_equals_numpy(group, head_dim, page_size, dtype):
  case = _case(group * head_dim + page_size, group, head_dim, page_size, dtype)
  out = pd.dense_decode_xla(*case)
  assert out.dtype == dtype
  _check(out, numpy_dense_decode(*case), dtype)


def test_xla_path_keeps_cache_dtype_and_reads_given_columns():
  """bf16 cache: both einsums take bf16 operands and accumulate in f32 (no f32 copy of the
  gathered pages), and the gather reads exactly the [B, M] table it is given."""
  b, h, kvh, p, s, d, m = 4, 8, 2, 64, 16, 128, 5
  args = (jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((kvh, p, s, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((kvh, p, s, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
  text = jax.jit(pd.dense_decode_xla).lower(*args).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 2, dots
  for line in dots:
    operands, result = line.rsplit("->", 1)
    assert "f32" not in operands and "bf16" in operands, line
    assert "f32" in result, line
  gathers = [line for line in text.splitlines() if "stablehlo.gather" in line]
  assert len(gathers) == 2 and all(
      f"-> tensor<{b}x{kvh}x{m}x{s}x{d}xbf16>" in line for line in gathers), gathers
  assert f"x{m * s}x{d}xf32>" not in text  # no float32 copy of the gathered keys/values


def test_bucketed_table_gives_the_same_result():
  """The engine passes tables bucketed to the longest active sequence: a narrower table (all
  sequences still inside it) and a wider one must not change the output."""
  case = _case(3, 2, 64, 8, jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  lengths = jnp.asarray([40, 1, 23, 9], jnp.int32)  # at most 5 pages of 8
  wide = jnp.pad(table, ((0, 0), (0, 19)))  # M = 32, extra columns -> null page
  narrow = table[:, :5]
  want = numpy_dense_decode(q, k_pages, v_pages, table, lengths)
  config = _config(8)
  for tbl in (narrow, wide):
    _check(pd.dense_decode_xla(q, k_pages, v_pages, tbl, lengths), want, jnp.float32)
    _check(run_kernel(q, k_pages, v_pages, tbl, lengths, config), want, jnp.float32)


def test_kernel_reads_only_the_sequences_own_pages():
  """Table columns past each sequence's last page point at a NaN page. The kernel never loads
  them (a masked NaN would still poison P.V with 0 * NaN); the XLA path gathers every column
  it is given, so it does see them."""
  rng = np.random.default_rng(4)
  case = make_cache(rng, batch=4, heads=4, kv_heads=2, head_dim=64, lengths=(33, 1, 64, 7),
                    max_pages=16, dtype=jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  nan_page = k_pages.shape[1]
  k_pages = jnp.concatenate([k_pages, jnp.full_like(k_pages[:, :1], jnp.nan)], axis=1)
  v_pages = jnp.concatenate([v_pages, jnp.full_like(v_pages[:, :1], jnp.nan)], axis=1)
  own = np.arange(16)[None, :] < -(-np.asarray(lengths)[:, None] // 16)
  table = jnp.where(own, table, nan_page)
  want = numpy_dense_decode(q, k_pages, v_pages, table, lengths)
  for config in (pd.PagedDecodeConfig(k_splits=2, pages_per_block=4),
                 pd.PagedDecodeConfig(k_splits=4, pages_per_block=1)):
    _check(run_kernel(q, k_pages, v_pages, table, lengths, config), want, jnp.float32)
  assert np.isnan(np.asarray(pd.dense_decode_xla(q, k_pages, v_pages, table, lengths))).any()


def test_empty_slot_gives_zero():
  case = _case(5, 2, 64, 16, jnp.float32)
  q, k_pages, v_pages, table, _ = case
  lengths = jnp.asarray([0, 1, 150, 0], jnp.int32)
  want = numpy_dense_decode(q, k_pages, v_pages, table, lengths)
  assert not want[0].any() and not want[3].any()
  _check(pd.dense_decode_xla(q, k_pages, v_pages, table, lengths), want, jnp.float32)
  _check(run_kernel(q, k_pages, v_pages, table, lengths, _config(16)), want, jnp.float32)


@pytest.mark.parametrize("config", [pd.PagedDecodeConfig(k_splits=4, pages_per_block=1),
                                    pd.PagedDecodeConfig(k_splits=1, pages_per_block=16)])
def test_every_output_element_written(config):
  """NaN-poisoned output buffers aliased to the kernel's outputs: nothing may stay NaN, even in
  splits that see no page (the length-1 sequence leaves 3 of 4 splits empty)."""
  case = _case(6, 2, 64, 16, jnp.float32)
  b, kvh, rows, d, r = 4, 2, 2, 64, config.k_splits  # G = 2: 2 partial rows
  poison = (jnp.full((b, kvh, r, rows, d), jnp.nan), jnp.full((b, kvh, r, rows), jnp.nan),
            jnp.full((b, kvh, r, rows), jnp.nan))
  o, l, m = pd.paged_decode_partials(*case, config=config, interpret=True, poison=poison)
  chex.assert_tree_all_finite((o, l, m))
  if r > 1:
    assert bool(jnp.any(l == 0)), "expected some empty splits in this case"
  out = pd.split_k.merge_partials(o, l, m, case[0].shape[1])
  _check(out, numpy_dense_decode(*case), jnp.float32)


@pytest.mark.parametrize("group", [3, 5])
def test_default_config_and_groups_that_are_not_powers_of_two(group):
  """The default config (splits sized to the work) with G = 3 (SmolLM2) and 5 (Qwen3-14B):
  4 and 8 partial rows are written from the 16-row dot, rows >= G dropped by the merge."""
  case = _case(30 + group, group, 64, 16, jnp.float32)
  out = run_kernel(*case, pd.PagedDecodeConfig())
  _check(out, numpy_dense_decode(*case), jnp.float32)


def test_dispatch_backends():
  has_gpu = any(d.platform == "gpu" for d in jax.devices())
  case = _case(8, 4, 64, 16, jnp.float32)
  want = numpy_dense_decode(*case)
  config = _config(16)
  for backend in ("xla", dispatch.Backend.PALLAS_INTERPRET, "auto"):
    out = dispatch.dense_decode_attention(*case, backend=backend, config=config)
    _check(out, want, jnp.float32)
  scale = 0.3
  scaled = dispatch.dense_decode_attention(*case, backend="pallas_interpret", sm_scale=scale,
                                           config=config)
  # sm_scale s on q equals the default scale on q * s * sqrt(D)
  rescaled_q = case[0] * (scale * 64 ** 0.5)
  _check(scaled, numpy_dense_decode(rescaled_q, *case[1:]), jnp.float32)
  if not has_gpu:
    with pytest.raises(ValueError, match="needs a GPU"):
      dispatch.dense_decode_attention(*case, backend="pallas")
  with pytest.raises(ValueError, match="backend='triton'"):
    dispatch.dense_decode_attention(*case, backend="triton")


def test_triton_lowering_for_gpu():
  """Export the kernel for CUDA (the Triton lowering runs on CPU) and read its Triton IR:
  catches non-power-of-two blocks and ops the interpreter accepts but Triton does not, and
  checks that both dots take the cache dtype and accumulate in float32."""
  for group, head_dim, page_size, dtype, config in (
      (1, 64, 8, jnp.float32, pd.PagedDecodeConfig(k_splits=4, pages_per_block=2)),
      (8, 128, 16, jnp.bfloat16, pd.PagedDecodeConfig()),
      (3, 128, 16, jnp.bfloat16, pd.PagedDecodeConfig(k_splits=16, pages_per_block=1)),
      (2, 128, 16, jnp.bfloat16, pd.PagedDecodeConfig(k_splits=4, pages_per_block=16))):
    b, kvh, p, m = 3, 2, 37, 11
    args = (jax.ShapeDtypeStruct((b, kvh * group, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((kvh, p, page_size, head_dim), dtype),
            jax.ShapeDtypeStruct((kvh, p, page_size, head_dim), dtype),
            jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    kernels = triton_kernels(functools.partial(pd.paged_decode, config=config), *args)
    assert list(kernels) == ["dense_paged_decode"]
    ttir = kernels["dense_paged_decode"]
    cache = "f32" if dtype == jnp.float32 else "bf16"
    assert dot_types(ttir) == [(cache, cache, "f32")] * 2, ttir
    assert "scf.for" in ttir  # the page loop is a loop, with a trip count from the length


def test_input_validation():
  case = _case(1, 2, 64, 16, jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  with pytest.raises(ValueError, match="PagedDecodeConfig.pages_per_block=3"):
    pd.PagedDecodeConfig(pages_per_block=3)
  with pytest.raises(ValueError, match="PagedDecodeConfig.k_splits=0"):
    pd.PagedDecodeConfig(k_splits=0)
  with pytest.raises(ValueError, match="PagedDecodeConfig.num_warps=True"):
    pd.PagedDecodeConfig(num_warps=True)
  with pytest.raises(TypeError):
    pd.PagedDecodeConfig(block_h=16)  # unknown field
  with pytest.raises(ValueError, match="expected a PagedDecodeConfig"):
    pd.paged_decode(*case, config=dispatch.SparseDecodeConfig(), interpret=True)
  q48, k48 = jnp.zeros((4, 4, 48)), jnp.zeros((2, 10, 16, 48))
  with pytest.raises(ValueError, match="head_dim=48"):
    pd.paged_decode(q48, k48, k48, table, lengths, interpret=True)
  k8 = jnp.zeros((2, 10, 8, 64))
  with pytest.raises(ValueError, match="pages_per_block \\* page_size = 1 \\* 8"):
    pd.paged_decode(q, k8, k8, table, lengths, interpret=True,
                    config=pd.PagedDecodeConfig(pages_per_block=1))
  with pytest.raises(ValueError, match="lengths.shape"):
    pd.dense_decode_xla(q, k_pages, v_pages, table, lengths[:2])
  with pytest.raises(ValueError, match="page_table.shape"):
    pd.paged_decode(q, k_pages, v_pages, table[0], lengths, interpret=True)
  with pytest.raises(ValueError, match="v_pages.dtype"):
    pd.dense_decode_xla(q, k_pages, v_pages.astype(jnp.bfloat16), table, lengths)
  with pytest.raises(ValueError, match="multiple of K=2"):
    pd.dense_decode_xla(q[:, :3], k_pages, v_pages, table, lengths)
