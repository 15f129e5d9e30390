"""Tests of top-k page selection (and `select_decode_pages` end to end) against numpy
references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import landmarks, selection
from sparrow_jax.pallas_kernels.landmarks import LandmarkKind


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
  lm = landmarks.compute_landmarks(jnp.asarray(keys), jnp.asarray(nv), kind)
  budget = np.array([4, 4, 2])
  page_idx, valid = selection.select_decode_pages(
      jnp.asarray(q), lm, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(budget),
      kind=kind, max_budget=5, page_size=s)
  scores = np.asarray(landmarks.score_pages(jnp.asarray(q),
                                            landmarks.gather_landmarks(lm, jnp.asarray(table)),
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
