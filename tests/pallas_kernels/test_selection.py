"""Tests of landmarks, page scores and top-k page selection against numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import selection
from sparrow_jax.pallas_kernels.selection import LandmarkKind


@pytest.mark.parametrize("kind", list(LandmarkKind))
def test_compute_landmarks_matches_numpy(kind):
  rng = np.random.default_rng(0)
  keys = rng.standard_normal((3, 5, 16, 8)).astype(np.float32)  # [K, P, S, D]
  num_valid = rng.integers(0, 17, (3, 5))
  num_valid[0, :3] = (0, 1, 16)
  got = selection.compute_landmarks(jnp.asarray(keys), jnp.asarray(num_valid), kind.value)
  for k in range(3):
    for p in range(5):
      n = num_valid[k, p]
      rows = keys[k, p, :n].astype(np.float64)
      if kind is LandmarkKind.MEAN:
        want = rows.mean(0) if n else np.zeros(8)
        np.testing.assert_allclose(got[k, p], want, atol=1e-6, rtol=1e-6)
      else:
        lo, hi = (rows.min(0), rows.max(0)) if n else (np.zeros(8), np.zeros(8))
        np.testing.assert_array_equal(got[0][k, p], lo.astype(np.float32))
        np.testing.assert_array_equal(got[1][k, p], hi.astype(np.float32))


def test_gather_landmarks():
  rng = np.random.default_rng(1)
  lm = rng.standard_normal((2, 9, 4)).astype(np.float32)  # [K, P, D]
  table = rng.integers(0, 9, (3, 5)).astype(np.int32)  # [B, M]
  got = selection.gather_landmarks(jnp.asarray(lm), jnp.asarray(table))
  chex.assert_shape(got, (3, 2, 5, 4))
  np.testing.assert_array_equal(got, np.transpose(lm[:, table], (1, 0, 2, 3)))
  lo, hi = selection.gather_landmarks((jnp.asarray(lm), jnp.asarray(-lm)), jnp.asarray(table))
  np.testing.assert_array_equal(lo, got)
  np.testing.assert_array_equal(hi, -got)


@pytest.mark.parametrize("kind", list(LandmarkKind))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_score_pages_matches_numpy(kind, group):
  rng = np.random.default_rng(group)
  b, kvh, m, d = 2, 3, 7, 20  # d not a power of two exercises the tree-sum padding
  q = rng.standard_normal((b, kvh * group, d)).astype(np.float32)
  keys = rng.standard_normal((b, kvh, m, 16, d)).astype(np.float32)
  lm = selection.compute_landmarks(jnp.asarray(keys), jnp.full((b, kvh, m), 16), kind)
  got = selection.score_pages(jnp.asarray(q), lm, kind)
  chex.assert_shape(got, (b, kvh, m))
  qg = q.astype(np.float64).reshape(b, kvh, group, d)
  if kind is LandmarkKind.MEAN:
    want = np.einsum("bkd,bkmd->bkm", qg.mean(2), np.asarray(lm, np.float64))
  else:
    lo, hi = (np.asarray(x, np.float64)[:, :, None] for x in lm)  # [B, K, 1, M, D]
    qe = qg[:, :, :, None, :]
    want = np.maximum(qe * hi, qe * lo).sum(-1).max(2)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", list(LandmarkKind))
def test_scores_independent_of_batch_shape(kind):
  """A decode step (one query) and a teacher-forced chunk score bitwise identically."""
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((2, 24, 8, 128)), jnp.float32)  # [B, C, H, D]
  keys = jnp.asarray(rng.standard_normal((2, 4, 30, 16, 128)), jnp.float32)
  lm = selection.compute_landmarks(keys, jnp.full((2, 4, 30), 16), kind)
  chunk = jax.jit(lambda q, lm: selection.score_pages(
      q, jax.tree.map(lambda x: x[:, None], lm), kind))(q, lm)  # [B, C, K, M]
  step = jax.jit(lambda q, lm: selection.score_pages(q, lm, kind))
  for t in range(0, 24, 5):
    np.testing.assert_array_equal(chunk[:, t], step(q[:, t], lm))


def numpy_select(scores, num_pages, budget, max_budget, bos, recent, n_slots):
  """Independent reference of `select_pages`' documented layout using numpy argsort."""
  b, kvh, m = scores.shape
  idx = np.zeros((b, kvh, n_slots), np.int32)
  ok = np.zeros((b, kvh, n_slots), bool)
  for i in range(b):
    n = min(max(int(num_pages[i]), 0), m)
    cands = np.arange(bos, max(n - recent, bos))
    take = min(max(int(budget[i]), 0), max_budget, len(cands))
    for k in range(kvh):
      slots = [(j, j < n) for j in range(bos)]
      slots += [(j, j >= bos) for j in range(n - recent, n)]
      order = cands[np.argsort(-scores[i, k, cands], kind="stable")]
      slots += [(int(j), True) for j in order[:take]]
      for s, (j, v) in enumerate(slots):
        idx[i, k, s], ok[i, k, s] = (j if v else 0), v
  return idx, ok


