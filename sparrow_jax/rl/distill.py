"""DistillSparse (paper §4.5, Algorithm 1 step 7): a LoRA-only update of the sparse actor.

The sparse actor q = (policy theta, sparse attention, LoRA phi) is pulled toward the dense
policy p on the step's own rollout tokens, through the teacher-forced block-sparse forward
(`Decoder.__call__(attention=BlockSparse(...))`, which at position t selects pages exactly as
decode did at step t). The teacher log-probs are the old dense log-probs the GRPO step computes
anyway, so distillation costs one sparse forward and backward. Gradients flow into phi only:
theta enters as a non-differentiated argument (`stop_gradient`), and the dense recompute / GRPO
update never receive phi.

When: the trainer distils *before* the GRPO update of the step, so teacher and student share
the policy theta_k that generated the rollout (teacher dense(theta_k), student sparse(theta_k)
+ phi). The authors' release distils after the update against the same pre-update teacher,
i.e. student sparse(theta_k+1) + phi against dense(theta_k): the LoRA then also learns to undo
the policy step. Distilling first costs nothing extra (the teacher is the recompute's output)
and keeps the objective exactly the mismatch the next rollout's LoRA should remove, up to the
one policy step that every on-policy correction lags by.

Symbols and names:
  q_t, p_t        sparse+LoRA and dense next-token distributions of token t.
  k3              "low_var_kl" on the sampled tokens (the release's estimator):
                  exp(log p - log q) - (log p - log q) - 1, an estimate of KL(q || p) since the
                  tokens were sampled by the sparse actor (`kind="k3"`).
  reverse KL      exact KL(q_t || p_t) = sum_v q_t(v) (log q_t(v) - log p_t(v)) over the full
                  vocabulary (`kind="reverse_kl_full"`). Needs dense logits [B, T, V]: pass
                  `dense_logits` (e.g. kept from the recompute) or they are recomputed here
                  with dense attention and no LoRA. Memory: on top of the sparse logits that
                  the backward keeps, about 4 float32 [B, T, V] arrays (dense logits, two
                  log-softmaxes, the product), B*T*V*16 bytes; at Qwen3's V = 151,936 that is
                  ~9.7 GB per 4K tokens, so use it on small batches or short sequences.
  coef            weight of the KL term (the release: 0.001 beside a policy-gradient weight 1;
                  with the KL term alone Adam makes the weight nearly irrelevant).
  pg term         optional truncated-IS policy gradient for the sparse actor itself:
                  l_t = -A_t * sg(min(rho_t, C)) * log q_t(x_t), rho_t = exp(log q_t(x_t) -
                  rollout_logp_t) (q now vs the actor that sampled), C = `tis_cap`
                  (`pg_coef`, `advantages`, `rollout_logp`).

Alignment: per-token arrays are [B, T] aligned with `tokens`; entry t belongs to token t,
predicted by the logits at t - 1 (as `rl/logprobs.py`). Entry 0 has no prediction, so the mask is
zeroed there. `mask` marks the response tokens; aggregation is the token mean over them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.lora import lora_norms
from sparrow_jax.rl import grpo
from sparrow_jax.rl.logprobs import logits_to_stats

KINDS = ("k3", "low_var_kl", "reverse_kl_full")
_LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------- pieces


def logprobs_from_logits(logits: jax.Array, tokens: jax.Array,
                         temperature: float = 1.0) -> jax.Array:
  """log softmax(logits[:, t-1] / temperature)[tokens[:, t]] -> [B, T] (entry 0 is 0).

  logits [B, T, V] (any float dtype, computed in float32), tokens [B, T] int.
  """
  if logits.ndim != 3 or logits.shape[:2] != tokens.shape:
    raise ValueError(f"logprobs_from_logits: logits {logits.shape}, tokens {tokens.shape}; "
                     "expected [B, T, V] and [B, T]")
  x = logits[:, :-1].astype(jnp.float32) / temperature  # [B, T-1, V]
  picked = jnp.take_along_axis(x, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
  lp = picked - jax.nn.logsumexp(x, axis=-1)  # [B, T-1]
  return jnp.pad(lp, ((0, 0), (1, 0)))


def full_reverse_kl(q_logits: jax.Array, p_logits: jax.Array,
                    temperature: float = 1.0) -> jax.Array:
  """KL(q || p) of next-token distributions, aligned to tokens -> [B, T] (entry 0 is 0).

  q_logits (sparse+LoRA, differentiated), p_logits (dense, target): [B, T, V].
  """
  if q_logits.shape != p_logits.shape or q_logits.ndim != 3:
    raise ValueError(f"full_reverse_kl: q_logits {q_logits.shape}, p_logits {p_logits.shape}; "
                     "expected equal [B, T, V] shapes")
  lq = jax.nn.log_softmax(q_logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  lp = jax.nn.log_softmax(jax.lax.stop_gradient(p_logits[:, :-1]).astype(jnp.float32)
                          / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(lq) * (lq - lp), axis=-1)  # [B, T-1]
  return jnp.pad(kl, ((0, 0), (1, 0)))


def actor_logits(graphdef, state, lora, tokens, *, attention, budgets, prompt_lengths=None,
                 lengths=None) -> jax.Array:
  """Teacher-forced forward of the sparse actor (policy + LoRA) -> float32 logits [B, T, V]."""
  model = nnx.merge(graphdef, state)
  return model(tokens, lengths=lengths, attention=attention, budgets=budgets,
               prompt_lengths=prompt_lengths, lora=lora)


def dense_logits_of(graphdef, state, tokens, *, lengths=None) -> jax.Array:
  """Teacher-forced dense forward of the policy alone (no LoRA) -> float32 [B, T, V]."""
  model = nnx.merge(graphdef, state)
  return model(tokens, lengths=lengths, attention=attn_lib.Dense())


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"distill kind={kind!r}: expected one of {KINDS}")


# ----------------------------------------------------------------------------- the loss


def distill_loss(lora, graphdef, state, tokens, mask, old_dense_logp, *, attention, budgets,
                 prompt_lengths=None, lengths=None, kind: str = "k3", coef: float = 1.0,
                 pg_coef: float = 0.0, advantages=None, rollout_logp=None,
                 tis_cap: float | None = 2.0, dense_logits=None, temperature: float = 1.0,
                 logprob_chunk: int = 128, num_tokens=None, remat: bool = False,
                 window: tuple | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DistillSparse loss of the LoRA tree `lora` -> (scalar loss, metrics).

  Args:
    lora: adapter tree (`models/lora.py`), the only argument meant to be differentiated.
    graphdef, state: the dense policy (nnx.split); wrapped in stop_gradient.
    tokens: int32 [B, T] prompt + response tokens of the rollout.
    mask: [B, T] 1 on response tokens (entry 0 is ignored).
    old_dense_logp: [B, T] dense log-probs of the tokens before/after the GRPO update (the
      teacher; no gradient), aligned like `logprobs_from_logits`.
    attention: the `BlockSparse` spec of the rollout (static); budgets: int32 [B, T] page
      budgets per query (`schedule.teacher_forced_budgets`); prompt_lengths / lengths: as `Decoder.__call__`.
    kind: "k3" (= "low_var_kl") on sampled tokens, or "reverse_kl_full".
    coef, pg_coef: weights of the KL and policy-gradient terms.
    advantages: [B] or [B, T] (needed when pg_coef > 0); rollout_logp: [B, T] log-probs of the
      actor that sampled (None: rho = 1); tis_cap: C (None: no truncation).
    dense_logits: [B, T, V] dense logits for "reverse_kl_full" (recomputed when None).
    temperature: the sampling temperature of the rollout (divides both logits).
    logprob_chunk: with kind "k3" the LM head runs in chunks of this many positions under
      `jax.checkpoint` (`rl/logprobs.py`), so [B, T, V] logits never exist; "reverse_kl_full"
      materialises the sparse logits [B, T, V].
    num_tokens: the token count of the whole batch when this is one of its micro-batches
      (the token means then divide by it, so micro-batch losses and gradients sum to the
      one-piece ones); None = this batch's own count.
    remat: recompute each layer in the backward pass (long sequences).
    window: (start [B] int, width: static int) with kind "k3": the LM head runs over
      tokens[b, start_b : start_b + width] only (`rl/logprobs.logits_to_stats`), as the
      GRPO update's does: the responses, not the prompts. Every token of `mask` must lie in
      it (the trainer passes the prompt lengths and max_new_tokens).
  """
  _check_kind(kind)
  if window is not None and kind != "k3":
    raise ValueError(f"distill_loss: window={window!r} with kind={kind!r}; the LM-head window "
                     "applies to kind 'k3' only ('reverse_kl_full' needs every position's "
                     "logits)")
  if tokens.ndim != 2 or mask.shape != tokens.shape or old_dense_logp.shape != tokens.shape:
    raise ValueError(f"distill_loss: tokens {tokens.shape}, mask {mask.shape}, old_dense_logp "
                     f"{old_dense_logp.shape}; expected equal [B, T] shapes")
  if pg_coef > 0 and advantages is None:
    raise ValueError(f"distill_loss: pg_coef={pg_coef} but advantages=None; expected [B] or "
                     "[B, T] advantages")
  state = jax.lax.stop_gradient(state)
  model = nnx.merge(graphdef, state)
  hidden = model.hidden_states(tokens, lengths=lengths, attention=attention, budgets=budgets,
                               prompt_lengths=prompt_lengths, lora=lora,
                               remat=remat)  # [B, T, D]
  if kind == "reverse_kl_full":
    logits = model.logits(hidden)  # [B, T, V] float32
    logp = logprobs_from_logits(logits, tokens, temperature)  # [B, T]
  else:
    logp = logits_to_stats(model, hidden, tokens, chunk=logprob_chunk,
                           temperature=temperature, window=window).logp  # [B, T]
  m = jnp.asarray(mask, jnp.float32).at[:, 0].set(0.0)  # [B, T]
  valid = m > 0
  # Masked entries may hold anything: replace them so that no NaN reaches the gradient.
  ref = jnp.where(valid, jnp.asarray(old_dense_logp, jnp.float32), jax.lax.stop_gradient(logp))
  k3 = grpo.kl_penalty(logp, ref, "low_var_kl")  # [B, T]
  mean = lambda x: grpo.aggregate_loss(x, m, "token-mean", num_tokens=num_tokens)
  gap = jax.lax.stop_gradient(ref - logp)
  metrics = {"k3": jax.lax.stop_gradient(mean(k3)),
             "logp_gap": grpo.masked_mean(gap, m),
             # The largest |teacher - actor| log-prob gap of the batch: at float rounding level
             # the actor already equals the teacher and the gradient is noise (see min_gap).
             "max_abs_gap": jnp.max(jnp.where(valid, jnp.abs(gap), 0.0)),
             "num_tokens": jnp.sum(m)}
  if kind == "reverse_kl_full":
    if dense_logits is None:
      dense_logits = dense_logits_of(graphdef, state, tokens, lengths=lengths)
    per_tok = full_reverse_kl(logits, dense_logits, temperature)  # [B, T]
    kl = mean(per_tok)
    metrics["reverse_kl_full"] = jax.lax.stop_gradient(kl)
  else:
    kl = mean(k3)
  loss = coef * kl
  if pg_coef > 0:
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, tokens.shape)  # [B, T]
    if rollout_logp is None:
      rho = jnp.ones_like(logp)
    else:
      behaviour = jnp.where(valid, jnp.asarray(rollout_logp, jnp.float32), logp)
      rho = jnp.exp(jnp.clip(logp - jax.lax.stop_gradient(behaviour), -_LOG_RATIO_CLAMP,
                             _LOG_RATIO_CLAMP))
    rho = jax.lax.stop_gradient(rho)
    w = rho if tis_cap is None else jnp.minimum(rho, tis_cap)
    pg = mean(-adv * w * logp)
    loss = loss + pg_coef * pg
    metrics.update(pg_loss=jax.lax.stop_gradient(pg), is_ratio_mean=grpo.masked_mean(rho, m),
                   is_frac_truncated=grpo.masked_mean(
                       rho > (jnp.inf if tis_cap is None else tis_cap), m))
  metrics["loss"] = jax.lax.stop_gradient(loss)
  return loss, metrics


