"""ARRoL quality head: a two-layer MLP that scores a partial rollout from one hidden state.

The head of "Prune as You Generate" (ARRoL, Sec. 4.2): `Linear(D, W) -> ReLU -> Linear(W, 1)`
on the last-layer hidden state of a partial rollout at its detection point (the last stop
token at or before L_detect). It lives with the models, not in rl/, because the engine (which
sits below rl/) evaluates it inside the decode step on the hidden state it already has.

Paper symbols and the names that carry them:
  s_i      uncalibrated quality score of rollout i: `quality_logits` (a logit);
           `quality_score = sigmoid(s_i)` in [0, 1] is what the calibrator bins (Appendix A.4).
  D, W     hidden size of the policy and width of the head (128 in the paper and the
           authors' code).

Parameters are a plain dict pytree (so the head has its own optimizer state and checkpoint
entry, independent of the policy and the LoRA tree):
  w1_DW [D, W], b1_W [W], w2_W [W], b2 []   (axis letters: D hidden, W head width)

Initialisation follows torch's `nn.Linear` default (the authors' head is a torch module):
weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = D for the first layer and
W for the second.

The input must ALREADY be final-normed (after the decoder's final RMSNorm, the vector the LM
head multiplies). The hidden input is wrapped in `lax.stop_gradient`, so training the head
can never send a gradient into the policy, and all math is float32 whatever the dtype of the
hidden state (bf16 activations) or of the head parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

QualityHeadParams = dict[str, jax.Array]

PARAM_SHAPES_DOC = "w1_DW [D, W], b1_W [W], w2_W [W], b2 []"


def init_quality_head(key: jax.Array, hidden_size: int, width: int = 128,
                      dtype: Any = jnp.float32) -> QualityHeadParams:
  """Fresh head parameters, torch `nn.Linear` default init (see module docstring).

  Args:
    key: a jax PRNG key (`jax.random.key` or `PRNGKey`).
    hidden_size: D, the policy's hidden size.
    width: W, the hidden width of the head (128 in the paper).
    dtype: parameter dtype (float32 by default; the forward pass computes in float32 anyway).
  """
  for name, v in (("hidden_size", hidden_size), ("width", width)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"quality head {name}={v!r}: expected a positive int")
  d, w = hidden_size, width
  # One draw for all four tensors (one small compiled program, not four), then split.
  u = jax.random.uniform(key, (d * w + 2 * w + 1,), jnp.float32, -1.0, 1.0)  # [D W + 2 W + 1]
  b_in = 1.0 / float(d) ** 0.5
  b_out = 1.0 / float(w) ** 0.5
  return {"w1_DW": (u[:d * w].reshape(d, w) * b_in).astype(dtype),  # [D, W]
          "b1_W": (u[d * w:d * w + w] * b_in).astype(dtype),  # [W]
          "w2_W": (u[d * w + w:d * w + 2 * w] * b_out).astype(dtype),  # [W]
          "b2": (u[-1] * b_out).astype(dtype)}  # []


def check_quality_head(params: QualityHeadParams,
                       hidden_size: int | None = None) -> tuple[int, int]:
  """(D, W) of a head pytree; ValueError when a key is missing/extra or shapes disagree."""
  want = {"w1_DW", "b1_W", "w2_W", "b2"}
  if not isinstance(params, dict) or set(params) != want:
    got = sorted(params) if isinstance(params, dict) else type(params).__name__
    raise ValueError(f"quality head params keys={got}: expected {sorted(want)} "
                     f"({PARAM_SHAPES_DOC})")
  w1 = jnp.shape(params["w1_DW"])
  if len(w1) != 2:
    raise ValueError(f"quality head w1_DW shape={w1}: expected [D, W]")
  d, w = w1
  for name, shape in (("b1_W", (w,)), ("w2_W", (w,)), ("b2", ())):
    if tuple(jnp.shape(params[name])) != shape:
      raise ValueError(f"quality head {name} shape={tuple(jnp.shape(params[name]))}: "
                       f"expected {shape} ({PARAM_SHAPES_DOC})")
  if hidden_size is not None and d != hidden_size:
    raise ValueError(f"quality head w1_DW has D={d}: expected hidden_size={hidden_size}")
  return int(d), int(w)


def quality_logits(params: QualityHeadParams, hidden: jax.Array) -> jax.Array:
  """Head logits s = w2 . relu(h W1 + b1) + b2 for final-normed hidden states.

  Args:
    params: head parameters (see module docstring).
    hidden: `[..., D]` final-normed hidden states, any float dtype. No gradient flows into it.

  Returns:
    float32 `[...]` logits (the leading axes of `hidden`).
  """
  h = jax.lax.stop_gradient(hidden).astype(jnp.float32)  # [..., D]
  if h.shape[-1:] != params["w1_DW"].shape[:1]:
    raise ValueError(f"quality head: hidden has D={h.shape[-1:]} (shape {h.shape}): expected "
                     f"D={params['w1_DW'].shape[0]} to match w1_DW")
  w1 = params["w1_DW"].astype(jnp.float32)
  z = jnp.einsum("...D,DW->...W", h, w1) + params["b1_W"].astype(jnp.float32)  # [..., W]
  z = jax.nn.relu(z)
  return (jnp.einsum("...W,W->...", z, params["w2_W"].astype(jnp.float32))
          + params["b2"].astype(jnp.float32))  # [...]


def quality_score(params: QualityHeadParams, hidden: jax.Array) -> jax.Array:
  """sigmoid(quality_logits): the score in [0, 1] that the calibrator bins; float32 `[...]`."""
  return jax.nn.sigmoid(quality_logits(params, hidden))