@pytest.mark.parametrize("bos,recent,slot_multiple", [(1, 2, 1), (1, 2, 8), (0, 0, 1),
                                                      (2, 1, 4), (0, 3, 1), (3, 0, 2)])
def test_select_pages_equals_numpy_argsort(bos, recent, slot_multiple):
  rng = np.random.default_rng(10 * bos + recent + slot_multiple)
  b, kvh, m, max_budget = 12, 3, 20, 6
  scores = rng.integers(-3, 4, (b, kvh, m)).astype(np.float32)  # many ties
  num_pages = np.array([0, 1, 2, 3, 4, 5, 9, 10, 13, 20, 20, 25])
  budget = np.array([3, 6, 0, 2, 6, 1, 4, 9, 5, 6, 0, 3])
  page_idx, valid = selection.select_pages(
      jnp.asarray(scores), jnp.asarray(num_pages), jnp.asarray(budget), max_budget=max_budget,
      reserved_bos=bos, reserved_recent=recent, slot_multiple=slot_multiple)
  n_slots = selection.num_selected_slots(max_budget, bos, recent, slot_multiple)
  assert n_slots % slot_multiple == 0 and n_slots >= max_budget + bos + recent
  chex.assert_shape((page_idx, valid), (b, kvh, n_slots))
  want_idx, want_ok = numpy_select(scores, num_pages, budget, max_budget, bos, recent, n_slots)
  np.testing.assert_array_equal(valid, want_ok)
  np.testing.assert_array_equal(page_idx, want_idx)
  for i in range(b):  # reserved pages always present, selection dense when it fits
    n = min(num_pages[i], m)
    for k in range(kvh):
      chosen = set(np.asarray(page_idx[i, k])[np.asarray(valid[i, k])].tolist())
      assert len(chosen) == int(valid[i, k].sum())  # distinct
      assert set(range(min(bos, n))) | set(range(max(n - recent, 0), n)) <= chosen
      if n <= min(budget[i], max_budget) + bos + recent:
        assert chosen == set(range(n))


