"""The jitted programs of one RL step, built once from the graphdef and the config.

Each program works on one micro-batch (`run/microbatch.py` drives them) and takes only pytrees
and arrays, so the trainer runs them on real arrays and the compile plan (`run/compile_plan.py`)
lowers the very same functions on abstract ones (`jax.ShapeDtypeStruct` with shardings) to read
XLA's memory analysis at the preset's real shapes.

  logprobs        (params, mb) -> old / reference log-probs [R, L] (+ the dense top-k of the
                  mismatch monitor): the no-grad recompute.
  grad_step       (params, acc, mb, den) -> (acc + grads, loss, metrics, n_tokens, aux): one
                  micro-batch of the GRPO loss with the mini-batch's denominators `den`;
                  `acc` (donated) accumulates the gradient. With `skip_recompute` the old
                  log-probs are the forward's own under stop_gradient (ratio exactly 1) and
                  `aux` returns them with the monitor's dense top-k.
  apply           (params, opt_state, grads, loss) -> (params, opt_state, ok, grad_norm): the
                  guarded optimizer step (non-finite loss or gradient: nothing changes).
  distill_grad    (lora, acc, params, mb, den) -> (acc + grads, metrics): DistillSparse's
                  LoRA-only gradient of one micro-batch (sparse teacher-forced forward, remat).
  distill_apply   (lora, opt_state, grads, loss, max_gap) -> (lora, opt_state, metrics).
  zeros           a zero tree like its argument, with the same shardings (accumulators).

Micro-batch keys (host arrays gathered by the driver): tokens [R, L], lengths [R], mask
[R, L], old_logp [R, L], advantages [R], rollout_logp [R, L], ref_logp [R, L],
prompt_lens [R], budgets [R, L]. With `prompt_lens` in its micro-batch, `logprobs` and
`grad_step` run the LM head over each row's response window only (`max_new_tokens` from
its prompt length; log-probs elsewhere are 0): everything a step reads from them (the GRPO
loss, the monitor, DistillSparse's teacher, the KL reference) is masked to responses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparrow_jax.models.sharding_hints import hinted
from sparrow_jax.models.lora import lora_norms
from sparrow_jax.rl import distill as distill_lib
from sparrow_jax.rl import grpo
from sparrow_jax.rl.logprobs import token_logprobs


class Counter:
  """Counts traces (= compilations) of the programs that share it."""

  def __init__(self):
    self.n = 0

  def __call__(self):
    self.n += 1


def guarded_apply(tx, params, opt_state, grads, loss, allow=True):
  """Apply the update only when loss and gradients are finite and `allow` holds (else keep
  everything)."""
  gnorm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & allow
  updates, new_opt = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state), ok, gnorm


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _window(mb, response_window: int | None):
  """The LM head's window over a micro-batch's responses (`logits_to_stats`): tokens from
  each row's prompt length on, `response_window` (the longest response a run can have)
  wide; None (every position) without one or when the micro-batch has no prompt lengths."""
  if not response_window or "prompt_lens" not in mb:
    return None
  return mb["prompt_lens"], int(response_window)


def make_logprobs(graphdef, *, chunk: int, temperature: float, topk: int,
                  response_window: int | None = None,
                  count: Callable[[], None] = lambda: None, hints=(None, ())):
  """The no-grad recompute of one micro-batch: {"logp"} (+ {"topk_ids", "topk_logp"}),
  over the responses' window only when the micro-batch carries prompt lengths."""

  def fn(params, mb):
    count()
    st = token_logprobs(nnx.merge(graphdef, params), mb["tokens"], lengths=mb["lengths"],
                        chunk=chunk, topk=topk, temperature=temperature,
                        window=_window(mb, response_window))
    out = {"logp": st.logp}  # [R, L]
    if topk:
      out.update(topk_ids=st.topk_ids, topk_logp=st.topk_logp)  # [R, L, k]
    return out

  return jax.jit(hinted(fn, *hints))


