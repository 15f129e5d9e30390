"""Causal flash attention in XLA (`flash_xla`) against float64 numpy, forward and gradients.

The float64 reference computes softmax attention and its analytic gradient
(dV = P^T dO, dS = P * (dP - rowsum(dP * P)), dQ = s dS K, dK = s dS^T Q, summed over each
kv head's query group) on the same inputs. Separate checks: bfloat16 operands stay bfloat16
in the dots, keys after a chunk are never read (NaN there changes nothing before it), no
array of a chunk's full-key size is ever built, and the block-sparse page mask equals the
previous full-key implementation (values and gradients).
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.pallas_kernels import flash_xla
from sparrow_jax.pallas_kernels import teacher_forced as tf


def qkv(rng, b, t, h, kvh, d, dtype=jnp.float32):
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  return mk(b, t, h, d), mk(b, t, kvh, d), mk(b, t, kvh, d)


def attention_f64(q, k, v, dout, allowed=None):
  """(out, dq, dk, dv) in float64; `allowed` [B, T, K, T] bool extra key mask (causal always)."""
  q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
  b, t, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, T, H, D]
  scale = d ** -0.5
  s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
  mask = np.tril(np.ones((t, t), bool))[None, None]
  if allowed is not None:
    mask = mask & np.repeat(np.transpose(allowed, (0, 2, 1, 3)), g, axis=1)
  s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, vv)
  do = np.transpose(dout, (0, 2, 1, 3))  # [B, H, T, D]
  dv = np.einsum("bhqk,bhqd->bkhd", p, do)
  dp = np.einsum("bhqd,bkhd->bhqk", do, vv)
  ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  group_sum = lambda x: x.reshape(b, t, kvh, g, d).sum(3)
  return out, dq, group_sum(dk), group_sum(dv)


def loss_and_grads(fn, q, k, v, dout):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out,) + vjp(dout.astype(out.dtype))


@pytest.mark.parametrize("b,t,h,kvh,d,block", [
    (2, 37, 4, 2, 16, 16),   # partial last chunk, GQA 2
    (2, 50, 4, 4, 16, 128),  # one chunk (the diagonal block only)
    (1, 33, 6, 1, 8, 8),     # multi-query, 5 chunks
])
def test_matches_float64_forward_and_gradients(b, t, h, kvh, d, block):
  rng = np.random.default_rng(t + block)
  q, k, v = qkv(rng, b, t, h, kvh, d)
  dout = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  got = loss_and_grads(jax.jit(lambda q, k, v: flash_xla.flash_attention_causal(
      q, k, v, block=block)), q, k, v, dout)
  want = attention_f64(q, k, v, dout)
  chex.assert_tree_all_finite(got)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-5, err_msg=name)


def test_bfloat16_operands_stay_bfloat16_with_float32_accumulation():
  rng = np.random.default_rng(1)
  q, k, v = qkv(rng, 2, 48, 4, 2, 32, jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  fn = lambda q, k, v: flash_xla.flash_attention_causal(q, k, v, block=16)
  got = loss_and_grads(fn, q, k, v, dout)
  assert all(x.dtype == jnp.bfloat16 for x in got)
  want = attention_f64(q, k, v, dout)  # float64 of the same bf16-rounded inputs
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2, rtol=3e-2,
                               err_msg=name)
  # Every dot takes bfloat16 operands and accumulates in float32 (no float32 copy of q/k/v).
  text = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do)).lower(q, k, v, dout).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) >= 7, dots  # forward QK, PV; backward QK, dP, dV, dQ, dK
  for line in dots:
    operands, result = line.rsplit(":", 1)[1].split("->")
    assert operands.count("bf16") == 2 and "xf32>" in result, line


def test_keys_after_a_chunk_are_never_read():
  """NaN keys and values from position 32 on: with chunks of 16 the outputs (and gradients)
  of positions < 32 are those of clean inputs. The full-key reference multiplies the masked
  NaN values by zero probabilities and returns NaN there."""
  rng = np.random.default_rng(2)
  q, k, v = qkv(rng, 1, 64, 4, 2, 16)
  future = (jnp.arange(64) >= 32)[None, :, None, None]
  k_bad, v_bad = jnp.where(future, jnp.nan, k), jnp.where(future, jnp.nan, v)
  fn = lambda q, k, v: flash_xla.flash_attention_causal(q, k, v, block=16)
  clean, bad = fn(q, k, v), fn(q, k_bad, v_bad)
  np.testing.assert_array_equal(np.asarray(bad[:, :32]), np.asarray(clean[:, :32]))
  assert bool(jnp.isnan(tf.dense_attention_causal_reference(q, k_bad, v_bad,
                                                            query_chunk=16)[:, :32]).any())
  # dQ of the first 32 positions is computed from their chunks' keys only, too. (dK / dV of
  # early keys do get terms from later queries, which attend to them.)
  loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)[:, :32]))
  dq_clean = jax.grad(loss)(q, k, v)
  dq_bad = jax.grad(loss)(q, k_bad, v_bad)
  np.testing.assert_array_equal(np.asarray(dq_bad[:, :32]), np.asarray(dq_clean[:, :32]))


def test_no_array_of_a_full_key_chunk_is_built():
  """The compiled forward and backward hold no float32 array as large as one chunk's logits
  against all T keys (B * H * C * T), let alone [T, T]."""
  b, t, h, kvh, d, c = 1, 256, 4, 2, 16, 32
  q, k, v = qkv(np.random.default_rng(3), b, t, h, kvh, d)
  fn = lambda q, k, v: flash_xla.flash_attention_causal(q, k, v, block=c)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)
  limit = b * h * c * t
  for f in (fn, jax.grad(loss, argnums=(0, 1, 2))):
    hlo = jax.jit(f).lower(q, k, v).compile().as_text()
    sizes = [int(np.prod([int(x) for x in dims.split(",") if x]))
             for dims in re.findall(r"f32\[([0-9,]*)\]", hlo)]
    assert max(sizes) < limit, (max(sizes), limit)
  # The previous full-key chunks do build them (the check can fail).
  ref = jax.jit(lambda q, k, v: tf.dense_attention_causal_reference(q, k, v, query_chunk=c))
  hlo = ref.lower(q, k, v).compile().as_text()
  sizes = [int(np.prod([int(x) for x in dims.split(",") if x]))
           for dims in re.findall(r"f32\[([0-9,]*)\]", hlo)]
  assert max(sizes) >= limit


@pytest.mark.parametrize("kind,prompt", [("mean", False), ("quest", True)])
def test_sparse_pages_equal_full_key_reference_values_and_gradients(kind, prompt):
  rng = np.random.default_rng(4)
  b, t, h, kvh, d = 2, 75, 4, 2, 16
  q, k, v = qkv(rng, b, t, h, kvh, d)
  budget = jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
  kw = dict(kind=kind, max_budget=2, page_size=4, reserved_bos=1, reserved_recent=1,
            lengths=jnp.asarray([75, 60]),
            prompt_lengths=jnp.asarray([20, 9]) if prompt else None)
  new = lambda q, k, v: tf.sparse_attention_teacher_forced(q, k, v, budget, query_chunk=16,
                                                           **kw)
  old = lambda q, k, v: tf.sparse_attention_teacher_forced_reference(q, k, v, budget,
                                                                     query_chunk=16, **kw)
  dout = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  got = loss_and_grads(jax.jit(new), q, k, v, dout)
  want = loss_and_grads(jax.jit(old), q, k, v, dout)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  dense = tf.dense_attention_causal(q, k, v)
  assert float(jnp.abs(got[0] - dense).max()) > 1e-2, "selection should be sparse here"


def test_sparse_mask_matches_float64_with_explicit_pages():
  """A hand-built page selection: each query attends page 0 and its own page only."""
  rng = np.random.default_rng(5)
  b, t, h, kvh, d, s = 1, 40, 2, 2, 8, 4
  q, k, v = qkv(rng, b, t, h, kvh, d)
  own = jnp.arange(t) // s
  page_idx = jnp.stack([jnp.zeros_like(own), own], -1)[None, :, None, :]  # [1, T, 1, 2]
  page_idx = jnp.broadcast_to(page_idx, (b, t, kvh, 2)).astype(jnp.int32)
  valid = jnp.ones(page_idx.shape, bool)
  dout = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  fn = lambda q, k, v: flash_xla.flash_attention_causal(q, k, v, block=8, page_idx=page_idx,
                                                        valid=valid, page_size=s)
  got = loss_and_grads(fn, q, k, v, dout)
  key_page = np.arange(t) // s
  allowed = (key_page[None, :] == 0) | (key_page[None, :] == np.asarray(own)[:, None])
  allowed = np.broadcast_to(allowed[None, :, None, :], (b, t, kvh, t))
  want = attention_f64(q, k, v, dout, allowed)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-5, err_msg=name)


def test_validation_errors():
  q, k, v = qkv(np.random.default_rng(6), 1, 8, 4, 2, 8)
  with pytest.raises(ValueError, match="block=0"):
    flash_xla.flash_attention_causal(q, k, v, block=0)
  with pytest.raises(ValueError, match="k.shape"):
    flash_xla.flash_attention_causal(q, k[:, :4], v, block=8)
  with pytest.raises(ValueError, match="page_size=3"):
    flash_xla.flash_attention_causal(q, k, v, page_idx=jnp.zeros((1, 8, 2, 1), jnp.int32),
                                     valid=jnp.ones((1, 8, 2, 1), bool), page_size=3)
  with pytest.raises(ValueError, match="page_idx.shape"):
    flash_xla.flash_attention_causal(q, k, v, page_idx=jnp.zeros((1, 8, 3, 1), jnp.int32),
                                     valid=jnp.ones((1, 8, 3, 1), bool), page_size=4)
