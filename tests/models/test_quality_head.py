"""ARRoL quality head: float64 numpy reference, no gradient into the hidden state, init."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.quality_head import (check_quality_head, init_quality_head,
                                             quality_logits, quality_score)


def _numpy_mlp(params, hidden):
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  z = np.maximum(np.asarray(hidden, np.float64) @ p["w1_DW"] + p["b1_W"], 0.0)
  return z @ p["w2_W"] + p["b2"]


def test_init_shapes_and_torch_linear_bounds():
  d, w = 48, 32
  params = init_quality_head(jax.random.key(0), d, w)
  assert check_quality_head(params, d) == (d, w)
  chex.assert_shape([params["w1_DW"], params["b1_W"], params["w2_W"], params["b2"]],
                    [(d, w), (w,), (w,), ()])
  for name, fan_in in (("w1_DW", d), ("b1_W", d), ("w2_W", w), ("b2", w)):
    v = np.asarray(params[name])
    assert v.dtype == np.float32
    assert np.all(np.abs(v) <= fan_in ** -0.5), name
  # Uniform, not a constant: the first layer spans most of its bound.
  assert np.abs(params["w1_DW"]).max() > 0.9 * d ** -0.5
  bf = init_quality_head(jax.random.key(0), d, w, dtype=jnp.bfloat16)
  assert bf["w1_DW"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="hidden_size=0"):
    init_quality_head(jax.random.key(0), 0)


@pytest.mark.parametrize("jit,shape", [(False, (5,)), (True, (2, 3))])
def test_logits_match_float64_reference(jit, shape):
  d = 24
  params = init_quality_head(jax.random.key(1), d, 16)
  hidden = jax.random.normal(jax.random.key(2), (*shape, d), jnp.float32) * 2.0
  fn = jax.jit(quality_logits) if jit else quality_logits
  out = fn(params, hidden)
  assert out.dtype == jnp.float32 and out.shape == shape
  np.testing.assert_allclose(np.asarray(out), _numpy_mlp(params, hidden), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(quality_score(params, hidden)),
                             1 / (1 + np.exp(-_numpy_mlp(params, hidden))), rtol=1e-5, atol=1e-6)


def test_bf16_hidden_and_params_compute_in_float32():
  d = 16
  params = init_quality_head(jax.random.key(3), d, 8, dtype=jnp.bfloat16)
  hidden = jax.random.normal(jax.random.key(4), (4, d)).astype(jnp.bfloat16)
  out = jax.jit(quality_logits)(params, hidden)
  assert out.dtype == jnp.float32
  # The reference sees the same bf16 values, upcast: only float32 rounding separates them.
  np.testing.assert_allclose(np.asarray(out), _numpy_mlp(params, hidden.astype(jnp.float32)),
                             rtol=1e-5, atol=1e-5)


def test_no_gradient_reaches_the_hidden_state():
  d = 12
  params = init_quality_head(jax.random.key(5), d, 8)
  hidden = jax.random.normal(jax.random.key(6), (3, d))

  def loss(p, h):
    return jnp.sum(quality_logits(p, h) ** 2)

  g_params, g_hidden = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, hidden)
  assert np.all(np.asarray(g_hidden) == 0.0)
  # ...while the head's own parameters do get a gradient (the test could fail).
  assert float(jnp.abs(g_params["w1_DW"]).sum()) > 0 and float(jnp.abs(g_params["b2"])) > 0


def test_bad_params_and_hidden_are_named():
  params = init_quality_head(jax.random.key(0), 8, 4)
  with pytest.raises(ValueError, match="expected D=8"):
    quality_logits(params, jnp.zeros((2, 9)))
  bad = dict(params)
  bad.pop("b2")
  with pytest.raises(ValueError, match="keys="):
    check_quality_head(bad)
  bad = dict(params, b1_W=jnp.zeros(5))
  with pytest.raises(ValueError, match="b1_W shape"):
    check_quality_head(bad)
  with pytest.raises(ValueError, match="expected hidden_size=16"):
    check_quality_head(params, 16)