def make_grad_step(graphdef, loss_cfg: grpo.GRPOLossConfig, *, chunk: int, temperature: float,
                   remat: bool, with_entropy: bool, skip_recompute: bool, topk: int,
                   response_window: int | None = None,
                   count: Callable[[], None] = lambda: None, hints=(None, ())):
  """One micro-batch of the GRPO loss; see the module docstring."""
  bypass = loss_cfg.rollout_mode == "bypass"

  def loss_fn(params, mb, den):
    model = nnx.merge(graphdef, params)
    st = token_logprobs(model, mb["tokens"], lengths=mb["lengths"], chunk=chunk,
                        with_entropy=with_entropy, remat=remat, temperature=temperature,
                        topk=topk if skip_recompute else 0,
                        window=_window(mb, response_window))
    # The PPO clip's old policy: the recompute's, or this forward's own when the recompute is
    # skipped (ratio exactly 1); in bypass mode the rollout actor's (old = rollout).
    old = (mb["old_logp"] if bypass or not skip_recompute
           else jax.lax.stop_gradient(st.logp))
    loss, metrics = grpo.grpo_loss(st.logp, old, mb["advantages"], mb["mask"], loss_cfg,
                                   ref_logp=mb.get("ref_logp"),
                                   rollout_logp=mb.get("rollout_logp"), entropy=st.entropy,
                                   **den)
    aux = {}
    if skip_recompute:  # the dense policy's own log-probs (the monitor reads them)
      aux = {"old_logp": jax.lax.stop_gradient(st.logp)}
      if topk:
        aux.update(dense_topk_ids=st.topk_ids,
                   dense_topk_logp=jax.lax.stop_gradient(st.topk_logp))
    return loss, (metrics, aux)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def fn(params, acc, mb, den):
    count()
    (loss, (metrics, aux)), grads = grad_fn(params, mb, den)
    acc = jax.tree.map(jnp.add, acc, grads)
    n_in = jnp.sum(mb["mask"].astype(jnp.float32))  # the input mask's tokens
    return acc, loss, metrics, n_in, aux

  return jax.jit(hinted(fn, *hints), donate_argnums=(1,))


def make_apply(tx, count: Callable[[], None] = lambda: None, out_shardings=None,
               hints=(None, ())):
  """The guarded optimizer step. `out_shardings` (params, optimizer state, ok, grad norm):
  the updated state keeps the layout it came in, so the next step's programs see the same
  input shardings and are not compiled again (left to XLA, the first update's outputs can
  come out laid out differently from the initial state)."""
  def fn(params, opt_state, grads, loss):
    count()
    return guarded_apply(tx, params, opt_state, grads, loss)

  if out_shardings is None:
    return jax.jit(hinted(fn, *hints), donate_argnums=(0, 1))
  return jax.jit(hinted(fn, *hints), donate_argnums=(0, 1), out_shardings=out_shardings)


def make_zeros():
  """`zeros(tree)`: zeros shaped, typed and sharded like `tree` (jit keeps the input
  shardings for outputs of the same shape)."""
  return jax.jit(_zeros)


# --- DistillSparse ---------------------------------------------------------------------------

def make_distill_grad(graphdef, attention, dcfg: distill_lib.DistillConfig,
                      count: Callable[[], None] = lambda: None, hints=(None, ()),
                      response_window: int | None = None):
  """DistillSparse's gradient of one micro-batch w.r.t. the LoRA only; `den` carries the
  step batch's token count so micro-batch losses sum to the one-piece loss. With kind "k3"
  the LM head runs over the responses' window only, as in `make_grad_step`."""
  win = response_window if dcfg.kind == "k3" else None

  def loss_fn(lora, params, mb, den):
    return distill_lib.distill_loss(
        lora, graphdef, params, mb["tokens"], mb["mask"], mb["old_logp"],
        attention=attention, budgets=mb["budgets"], prompt_lengths=mb.get("prompt_lens"),
        lengths=mb.get("lengths"), kind=dcfg.kind, coef=dcfg.coef, pg_coef=dcfg.pg_coef,
        advantages=mb.get("advantages"), rollout_logp=mb.get("rollout_logp"),
        tis_cap=dcfg.tis_cap, temperature=dcfg.temperature, logprob_chunk=dcfg.logprob_chunk,
        num_tokens=den["num_tokens"], remat=True, window=_window(mb, win))

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def fn(lora, acc, params, mb, den):
    count()
    (loss, metrics), grads = grad_fn(lora, params, mb, den)
    return jax.tree.map(jnp.add, acc, grads), loss, metrics

  return jax.jit(hinted(fn, *hints), donate_argnums=(1,))


