"""Dense paged decode without a materialised gather (`blocked_decode`) against the references.

Shuffled physical pages, partial last pages, an empty slot, table widths that are not a
multiple of the block; float32 against float64 numpy and the float32 reference, bfloat16
against the float32 reference of the same rounded values. The compiled step holds no array of
the gathered [B, K, M*S, D] size, and it runs only the blocks the longest sequence needs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import blocked_decode, reference


def case(rng, *, b=3, h=6, kvh=2, d=16, s=4, m=9, lengths=(33, 0, 7), dtype=jnp.float32):
  p = b * m + 2
  k_pages = jnp.asarray(rng.standard_normal((kvh, p, s, d)), jnp.float32).astype(dtype)
  v_pages = jnp.asarray(rng.standard_normal((kvh, p, s, d)), jnp.float32).astype(dtype)
  table = jnp.asarray(rng.permutation(np.arange(1, p))[:b * m].reshape(b, m), jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32).astype(dtype)
  return q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32)


def numpy_decode(q, k_pages, v_pages, table, lengths):
  q, kp, vp = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  b, h, d = q.shape
  kvh, _, s, _ = kp.shape
  g = h // kvh
  out = np.zeros((b, h, d))
  for i in range(b):
    n = int(lengths[i])
    if n == 0:
      continue
    keys = kp[:, np.asarray(table[i])].reshape(kvh, -1, d)[:, :n]  # [K, n, D]
    vals = vp[:, np.asarray(table[i])].reshape(kvh, -1, d)[:, :n]
    for hh in range(h):
      sc = keys[hh // g] @ q[i, hh] / np.sqrt(d)
      w = np.exp(sc - sc.max())
      out[i, hh] = (w / w.sum()) @ vals[hh // g]
  return out


@pytest.mark.parametrize("pages_per_block", [1, 2, 4, 16])
def test_float32_matches_float64_and_reference(pages_per_block):
  q, kp, vp, table, lengths = case(np.random.default_rng(pages_per_block))
  got = jax.jit(lambda *a: blocked_decode.dense_decode_blocked(
      *a, pages_per_block=pages_per_block))(q, kp, vp, table, lengths)
  np.testing.assert_allclose(np.asarray(got), numpy_decode(q, kp, vp, table, lengths),
                             atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(got[1]).max()) == 0.0  # the empty slot
  want = reference.dense_decode_reference(q, kp, vp, table, lengths)
  np.testing.assert_allclose(np.asarray(got)[[0, 2]], np.asarray(want)[[0, 2]], atol=1e-6)


def test_bfloat16_cache():
  q, kp, vp, table, lengths = case(np.random.default_rng(5), lengths=(36, 20, 1),
                                   dtype=jnp.bfloat16)
  got = blocked_decode.dense_decode_blocked(q, kp, vp, table, lengths, pages_per_block=2)
  assert got.dtype == jnp.bfloat16
  want = numpy_decode(q, kp, vp, table, lengths)  # float64 of the same bf16 values
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


def test_no_gathered_copy_and_only_needed_blocks():
  """No [B, K, M*S, D] array in the compiled step (only one block's gather), and pages past
  the longest sequence are never read: NaN there changes nothing."""
  b, kvh, d, s, m = 2, 2, 16, 4, 64
  q, kp, vp, table, _ = case(np.random.default_rng(6), b=b, h=4, kvh=kvh, d=d, s=s, m=m,
                             lengths=(0, 0))
  lengths = jnp.asarray([40, 17], jnp.int32)
  fn = jax.jit(lambda *a: blocked_decode.dense_decode_blocked(*a, pages_per_block=4))
  hlo = fn.lower(q, kp, vp, table, lengths).compile().as_text()
  full = b * kvh * m * s * d
  sizes = [int(np.prod([int(x) for x in dims.split(",") if x]))
           for dims in re.findall(r"f32\[([0-9,]*)\]", hlo)]
  pool = kp.size
  assert max(x for x in sizes if x != pool) < full, sorted(set(sizes))[-5:]
  # Pages from logical page 12 on (past 40 tokens, in blocks of 4 pages) hold NaN.
  late = np.zeros(kp.shape[1], bool)
  late[np.asarray(table[:, 12:]).ravel()] = True
  poison = lambda x: jnp.where(jnp.asarray(late)[None, :, None, None], jnp.nan, x)
  clean = fn(q, kp, vp, table, lengths)
  np.testing.assert_array_equal(np.asarray(fn(q, poison(kp), poison(vp), table, lengths)),
                                np.asarray(clean))


def test_validation_errors():
  q, kp, vp, table, lengths = case(np.random.default_rng(7))
  with pytest.raises(ValueError, match="pages_per_block=0"):
    blocked_decode.dense_decode_blocked(q, kp, vp, table, lengths, pages_per_block=0)
  with pytest.raises(ValueError, match="lengths.shape"):
    blocked_decode.dense_decode_blocked(q, kp, vp, table, lengths[:2])
  with pytest.raises(ValueError, match="q.shape"):
    blocked_decode.dense_decode_blocked(q[:, :3], kp, vp, table, lengths)
