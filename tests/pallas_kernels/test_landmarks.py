"""Tests of page landmarks and XLA page scores against numpy references (bitwise agreement
between a decode step and a teacher-forced chunk included)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import landmarks
from sparrow_jax.pallas_kernels.landmarks import LandmarkKind


@pytest.mark.parametrize("kind", list(LandmarkKind))
def test_compute_landmarks_matches_numpy(kind):
  rng = np.random.default_rng(0)
  keys = rng.standard_normal((3, 5, 16, 8)).astype(np.float32)  # [K, P, S, D]
  num_valid = rng.integers(0, 17, (3, 5))
  num_valid[0, :3] = (0, 1, 16)
  got = landmarks.compute_landmarks(jnp.asarray(keys), jnp.asarray(num_valid), kind.value)
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
  got = landmarks.gather_landmarks(jnp.asarray(lm), jnp.asarray(table))
  chex.assert_shape(got, (3, 2, 5, 4))
  np.testing.assert_array_equal(got, np.transpose(lm[:, table], (1, 0, 2, 3)))
  lo, hi = landmarks.gather_landmarks((jnp.asarray(lm), jnp.asarray(-lm)), jnp.asarray(table))
  np.testing.assert_array_equal(lo, got)
  np.testing.assert_array_equal(hi, -got)


@pytest.mark.parametrize("kind", list(LandmarkKind))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_score_pages_matches_numpy(kind, group):
  rng = np.random.default_rng(group)
  b, kvh, m, d = 2, 3, 7, 20  # d not a power of two exercises the tree-sum padding
  q = rng.standard_normal((b, kvh * group, d)).astype(np.float32)
  keys = rng.standard_normal((b, kvh, m, 16, d)).astype(np.float32)
  lm = landmarks.compute_landmarks(jnp.asarray(keys), jnp.full((b, kvh, m), 16), kind)
  got = landmarks.score_pages(jnp.asarray(q), lm, kind)
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
  lm = landmarks.compute_landmarks(keys, jnp.full((2, 4, 30), 16), kind)
  chunk = jax.jit(lambda q, lm: landmarks.score_pages(
      q, jax.tree.map(lambda x: x[:, None], lm), kind))(q, lm)  # [B, C, K, M]
  step = jax.jit(lambda q, lm: landmarks.score_pages(q, lm, kind))
  for t in range(0, 24, 5):
    np.testing.assert_array_equal(chunk[:, t], step(q[:, t], lm))


def test_landmark_validation_errors():
  with pytest.raises(ValueError, match="kind='topk'"):
    landmarks.compute_landmarks(jnp.zeros((2, 16, 4)), jnp.asarray([1, 2]), "topk")
  with pytest.raises(ValueError, match="num_valid.shape"):
    landmarks.compute_landmarks(jnp.zeros((2, 16, 4)), jnp.asarray([1, 2, 3]), "mean")
  with pytest.raises(ValueError, match="quest expects"):
    landmarks.score_pages(jnp.zeros((1, 2, 4)), jnp.zeros((1, 1, 3, 4)), "quest")
  with pytest.raises(ValueError, match="H=3"):
    landmarks.score_pages(jnp.zeros((1, 3, 4)), jnp.zeros((1, 2, 3, 4)), "mean")


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
  want = landmarks.compute_landmarks(pages, jnp.full((kvh, 2), s), "quest")
  rounded = landmarks.round_landmarks(want, jnp.bfloat16)
  for got, w in zip((lo, hi), rounded):
    np.testing.assert_array_equal(np.asarray(got[:, 1:3], np.float32), np.asarray(w))
  again = landmarks.round_landmarks(tuple(x.astype(jnp.float32) for x in (lo, hi)),
                                    jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(lo, np.float32))
  assert landmarks.round_landmarks(want, "float32") is want
