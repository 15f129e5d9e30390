"""Tests of the sparse paged decode kernel (interpret mode), its jnp reference and dispatch.

Kernel (Pallas interpreter) = jnp reference = float64 numpy reference on random paged caches
with odd lengths, partial last pages, garbage in unwritten rows and in the null page, budgets
that leave split blocks partly or wholly empty, GQA groups 1-8 and head dims 64/128.
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
from sparrow_jax.pallas_kernels import landmarks
from sparrow_jax.pallas_kernels import selection
from sparrow_jax.pallas_kernels import sparse_decode as sd
from tests.pallas_kernels.paged_cases import dot_types, make_cache, triton_kernels

PAGE = 16


def numpy_sparse_decode(q, k_pages, v_pages, table, lengths, page_idx, valid):
  """float64 reference written with loops, independent of the jnp code."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  table, lengths = np.asarray(table), np.asarray(lengths)
  page_idx, valid = np.asarray(page_idx), np.asarray(valid)
  b, h, d = q.shape
  kvh = k_pages.shape[0]
  g = h // kvh
  out = np.zeros((b, h, d))
  for i in range(b):
    for kh in range(kvh):
      keys, vals = [], []
      for slot in range(page_idx.shape[-1]):
        if not valid[i, kh, slot]:
          continue
        j = page_idx[i, kh, slot]
        rows = min(PAGE, lengths[i] - j * PAGE)
        keys.append(k_pages[kh, table[i, j], :rows])
        vals.append(v_pages[kh, table[i, j], :rows])
      keys, vals = np.concatenate(keys), np.concatenate(vals)
      for hh in range(kh * g, (kh + 1) * g):
        logits = keys @ q[i, hh] / np.sqrt(d)
        w = np.exp(logits - logits.max())
        out[i, hh] = (w / w.sum()) @ vals
  return out


def select(q, k_pages, table, lengths, budget, max_budget, kind="mean"):
  kvh, p = k_pages.shape[:2]
  nv = jnp.full((kvh, p), PAGE, jnp.int32)  # every pool page scored as written in full
  lm = landmarks.compute_landmarks(k_pages, nv, kind)
  return selection.select_decode_pages(q, lm, table, lengths, jnp.asarray(budget, jnp.int32),
                                       kind=kind, max_budget=max_budget, page_size=PAGE)


@functools.partial(jax.jit, static_argnames=("config",))
def run_kernel(q, k_pages, v_pages, table, lengths, page_idx, valid, config):
  return sd.sparse_decode(q, k_pages, v_pages, table, lengths, page_idx, valid, config=config,
                          interpret=True)


# Odd lengths; partial last pages; one sequence shorter than the reserved pages; budgets that
# end inside a block, leave whole splits empty, or are zero.
LENGTHS = (203, 37, 150, 9)
BUDGETS = (3, 0, 6, 2)
MAX_BUDGET = 6  # N = 9 slots, padded by the kernel to 16 = 2 splits x 2 blocks x 4 pages
CONFIG = sd.SparseDecodeConfig(k_splits=2, pages_per_block=4)