# ----------------------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  """Knobs of the LoRA-only update (hashable; static under jit)."""

  kind: str = "k3"
  coef: float = 1.0
  pg_coef: float = 0.0
  tis_cap: float | None = 2.0
  temperature: float = 1.0
  logprob_chunk: int = 128
  # Skip the LoRA step when the batch's largest |teacher - actor| log-prob gap is below this:
  # the sparse actor then equals the dense teacher up to float rounding (e.g. every page is
  # selected at short lengths), its gradient is rounding noise, and Adam, which normalises the
  # gradient's size away, would turn that noise into full-size steps that move the actor off
  # the policy. 0 = never skip. Only the KL terms are judged: with pg_coef > 0 the policy-
  # gradient term carries the advantages' signal whatever the gap, and every batch steps.
  min_gap: float = 0.0

  @property
  def skip_below_gap(self) -> float:
    """The gap under which a batch takes no LoRA step (0 with a policy-gradient term)."""
    return self.min_gap if self.pg_coef == 0 else 0.0

  def __post_init__(self):
    _check_kind(self.kind)
    if isinstance(self.min_gap, bool) or not isinstance(self.min_gap, (int, float)) or \
        not self.min_gap >= 0:
      raise ValueError(f"DistillConfig.min_gap={self.min_gap!r}: expected a float >= 0")
    if not isinstance(self.logprob_chunk, int) or self.logprob_chunk < 1:
      raise ValueError(f"DistillConfig.logprob_chunk={self.logprob_chunk!r}: expected a "
                       "positive int")
    for f in ("coef", "pg_coef"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"DistillConfig.{f}={v!r}: expected a float >= 0")
    if self.coef == 0 and self.pg_coef == 0:
      raise ValueError("DistillConfig.coef=0 and pg_coef=0: expected at least one > 0")
    if self.tis_cap is not None and not self.tis_cap > 0:
      raise ValueError(f"DistillConfig.tis_cap={self.tis_cap!r}: expected None or > 0")
    if not self.temperature > 0:
      raise ValueError(f"DistillConfig.temperature={self.temperature!r}: expected > 0")