@pytest.mark.parametrize("kind", list(LandmarkKind))
def test_select_decode_pages_end_to_end(kind):
  """Pool landmarks -> page table gather -> scores -> selection equals numpy argsort of the
  same scores, and the scores equal a float64 numpy computation."""
  rng = np.random.default_rng(4)
  b, h, kvh, d, s, p, m = 3, 8, 2, 32, 16, 40, 12
  keys = rng.standard_normal((kvh, p, s, d)).astype(np.float32)
  q = rng.standard_normal((b, h, d)).astype(np.float32)
  table = np.zeros((b, m), np.int32)
  lengths = np.array([181, 40, 16], np.int32)
  perm = rng.permutation(np.arange(1, p))
  used = 0
  for i, n in enumerate(lengths):
    pages = -(-n // s)
    table[i, :pages] = perm[used:used + pages]
    used += pages
  nv = np.full((kvh, p), s)
  lm = selection.compute_landmarks(jnp.asarray(keys), jnp.asarray(nv), kind)
  budget = np.array([4, 4, 2])
  page_idx, valid = selection.select_decode_pages(
      jnp.asarray(q), lm, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(budget),
      kind=kind, max_budget=5, page_size=s)
  scores = np.asarray(selection.score_pages(jnp.asarray(q),
                                            selection.gather_landmarks(lm, jnp.asarray(table)),
                                            kind))
  page_keys = keys[:, table].astype(np.float64)  # [K, B, M, S, D]
  qg = q.astype(np.float64).reshape(b, kvh, h // kvh, d)
  if kind is LandmarkKind.MEAN:
    want = np.einsum("bkd,kbmd->bkm", qg.mean(2), page_keys.mean(3))
  else:
    lo, hi = page_keys.min(3), page_keys.max(3)  # [K, B, M, D]
    prod = np.maximum(qg[:, :, :, None] * np.transpose(hi, (1, 0, 2, 3))[:, :, None],
                      qg[:, :, :, None] * np.transpose(lo, (1, 0, 2, 3))[:, :, None])
    want = prod.sum(-1).max(2)
  np.testing.assert_allclose(scores, want, atol=1e-4, rtol=1e-5)
  num_pages = -(-lengths // s)
  want_idx, want_ok = numpy_select(scores, num_pages, budget, 5, 1, 2, 8)
  np.testing.assert_array_equal(page_idx, want_idx)
  np.testing.assert_array_equal(valid, want_ok)
  assert int(valid[0].sum(-1)[0]) == 1 + 2 + 4  # long sequence: reserved + budget
  assert int(valid[2].sum(-1)[0]) == 1  # one page: dense


def test_budget_is_traced_no_recompile():
  rng = np.random.default_rng(5)
  scores = jnp.asarray(rng.standard_normal((2, 2, 30)), jnp.float32)
  num_pages = jnp.asarray([30, 17])
  fn = jax.jit(lambda sc, n, bud: selection.select_pages(sc, n, bud, max_budget=8))
  counts = []
  for budget in ([0, 0], [3, 8], [8, 5], [1, 2]):
    _, valid = fn(scores, num_pages, jnp.asarray(budget, jnp.int32))
    counts.append(np.asarray(valid.sum(-1))[:, 0].tolist())
  assert fn._cache_size() == 1
  assert counts == [[3, 3], [6, 11], [11, 8], [4, 5]]


def test_validation_errors():
  scores = jnp.zeros((2, 1, 5))
  n, bud = jnp.asarray([5, 5]), jnp.asarray([1, 1])
  with pytest.raises(ValueError, match="max_budget=-1"):
    selection.select_pages(scores, n, bud, max_budget=-1)
  with pytest.raises(ValueError, match="slot_multiple=0"):
    selection.select_pages(scores, n, bud, max_budget=2, slot_multiple=0)
  with pytest.raises(ValueError, match=r"budget.shape=\(3,\)"):
    selection.select_pages(scores, n, jnp.asarray([1, 1, 1]), max_budget=2)
  with pytest.raises(ValueError, match="kind='topk'"):
    selection.compute_landmarks(jnp.zeros((2, 16, 4)), jnp.asarray([1, 2]), "topk")
  with pytest.raises(ValueError, match="num_valid.shape"):
    selection.compute_landmarks(jnp.zeros((2, 16, 4)), jnp.asarray([1, 2, 3]), "mean")
  with pytest.raises(ValueError, match="quest expects"):
    selection.score_pages(jnp.zeros((1, 2, 4)), jnp.zeros((1, 1, 3, 4)), "quest")
  with pytest.raises(ValueError, match="H=3"):
    selection.score_pages(jnp.zeros((1, 3, 4)), jnp.zeros((1, 2, 3, 4)), "mean")


def test_bf16_landmarks_are_stored_rounded_and_read_back_the_same():
  """The cache rounds landmarks to bf16 once when a page fills (or at prefill); decode scores
  them upcast; `round_landmarks` gives teacher-forced selection the same values (idempotent on
  what the cache holds)."""
  from sparrow_jax.models.kv_cache import PagedKVCache
  rng = np.random.default_rng(4)
  kvh, d, s = 2, 16, 4
  cache = PagedKVCache.create(num_layers=1, num_kv_heads=kvh, head_dim=d, num_slots=1,
                              num_pages=4, max_pages_per_seq=3, page_size=s, landmark="quest",
                              landmark_dtype="bfloat16")
  cache = cache.assign_slots(jnp.array([0]), jnp.array([[1, 2, 3]], jnp.int32),
                             jnp.array([0], jnp.int32))
  keys = jnp.asarray(rng.standard_normal((1, 8, kvh, d)), jnp.float32)
  cache = cache.write_prompt(0, keys, keys, jnp.array([[1, 2, 3]], jnp.int32),
                             jnp.array([8], jnp.int32))
  lo, hi = cache.landmarks[0]
  assert lo.dtype == hi.dtype == jnp.bfloat16
  pages = keys[0].reshape(2, s, kvh, d).transpose(2, 0, 1, 3)  # [K, 2, S, D]
  want = selection.compute_landmarks(pages, jnp.full((kvh, 2), s), "quest")
  rounded = selection.round_landmarks(want, jnp.bfloat16)
  for got, w in zip((lo, hi), rounded):
    np.testing.assert_array_equal(np.asarray(got[:, 1:3], np.float32), np.asarray(w))
  again = selection.round_landmarks(tuple(x.astype(jnp.float32) for x in (lo, hi)),
                                    jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(lo, np.float32))
  assert selection.round_landmarks(want, "float32") is want
