"""The Pallas Mosaic TPU decode kernels in TPU interpret mode, against the references.

Interpret mode (`pltpu.InterpretParams`) simulates HBM, VMEM, the page DMAs and their
semaphores on CPU and raises on an out-of-bounds read, so these tests check indexing, the
double-buffered copies and the numerics; a TPU export checks the Pallas -> Mosaic lowering. Each
call is slow (~10 s of tracing), so every case packs several situations into one batch: ragged
lengths with partial pages, budgets 0 .. max (and past the pages a sequence has), GQA 2 and 4,
mean and quest selections, float32 and bf16 caches, an empty slot.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from sparrow_jax.pallas_kernels import dispatch, landmarks, reference, selection
from sparrow_jax.pallas_kernels import tpu_decode as td
from tests.pallas_kernels.paged_cases import make_cache

PAGE = 16
LENGTHS = (203, 37, 150, 9)  # partial last pages; the last is shorter than the reserved pages
BUDGETS = (3, 0, 6, 6)  # 0 .. max; row 1 has fewer candidates than its budget
MAX_BUDGET = 6
CONFIG = td.TpuDecodeConfig(pages_per_block=2)  # 9 slots -> 5 blocks, the last half padding


def _rel(out, want):
  out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(out - want)) / np.max(np.abs(want)))


def _select(case, kind):
  q, k_pages, _, table, lengths = case
  nv = jnp.full(k_pages.shape[:2], PAGE, jnp.int32)
  lm = landmarks.compute_landmarks(k_pages, nv, kind)
  return selection.select_decode_pages(q, lm, table, lengths, jnp.asarray(BUDGETS, jnp.int32),
                                       kind=kind, max_budget=MAX_BUDGET, page_size=PAGE,
                                       slot_multiple=CONFIG.slot_multiple())


@functools.partial(jax.jit, static_argnames=("backend",))
def _sparse(q, k_pages, v_pages, table, lengths, page_idx, valid, backend):
  return dispatch.sparse_decode_attention(q, k_pages, v_pages, table, lengths, page_idx, valid,
                                          backend=backend, config=CONFIG)


@pytest.mark.parametrize("kind,group,dtype", [
    ("mean", 2, jnp.float32),
    pytest.param("quest", 4, jnp.float32, marks=pytest.mark.slow),
    pytest.param("quest", 2, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("mean", 4, jnp.bfloat16, marks=pytest.mark.slow)])
def test_sparse_kernel_equals_the_xla_path(kind, group, dtype):
  rng = np.random.default_rng(group + 10 * (kind == "quest"))
  case = make_cache(rng, batch=4, heads=2 * group, kv_heads=2, head_dim=64, lengths=LENGTHS,
                    max_pages=16, dtype=dtype)
  page_idx, valid = _select(case, kind)
  out = _sparse(*case, page_idx, valid, "pallas_tpu_interpret")
  want = _sparse(*case, page_idx, valid, "xla")  # = reference.sparse_decode_reference
  assert out.dtype == dtype and out.shape == case[0].shape
  assert np.isfinite(np.asarray(out, np.float32)).all()
  tol = 1e-4 if dtype == jnp.float32 else 2e-2
  assert _rel(out, want) <= tol, (_rel(out, want), tol)
  if dtype == jnp.bfloat16:  # and against the float32 reference of the same bf16 cache
    want32 = reference.sparse_decode_reference(case[0].astype(jnp.float32), *case[1:],
                                               page_idx, valid)
    assert _rel(out, want32) <= tol


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow),
                                   jnp.bfloat16])
def test_dense_decode_equals_the_xla_path(dtype):
  """float32: the block kernel over every page; bf16: jax's ops.tpu.paged_attention. An empty
  slot (length 0) gives 0; a table width (13) that is not a multiple of the block is padded."""
  rng = np.random.default_rng(7)
  lengths = (203, 0, 150, 9)
  case = make_cache(rng, batch=4, heads=8, kv_heads=2, head_dim=64, lengths=lengths,
                    max_pages=13, dtype=dtype)
  config = td.TpuDecodeConfig(pages_per_block=4)
  out = dispatch.dense_decode_attention(*case, backend="pallas_tpu_interpret", config=config)
  want = dispatch.dense_decode_attention(*case, backend="xla")
  assert out.dtype == dtype
  assert not np.asarray(out[1], np.float32).any()
  tol = 1e-4 if dtype == jnp.float32 else 2e-2
  assert _rel(out, want) <= tol, _rel(out, want)
  want32 = reference.dense_decode_reference(case[0].astype(jnp.float32), *case[1:])
  rows = np.array([0, 2, 3])  # the reference's empty row is degenerate (uniform over masked tokens)
  assert _rel(out[rows], want32[rows]) <= tol


def test_export_for_tpu_is_a_mosaic_call():
  """The Pallas -> Mosaic lowering runs on this CPU: both decode attentions export for
  platform tpu as one `tpu_custom_call` each (what a TPU compiles)."""
  s = jax.ShapeDtypeStruct
  b, kvh, g, d, p, m, n = 4, 8, 2, 128, 64, 32, 24
  base = (s((b, kvh * g, d), jnp.bfloat16), s((kvh, p, PAGE, d), jnp.bfloat16),
          s((kvh, p, PAGE, d), jnp.bfloat16), s((b, m), jnp.int32), s((b,), jnp.int32))
  sel = (s((b, kvh, n), jnp.int32), s((b, kvh, n), jnp.bool_))
  for fn, args in ((td.sparse_decode_tpu, base + sel), (td.dense_decode_tpu, base)):
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("tpu_custom_call") == 1, fn.__name__


def test_backend_resolution_and_bad_input():
  assert dispatch.resolve_backend("pallas_tpu_interpret") is (
      dispatch.Backend.PALLAS_TPU_INTERPRET)
  if not any(dev.platform == "tpu" for dev in jax.devices()):
    with pytest.raises(ValueError, match="needs a TPU"):
      dispatch.resolve_backend("pallas_tpu")
    assert dispatch.resolve_backend("auto") is not dispatch.Backend.PALLAS_TPU
  with pytest.raises(ValueError, match="TpuDecodeConfig.pages_per_block=0"):
    td.TpuDecodeConfig(pages_per_block=0)
  q = jnp.zeros((2, 4, 64))
  pages = jnp.zeros((2, 5, PAGE, 64))
  table, lengths = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match="expected a TpuDecodeConfig"):
    td.dense_decode_tpu(q, pages, pages, table, lengths, interpret=True,
                        config=dispatch.SparseDecodeConfig())
  with pytest.raises(ValueError, match="valid.shape"):
    td.sparse_decode_tpu(q, pages, pages, table, lengths, jnp.zeros((2, 2, 3), jnp.int32),
                         jnp.zeros((2, 2, 2), bool), interpret=True)