class DistillState(NamedTuple):
  """What DistillSparse carries across steps (a pytree; checkpoint it with the policy)."""

  lora: Any
  opt_state: Any
  step: jax.Array

  @classmethod
  def create(cls, lora, optimizer: optax.GradientTransformation) -> "DistillState":
    return cls(lora=lora, opt_state=optimizer.init(lora), step=jnp.zeros((), jnp.int32))


def default_optimizer(learning_rate: float = 1e-4, *, max_grad_norm: float | None = 1.0,
                      weight_decay: float = 0.0) -> optax.GradientTransformation:
  """AdamW with optional global-norm clipping: the LoRA's own optimizer."""
  tx = optax.adamw(learning_rate, weight_decay=weight_decay)
  return tx if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm),
                                                      tx)


_SUM_METRICS = ("loss", "k3", "pg_loss", "reverse_kl_full", "num_tokens")
_MAX_METRICS = ("max_abs_gap",)


def combine_micro_metrics(per_micro) -> dict[str, float]:
  """Batch metrics of `distill_loss` from per-micro-batch ones (host dicts of scalars,
  computed with the batch's `num_tokens`): sums for the token means and the token count,
  the maximum for `max_abs_gap`, token-weighted means for the rest (masked means over each
  micro-batch's own tokens)."""
  per_micro = list(per_micro)
  if not per_micro:
    return {}
  n = [float(m["num_tokens"]) for m in per_micro]
  total = max(sum(n), 1.0)
  out = {}
  for k in per_micro[0]:
    vals = [float(m[k]) for m in per_micro]
    if k in _SUM_METRICS:
      out[k] = sum(vals)
    elif k in _MAX_METRICS:
      out[k] = max(vals)
    else:
      out[k] = sum(v * w for v, w in zip(vals, n)) / total
  return out