def make_distill_apply(tx, count: Callable[[], None] = lambda: None, hints=(None, ()),
                       min_gap: float = 0.0):
  """The LoRA's guarded step; `max_gap` (the batch's largest |teacher - actor| log-prob gap)
  below `min_gap` keeps the LoRA and its optimizer state as they are (`no_gap` = 1: nothing
  to distill, the gradient is rounding noise; `DistillConfig.min_gap`)."""
  def fn(lora, opt_state, grads, loss, max_gap):
    count()
    no_gap = max_gap < min_gap
    new_lora, new_opt, ok, gnorm = guarded_apply(tx, lora, opt_state, grads, loss, ~no_gap)
    metrics = dict(grad_norm=gnorm, skipped=(~ok & ~no_gap).astype(jnp.float32),
                   no_gap=no_gap.astype(jnp.float32), **lora_norms(new_lora))
    return new_lora, new_opt, metrics

  return jax.jit(hinted(fn, *hints), donate_argnums=(0, 1))


@dataclasses.dataclass
class Programs:
  """The step's programs (see the module docstring); `count.n` = traces so far."""

  logprobs: Any  # policy: with the monitor's top-k
  ref_logprobs: Any  # reference: log-probs only
  grad_step: Any
  apply: Any
  zeros: Any
  count: Counter
  skip_recompute: bool
  distill_grad: Any = None
  distill_apply: Any = None


def build_programs(graphdef, cfg, *, loss_cfg: grpo.GRPOLossConfig, tx, temperature: float,
                   skip_recompute: bool, attention=None, lora_tx=None,
                   dcfg: distill_lib.DistillConfig | None = None,
                   apply_shardings=None, mesh=None,
                   batch_axes: tuple[str, ...] = ()) -> Programs:
  """All programs of a `TrainConfig` (`attention`, `lora_tx`, `dcfg`: DistillSparse's;
  `apply_shardings`: the update's output shardings, see `make_apply`).
  `mesh`, `batch_axes`: the programs trace under `sharding_hints.batch_sharding`, so the
  model keeps its activations batch-sharded (FSDP all-gathers the weights instead)."""
  count = Counter()
  hints = (mesh, tuple(batch_axes))
  chunk, topk = cfg.logprob_chunk, cfg.monitor_topk
  # Responses are at most max_new_tokens long: the log-probs the step uses lie in that window.
  win = cfg.max_new_tokens
  progs = Programs(
      logprobs=make_logprobs(graphdef, chunk=chunk, temperature=temperature, topk=topk,
                             response_window=win, count=count, hints=hints),
      ref_logprobs=make_logprobs(graphdef, chunk=chunk, temperature=temperature, topk=0,
                                 response_window=win, count=count, hints=hints),
      grad_step=make_grad_step(graphdef, loss_cfg, chunk=chunk, temperature=temperature,
                               remat=cfg.remat, with_entropy=cfg.entropy_coeff > 0,
                               skip_recompute=skip_recompute, topk=topk,
                               response_window=win, count=count, hints=hints),
      apply=make_apply(tx, count, apply_shardings, hints=hints), zeros=make_zeros(),
      count=count,
      skip_recompute=skip_recompute)
  if dcfg is not None:
    progs.distill_grad = make_distill_grad(graphdef, attention, dcfg, count, hints=hints,
                                           response_window=win)
    progs.distill_apply = make_distill_apply(lora_tx, count, hints=hints,
                                             min_gap=dcfg.skip_below_gap)
  return progs
