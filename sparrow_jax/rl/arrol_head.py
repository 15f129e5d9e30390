"""Training of ARRoL's quality head (`models/quality_head.py`): the mean binary cross-entropy of
the head logit against label = reward > 0, minimised by optax's Adam (lr `head_lr`, 0.01, as
in the authors' code) on the detection-point hidden states of one step's rollouts.

The head's parameters are the dict pytree of `quality_head` (w1_DW [D, W], b1_W [W], w2_W [W],
b2 []) and its optimizer state is `optax.adam(lr).init(params)`:
(ScaleByAdamState(count [] int32, mu, nu: like params), EmptyState()). Both are what a
checkpoint holds (`ArrolPruner.state_dict`, the trainer's "arrol" entry); `restore_head`
takes them back, also in the plain dicts and lists an orbax restore without a template
returns, and checks every leaf's shape and dtype against the live ones.

Rows are padded to a power of two (at least 8) with weight 0, so the jitted step compiles a
few shapes only and padding never changes the loss or the update.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.args import pow2_bucket
from sparrow_jax.models.quality_head import (QualityHeadParams, check_quality_head,
                                             init_quality_head, quality_logits)

MIN_ROWS = 8  # smallest padded batch of the jitted step


@functools.lru_cache(maxsize=None)
def adam(lr: float) -> optax.GradientTransformation:
  """The head's optimizer (one object per learning rate: the jitted step is keyed on it)."""
  return optax.adam(lr)


def _bce_step(tx: optax.GradientTransformation, params, opt_state, hidden_ND, labels_N,
              weight_N):
  """One Adam step on the mean BCE over rows with weight 1 (padding rows have weight 0);
  returns the loss and logits from before the step."""

  def loss_fn(p):
    logits = quality_logits(p, hidden_ND)  # [N]
    per = optax.sigmoid_binary_cross_entropy(logits, labels_N)  # [N] float32
    return jnp.sum(per * weight_N) / jnp.maximum(jnp.sum(weight_N), 1.0), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, logits


# Module-level jits, keyed on the (cached, hence identical) optimizer: every pruner with the
# same head_lr shares compiled programs instead of compiling its own.
_jit_logits = jax.jit(quality_logits)
_jit_bce_step = jax.jit(_bce_step, static_argnums=0)


@functools.lru_cache(maxsize=None)
def _init_program(hidden_size: int, width: int, lr: float):
  def init(key):  # one compiled program instead of a dozen eager ones
    params = init_quality_head(key, hidden_size, width)
    return params, adam(lr).init(params)
  return jax.jit(init)


def init_head(hidden_size: int, width: int, lr: float, seed: int):
  """(params, opt_state) of a fresh head (torch `nn.Linear` init from `seed`) and its Adam."""
  return _init_program(int(hidden_size), int(width), float(lr))(jax.random.key(int(seed)))


def head_logits(params: QualityHeadParams, hidden) -> np.ndarray:
  """float32 `[...]` head logits of final-normed hidden states `[..., D]` (host copy)."""
  return np.asarray(_jit_logits(params, jnp.asarray(hidden)))


def train_head(params: QualityHeadParams, opt_state, hidden: np.ndarray, labels: np.ndarray, *,
               lr: float, steps: int = 1):
  """`steps` Adam steps of the mean BCE on `hidden` `[N, D]` against bool `labels` `[N]`
  (N >= 1; shapes checked by the caller).

  Returns (params, opt_state, loss, logits): the new head and optimizer state, the mean BCE
  and the float64 `[N]` logits from BEFORE the first step (out-of-sample scores).
  """
  n, d = hidden.shape
  rows = pow2_bucket(n, MIN_ROWS)
  h_pad = np.zeros((rows, d), np.float32)  # [rows, D]
  h_pad[:n] = hidden
  y_pad = np.zeros(rows, np.float32)  # [rows]
  y_pad[:n] = labels
  w_pad = (np.arange(rows) < n).astype(np.float32)  # [rows]
  tx = adam(float(lr))
  loss0, before = None, None
  for _ in range(steps):
    params, opt_state, loss, lg = _jit_bce_step(tx, params, opt_state, h_pad, y_pad, w_pad)
    if before is None:
      loss0, before = float(loss), np.asarray(lg)[:n].astype(np.float64)
  return params, opt_state, loss0, before


def head_state(params: QualityHeadParams, opt_state) -> dict[str, Any]:
  """Host (numpy) copies of the head and its Adam state, in the checkpoint layout."""
  return {"params": {k: np.asarray(v) for k, v in params.items()},
          "opt_state": jax.tree.map(np.asarray, opt_state)}


def restore_head(live_params: QualityHeadParams, live_opt_state, params: Mapping[str, Any],
                 opt_state, hidden_size: int):
  """(params, opt_state) from a checkpoint, as device arrays in the live pytree structure.

  `opt_state` may be optax's named tuples or the dicts and lists an orbax restore gives
  without a template: its leaves are matched in order (count, mu, nu; each of mu and nu in
  the sorted key order of the params) and checked for shape and dtype against the live
  state, as the params are against the live head.
  """
  params = {k: np.asarray(v) for k, v in dict(params).items()}
  check_quality_head(params, hidden_size)
  ref = jax.tree.leaves(live_opt_state)
  got = jax.tree.leaves(opt_state)
  if len(ref) != len(got):
    raise ValueError(f"ArrolPruner.load_state_dict: opt_state has {len(got)} leaves: "
                     f"expected {len(ref)} (Adam on the head)")
  for i, (r, g) in enumerate(zip(ref, got)):
    if np.shape(r) != np.shape(g) or np.asarray(g).dtype != r.dtype:
      raise ValueError(f"ArrolPruner.load_state_dict: opt_state leaf {i} is "
                       f"{np.asarray(g).dtype}{list(np.shape(g))}: expected "
                       f"{r.dtype}{list(np.shape(r))}")
  for k, v in params.items():
    if v.dtype != live_params[k].dtype:
      raise ValueError(f"ArrolPruner.load_state_dict: params {k} dtype {v.dtype}: expected "
                       f"{live_params[k].dtype}")
  return ({k: jnp.asarray(v) for k, v in params.items()},
          jax.tree.unflatten(jax.tree.structure(live_opt_state), [jnp.asarray(g) for g in got]))