BATCH_KEYS = ("tokens", "mask", "old_logp", "budgets", "prompt_lengths", "lengths",
              "advantages", "rollout_logp", "dense_logits")
_REQUIRED = ("tokens", "mask", "old_logp", "budgets")


def make_distill_step(graphdef, attention: attn_lib.AttentionSpec,
                      optimizer: optax.GradientTransformation,
                      cfg: DistillConfig = DistillConfig()):
  """Jitted `(lora, opt_state, state, batch) -> (lora, opt_state, metrics)`.

  `batch` is a dict with "tokens", "mask", "old_logp" [B, T], "budgets" int32 [B, T] and
  optionally "prompt_lengths", "lengths" [B], "advantages", "rollout_logp", "dense_logits".
  Only the LoRA tree is differentiated; `state` (the policy) is an ordinary traced argument
  that receives no gradient and is returned untouched by construction. `lora` and `opt_state`
  are donated. A non-finite loss or gradient leaves both unchanged (`distill/skipped` = 1), and
  so does a batch whose largest log-prob gap is below `cfg.min_gap` (`distill/no_gap` = 1).
  Metrics are prefixed `distill/`.
  """
  if not isinstance(cfg, DistillConfig):
    raise ValueError(f"make_distill_step: cfg={cfg!r}: expected a DistillConfig")

  def step(lora, opt_state, state, batch: Mapping[str, jax.Array]):
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    missing = [k for k in _REQUIRED if k not in batch]
    if unknown or missing:
      raise ValueError(f"distill batch: unknown keys {unknown}, missing keys {missing}; "
                       f"expected keys among {BATCH_KEYS} including {_REQUIRED}")

    def loss_fn(lr):
      return distill_loss(
          lr, graphdef, state, batch["tokens"], batch["mask"], batch["old_logp"],
          attention=attention, budgets=batch["budgets"],
          prompt_lengths=batch.get("prompt_lengths"), lengths=batch.get("lengths"),
          kind=cfg.kind, coef=cfg.coef, pg_coef=cfg.pg_coef,
          advantages=batch.get("advantages"), rollout_logp=batch.get("rollout_logp"),
          tis_cap=cfg.tis_cap, dense_logits=batch.get("dense_logits"),
          temperature=cfg.temperature, logprob_chunk=cfg.logprob_chunk)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(lora)
    grad_norm = optax.global_norm(grads)
    no_gap = metrics["max_abs_gap"] < cfg.skip_below_gap
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & ~no_gap
    updates, new_opt = optimizer.update(grads, opt_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    lora, opt_state = keep(new_lora, lora), keep(new_opt, opt_state)
    metrics = dict(metrics, grad_norm=grad_norm, skipped=(~ok & ~no_gap).astype(jnp.float32),
                   no_gap=no_gap.astype(jnp.float32), **lora_norms(lora))
    return lora, opt_state, {f"distill/{k}": v for k, v in metrics.items()}

  return jax.jit(step, donate_argnums=(0, 1))


def distill_state_step(step_fn, dstate: DistillState, state, batch) -> tuple[DistillState, dict]:
  """Apply a `make_distill_step` function to a `DistillState` (advances its step counter)."""
  lora, opt_state, metrics = step_fn(dstate.lora, dstate.opt_state, state, batch)
  return DistillState(lora=lora, opt_state=opt_state, step=dstate.step + 1), metrics