def _check(out, want, dtype):
  out = np.asarray(out, np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  else:
    rel = np.max(np.abs(out - want)) / np.max(np.abs(want))
    assert rel <= 2e-2, f"bfloat16 relative error {rel}"


# Every group size and both head dims run by default; the rest of the cross product is slow.
_FAST_F32 = ((1, 64), (2, 128), (4, 64), (8, 128))
_F32_CASES = [(g, d) if (g, d) in _FAST_F32 else pytest.param(g, d, marks=pytest.mark.slow)
              for g in (1, 2, 4, 8) for d in (64, 128)]
_BF16_CASES = [(1, 128), (8, 64), pytest.param(2, 64, marks=pytest.mark.slow),
               pytest.param(4, 128, marks=pytest.mark.slow)]


@pytest.mark.parametrize("group,head_dim", _F32_CASES)
def test_kernel_equals_references_float32(group, head_dim):
  rng = np.random.default_rng(100 * group + head_dim)
  kvh = 2
  case = make_cache(rng, batch=4, heads=kvh * group, kv_heads=kvh, head_dim=head_dim,
                    lengths=LENGTHS, max_pages=16, dtype=jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  page_idx, valid = select(q, k_pages, table, lengths, BUDGETS, MAX_BUDGET)
  assert 0 < int(valid.sum()) < valid.size
  want = numpy_sparse_decode(*case, page_idx, valid)
  ref = reference.sparse_decode_reference(*case, page_idx, valid)
  out = run_kernel(*case, page_idx, valid, CONFIG)
  chex.assert_shape(out, q.shape)
  assert out.dtype == jnp.float32
  _check(ref, want, jnp.float32)
  _check(out, want, jnp.float32)


@pytest.mark.parametrize("group,head_dim", _BF16_CASES)
def test_kernel_equals_references_bfloat16(group, head_dim):
  rng = np.random.default_rng(7 + group + head_dim)
  kvh = 2
  case = make_cache(rng, batch=4, heads=kvh * group, kv_heads=kvh, head_dim=head_dim,
                    lengths=LENGTHS, max_pages=16, dtype=jnp.bfloat16)
  q, k_pages, v_pages, table, lengths = case
  page_idx, valid = select(q, k_pages, table, lengths, BUDGETS, MAX_BUDGET, kind="quest")
  want = numpy_sparse_decode(*case, page_idx, valid)
  ref = reference.sparse_decode_reference(*case, page_idx, valid)
  out = run_kernel(*case, page_idx, valid, CONFIG)
  assert out.dtype == jnp.bfloat16
  _check(ref, want, jnp.bfloat16)
  _check(out, want, jnp.bfloat16)


@pytest.mark.parametrize("config", [sd.SparseDecodeConfig(k_splits=4, pages_per_block=1),
                                    sd.SparseDecodeConfig(k_splits=1, pages_per_block=8)])
def test_every_output_element_written(config):
  """NaN-poisoned output buffers aliased to the kernel's outputs: nothing may stay NaN, even
  in splits that see no valid slot (budget 0 sequence, 3 of 4 splits empty)."""
  rng = np.random.default_rng(3)
  case = make_cache(rng, batch=4, heads=4, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  page_idx, valid = select(q, k_pages, table, lengths, BUDGETS, MAX_BUDGET)
  b, kvh, rows, d = 4, 2, 2, 64  # G = 2 query heads per kv head: 2 partial rows
  r = config.k_splits
  poison = (jnp.full((b, kvh, r, rows, d), jnp.nan), jnp.full((b, kvh, r, rows), jnp.nan),
            jnp.full((b, kvh, r, rows), jnp.nan))
  o, l, m = sd.sparse_decode_partials(*case, page_idx, valid, config=config, interpret=True,
                                      poison=poison)
  chex.assert_tree_all_finite((o, l, m))
  if config.k_splits > 1:
    assert bool(jnp.any(l == 0)), "expected some empty splits in this case"
  out = sd.merge_partials(o, l, m, q.shape[1])
  np.testing.assert_allclose(out, numpy_sparse_decode(*case, page_idx, valid), atol=1e-5,
                             rtol=1e-5)


@pytest.mark.parametrize("group", [3, 5])
def test_default_config_and_groups_that_are_not_powers_of_two(group):
  rng = np.random.default_rng(40 + group)
  case = make_cache(rng, batch=4, heads=2 * group, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  page_idx, valid = select(case[0], case[1], case[3], case[4], BUDGETS, MAX_BUDGET)
  out = run_kernel(*case, page_idx, valid, sd.SparseDecodeConfig())
  _check(out, numpy_sparse_decode(*case, page_idx, valid), jnp.float32)


def test_full_budget_equals_dense_decode():
  rng = np.random.default_rng(11)
  case = make_cache(rng, batch=4, heads=8, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  page_idx, valid = select(q, k_pages, table, lengths, [16] * 4, 16)
  for i, n in enumerate(LENGTHS):  # every existing page selected
    assert sorted(np.asarray(page_idx[i, 0])[np.asarray(valid[i, 0])]) == list(
        range(-(-n // PAGE)))
  dense = reference.dense_decode_reference(*case)
  np.testing.assert_allclose(reference.sparse_decode_reference(*case, page_idx, valid), dense,
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(run_kernel(*case, page_idx, valid, CONFIG), dense, atol=1e-5,
                             rtol=1e-5)


def test_dispatch_backends():
  assert dispatch.resolve_backend(dispatch.Backend.XLA) is dispatch.Backend.XLA
  assert dispatch.resolve_backend("pallas_interpret") is dispatch.Backend.PALLAS_INTERPRET
  has_gpu = any(d.platform == "gpu" for d in jax.devices())
  auto = dispatch.resolve_backend("auto")
  assert auto is (dispatch.Backend.PALLAS if has_gpu else dispatch.Backend.XLA)
  if not has_gpu:
    with pytest.raises(ValueError, match="needs a GPU"):
      dispatch.resolve_backend(dispatch.Backend.PALLAS)
  with pytest.raises(ValueError, match="backend='triton'"):
    dispatch.resolve_backend("triton")
  rng = np.random.default_rng(5)
  case = make_cache(rng, batch=4, heads=4, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  page_idx, valid = select(case[0], case[1], case[3], case[4], BUDGETS, MAX_BUDGET)
  outs = {be: dispatch.sparse_decode_attention(*case, page_idx, valid, backend=be,
                                               config=CONFIG)
          for be in ("xla", dispatch.Backend.PALLAS_INTERPRET, "auto")}
  chex.assert_trees_all_close(outs["xla"], outs[dispatch.Backend.PALLAS_INTERPRET], atol=1e-5)
  chex.assert_trees_all_close(outs["xla"], outs["auto"], atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_budget_change_does_not_recompile(backend):
  rng = np.random.default_rng(9)
  case = make_cache(rng, batch=4, heads=4, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  q, k_pages, v_pages, table, lengths = case
  lm = landmarks.compute_landmarks(k_pages, jnp.full(k_pages.shape[:2], PAGE), "mean")

  @jax.jit
  def step(q, k_pages, v_pages, table, lengths, lm, budget):
    page_idx, valid = selection.select_decode_pages(
        q, lm, table, lengths, budget, kind="mean", max_budget=MAX_BUDGET, page_size=PAGE,
        slot_multiple=CONFIG.slot_multiple())
    out = dispatch.sparse_decode_attention(q, k_pages, v_pages, table, lengths, page_idx,
                                           valid, backend=backend, config=CONFIG)
    return out, valid.sum()

  counts = []
  for budget in ([0, 0, 0, 0], [1, 2, 3, 4], [6, 6, 6, 6]):
    _, n = step(*case, lm, jnp.asarray(budget, jnp.int32))
    counts.append(int(n))
  assert step._cache_size() == 1
  assert counts[0] < counts[1] < counts[2]


def test_triton_lowering_for_gpu():
  """Export the kernel for CUDA (the Triton lowering runs on CPU) and read its Triton IR:
  catches non-power-of-two blocks and unsupported ops that the interpreter accepts, and checks
  that both dots take the cache dtype and accumulate in float32."""
  for group, head_dim, dtype, config in (
      (1, 64, jnp.float32, sd.SparseDecodeConfig(k_splits=4, pages_per_block=1)),
      (8, 128, jnp.bfloat16, sd.SparseDecodeConfig()),
      (2, 128, jnp.bfloat16, sd.SparseDecodeConfig(k_splits=16, pages_per_block=8))):
    b, kvh, p, m, n = 3, 2, 37, 11, 7
    args = (jax.ShapeDtypeStruct((b, kvh * group, head_dim), dtype),
            jax.ShapeDtypeStruct((kvh, p, PAGE, head_dim), dtype),
            jax.ShapeDtypeStruct((kvh, p, PAGE, head_dim), dtype),
            jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, kvh, n), jnp.int32),
            jax.ShapeDtypeStruct((b, kvh, n), jnp.bool_))
    kernels = triton_kernels(functools.partial(sd.sparse_decode, config=config), *args)
    assert list(kernels) == ["sparse_paged_decode"]
    cache = "f32" if dtype == jnp.float32 else "bf16"
    assert dot_types(kernels["sparse_paged_decode"]) == [(cache, cache, "f32")] * 2


def test_query_cast_to_a_cache_dtype_that_differs():
  """float32 queries over a bf16 cache: the kernel casts q to the cache dtype (one operand
  dtype per dot, as the dense kernel does), returns q's dtype, and agrees with the float32
  reference to bf16 rounding of q; its Triton IR has bf16 x bf16 -> f32 dots only."""
  rng = np.random.default_rng(21)
  case = make_cache(rng, batch=4, heads=8, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.bfloat16)
  q = case[0].astype(jnp.float32) + 1e-3 * jnp.asarray(rng.standard_normal(case[0].shape),
                                                        jnp.float32)  # not bf16-exact
  case = (q,) + case[1:]
  page_idx, valid = select(*case[:2], case[3], case[4], BUDGETS, MAX_BUDGET)
  out = run_kernel(*case, page_idx, valid, CONFIG)
  assert out.dtype == jnp.float32
  want = numpy_sparse_decode(*case, page_idx, valid)
  rel = np.max(np.abs(np.asarray(out, np.float64) - want)) / np.max(np.abs(want))
  assert rel <= 2e-2, rel
  # Against the query rounded to bf16 the only error left is the bf16 P.V operand.
  want_rounded = numpy_sparse_decode(q.astype(jnp.bfloat16), *case[1:], page_idx, valid)
  rel_rounded = np.max(np.abs(np.asarray(out, np.float64) - want_rounded)) / np.max(
      np.abs(want_rounded))
  assert rel_rounded < rel or rel_rounded <= 5e-3, (rel, rel_rounded)
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*case, page_idx, valid)]
  kernels = triton_kernels(functools.partial(sd.sparse_decode, config=CONFIG), *args)
  assert dot_types(kernels["sparse_paged_decode"]) == [("bf16", "bf16", "f32")] * 2


def test_input_validation():
  rng = np.random.default_rng(1)
  case = make_cache(rng, batch=4, heads=4, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=jnp.float32)
  page_idx, valid = select(case[0], case[1], case[3], case[4], BUDGETS, MAX_BUDGET)
  with pytest.raises(ValueError, match="pages_per_block=3"):
    sd.SparseDecodeConfig(pages_per_block=3)
  with pytest.raises(ValueError, match="k_splits=0"):
    sd.SparseDecodeConfig(k_splits=0)
  q48 = jnp.zeros((4, 4, 48))
  k48 = jnp.zeros((2, 10, PAGE, 48))
  with pytest.raises(ValueError, match="head_dim=48"):
    sd.sparse_decode(q48, k48, k48, case[3], case[4], page_idx, valid, interpret=True)
  with pytest.raises(ValueError, match="valid.shape"):
    sd.sparse_decode(*case, page_idx, valid[..., :3], interpret=True)
  with pytest.raises(ValueError, match="lengths.shape"):
    sd.sparse_decode(*case[:4], case[4][:2], page_idx, valid, interpret=True)
  # The two kernels' configs share their fields (split_k.LaunchConfig) but not their class.
  assert sd.SparseDecodeConfig().pages_per_block == 4
  assert pd.PagedDecodeConfig().pages_per_block == 8
  with pytest.raises(ValueError, match="expected a SparseDecodeConfig"):
    sd.sparse_decode(*case, page_idx, valid, interpret=True,
                     config=pd.PagedDecodeConfig(pages_per_block=4))
  with pytest.raises(ValueError, match="v_pages.dtype"):
    sd.sparse_decode(*case[:2], case[2].astype(jnp.bfloat16), *case[3:], page_idx, valid,
                     interpret=True)
