"""The page-score kernel (pallas_kernels/page_scores.py) in the Pallas interpreter against the
XLA scoring (`landmarks.score_pages` of the gathered landmarks), its selection and wiring
through the decode attention, and its build for an H200 (Triton IR compiled for sm_90)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.kv_cache import PagedKVCache
from sparrow_jax.pallas_kernels import gpu_compile, landmarks, page_scores, selection
from tests.pallas_kernels.paged_cases import triton_calls_or_skip


def _case(rng, *, batch=3, kv_heads=2, group=2, head_dim=32, pool=40, width=13,
          lm_dtype=jnp.float32, kind="mean"):
  q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim)), jnp.float32)
  lm = jnp.asarray(rng.standard_normal((kv_heads, pool, head_dim)), lm_dtype)
  if kind == "quest":  # per-channel min <= max
    other = jnp.asarray(rng.standard_normal((kv_heads, pool, head_dim)), lm_dtype)
    lm = (jnp.minimum(lm, other), jnp.maximum(lm, other))
  table = jnp.asarray(rng.integers(0, pool, (batch, width)), jnp.int32)
  return q, lm, table


@pytest.mark.parametrize("kind,group", [("mean", 2), ("quest", 2), ("quest", 3)])
@pytest.mark.parametrize("lm_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("pages_per_block", [4, 16])
def test_kernel_scores_equal_the_xla_scores_of_existing_pages(kind, group, lm_dtype,
                                                                pages_per_block):
  rng = np.random.default_rng(0)
  q, lm, table = _case(rng, lm_dtype=lm_dtype, kind=kind, group=group)
  # a full table, a short sequence (its last block partly past it), an empty slot; and a
  # count past the table's width (clamped to it)
  for num_pages in ([13, 5, 0], [40, 1, 9]):
    num_pages = jnp.asarray(num_pages, jnp.int32)
    want = landmarks.score_pages(q, landmarks.gather_landmarks(lm, table), kind)
    got = page_scores.page_scores(q, lm, table, num_pages, kind=kind,
                                  pages_per_block=pages_per_block, interpret=True)
    assert got.shape == want.shape == (3, 2, 13) and got.dtype == jnp.float32
    exists = np.arange(13)[None, None, :] < np.minimum(np.asarray(num_pages), 13)[:, None, None]
    np.testing.assert_allclose(np.where(exists, got, 0.0), np.where(exists, want, 0.0),
                               rtol=1e-5, atol=1e-5)
    # blocks wholly past a sequence's pages are zeros (the empty slot's, here)
    if int(num_pages[2]) == 0:
      assert not np.any(np.asarray(got)[2])


@pytest.mark.parametrize("kind", ["mean", "quest"])
def test_decode_selection_with_the_kernel_matches_xla(kind):
  """Same pages selected by both scorers (random scores: no near ties), with the reserved
  pages and per-sequence budgets of a decode step."""
  rng = np.random.default_rng(1)
  q, lm, table = _case(rng, batch=4, head_dim=64, pool=80, width=19, kind=kind)
  lengths = jnp.asarray([19 * 4, 33, 9, 4 * 11 + 1], jnp.int32)  # page size 4
  budget = jnp.asarray([5, 3, 8, 0], jnp.int32)
  out = {s: selection.select_decode_pages(q, lm, table, lengths, budget, kind=kind,
                                          max_budget=8, page_size=4, scorer=s)
         for s in ("xla", "pallas_interpret")}
  for a, b in zip(out["xla"], out["pallas_interpret"]):
    np.testing.assert_array_equal(a, b)
  assert int(out["xla"][1].sum()) > 0
  with pytest.raises(ValueError, match="scorer='triton'"):
    selection.select_decode_pages(q, lm, table, lengths, budget, kind="mean", max_budget=8,
                                  page_size=4, scorer="triton")


def _decode_jaxpr(backend, landmark, page_scorer="auto"):
  spec = attn_lib.BlockSparse(max_budget=2, page_size=4, dense_layers=(), landmark=landmark,
                              backend=backend, page_scorer=page_scorer)
  cache = PagedKVCache.create(num_layers=1, num_kv_heads=2, head_dim=16, num_slots=2,
                              num_pages=12, max_pages_per_seq=5, page_size=4, landmark=landmark)
  q = jnp.ones((2, 4, 16), jnp.float32)
  lengths = jnp.asarray([17, 6], jnp.int32)
  fn = lambda q: attn_lib.decode_attention(spec, 0, q, cache, lengths,
                                           budgets=jnp.asarray([2, 2], jnp.int32))
  return str(jax.make_jaxpr(fn)(q))


def test_decode_attention_scores_with_the_kernel_on_the_triton_backends_only():
  assert "page_scores" in _decode_jaxpr("pallas_interpret", "mean")
  assert "page_scores" in _decode_jaxpr("pallas_interpret", "quest")
  assert "page_scores" not in _decode_jaxpr("xla", "mean")
  assert "page_scores" not in _decode_jaxpr("pallas_interpret", "mean", page_scorer="xla")
  with pytest.raises(ValueError, match="page_scorer='triton'"):
    attn_lib.BlockSparse(max_budget=2, page_scorer="triton")


def test_bad_arguments_name_what_is_wrong():
  q = jnp.zeros((2, 4, 24), jnp.float32)
  lm = jnp.zeros((2, 10, 24), jnp.float32)
  table = jnp.zeros((2, 5), jnp.int32)
  n = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="head dim 24"):
    page_scores.page_scores(q, lm, table, n, interpret=True)
  q, lm = q[..., :16], lm[..., :16]
  with pytest.raises(ValueError, match="expects a .min, max. pair"):
    page_scores.page_scores(q, lm, table, n, kind="quest", interpret=True)
  with pytest.raises(ValueError, match="expects one"):
    page_scores.page_scores(q, (lm, lm), table, n, interpret=True)
  with pytest.raises(ValueError, match="H=4 heads: expected a multiple of the K=3"):
    page_scores.page_scores(q, jnp.zeros((3, 10, 16)), table, n, interpret=True)
  with pytest.raises(ValueError, match="landmarks shapes"):
    page_scores.page_scores(q, jnp.zeros((2, 10, 8)), table, n, interpret=True)
  with pytest.raises(ValueError, match="page_table.shape"):
    page_scores.page_scores(q, lm, table[:1], n, interpret=True)
  with pytest.raises(ValueError, match="num_pages.shape"):
    page_scores.page_scores(q, lm, table, n[:1], interpret=True)
  with pytest.raises(ValueError, match="pages_per_block=6"):
    page_scores.page_scores(q, lm, table, n, pages_per_block=6, interpret=True)


@pytest.mark.parametrize("kind", ["mean", "quest"])
@pytest.mark.parametrize("lm_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_builds_for_an_h200_without_spills(kind, lm_dtype):
  """At the engine's 32K x 16-sequence Qwen3-1.7B shape (16 q / 8 kv heads x 128, 2,058
  table columns, the pool of 32,928 pages) the kernel compiles for sm_90 without spills."""
  s = jax.ShapeDtypeStruct
  pool = s((8, 32928, 128), lm_dtype)
  args = (s((16, 16, 128), jnp.bfloat16), (pool, pool) if kind == "quest" else pool,
          s((16, 2058), jnp.int32), s((16,), jnp.int32))
  (call,) = triton_calls_or_skip(functools.partial(page_scores.page_scores, kind=kind), *args)
  assert call.name == "page_scores"
  res = gpu_compile.compile_call(call)
  assert res.spill_store_bytes == res.spill_load_bytes == 0
  assert res.registers <= 128 and res.blocks_per_sm >= 4
