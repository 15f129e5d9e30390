"""GRPO losses: group advantages, the PPO clipped surrogate, KL, entropy, rollout-vs-policy
mismatch correction and DAPO dynamic sampling. Small pure jnp functions, float32, jittable.

Paper symbols and the names that carry them:
  G               group size: samples per prompt (`group_size`).
  A_i             group-relative advantage, GRPO: (r_i - mean(r)) / (std(r) + eps);
                  Dr.GRPO: r_i - mean(r) (`group_advantages(normalize_std=False)`).
  rho_t           importance ratio pi_theta / pi_old = exp(logp - old_logp) (`ppo_clip_loss`).
  ε_low, ε_high   DAPO clip-higher: rho clipped to [1 - ε_low, 1 + ε_high] (`eps_low`,
                  `eps_high`; the Sparrow release uses 0.2 / 0.28).
  c               dual clip: for A < 0 the per-token loss is capped at -A * c (`dual_clip_c`,
                  c > 1; 3 by default as verl, None turns it off).
  β               KL coefficient on k1 / k3 ("low_var_kl") estimates of KL(pi_theta || pi_ref)
                  (`kl_coef`, `kl_penalty`). The release uses low_var_kl with β = 0.
  C               TIS cap: token weight w_t = min(exp(old_logp - rollout_logp), C), where the
                  rollout came from the sparse actor and old_logp is the dense recompute
                  (`rollout_correction`, `tis_cap`). The whole family (sequence and
                  geometric IS, IcePop, k1-k3 rejection, the veto, bypass mode) is
                  `corrections.py`, selected by GRPOLossConfig's rollout_* fields.
  entropy coeff   loss -= entropy_coeff * H (`entropy_coeff`; 0 in the release).

Aggregation of a per-token loss l[b, t] with mask m[b, t] (`aggregate_loss`):
  token-mean               sum(l m) / sum(m)                        (DAPO token-level)
  seq-mean-token-mean      mean_b [ sum_t(l m) / sum_t(m) ]          (original GRPO)
  seq-mean-token-sum       mean_b [ sum_t(l m) ]                     (sum over tokens)
  seq-mean-token-sum-norm  sum_b [ sum_t(l m) ] / norm_len            (Dr.GRPO, constant norm)
The sequence means run over rows with at least one valid token, so rows that are all padding
(static-shape batches) do not dilute the loss. seq-mean-token-sum-norm is verl's: the batch's
*sum* of sequence sums over the constant horizon (Dr.GRPO's 1/(G L_max) up to the constant
batch size), not a mean over sequences.

Micro-batches (gradient accumulation): the denominators sum(m) and the number of valid rows are
those of the whole mini-batch (`loss_denominators`), passed to every micro-batch as
`num_tokens` / `num_seqs`; the micro-batch losses and gradients are then *summed*, which equals
the loss of the mini-batch in one piece whatever the token counts of the micro-batches (as
current verl does for token-mean). A micro-batch with no valid token contributes exactly 0.

Everything that is a target (old_logp, ref_logp, advantages, importance weights) is wrapped in
`stop_gradient`; gradients flow only through `logp` (and `entropy`). Log-ratios are clamped to
[-20, 20] before `exp`, and k3 to [-10, 10], as verl does. Masked positions must hold finite
values (they are zeroed, but a NaN would still poison gradients through the product).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl import corrections as corr_lib

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0

Metrics = dict[str, jax.Array]


# ----------------------------------------------------------------------------- helpers


def _f32(x) -> jax.Array:
  return jnp.asarray(x).astype(jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask != 0 (0 when the mask is empty)."""
  m = _f32(mask)
  return jnp.sum(jnp.where(m > 0, _f32(x), 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  valid = _f32(mask) > 0
  return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, _f32(x), -jnp.inf)), 0.0)


def _masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
  valid = _f32(mask) > 0
  return jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, _f32(x), jnp.inf)), 0.0)


def _log_ratio(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.clip(_f32(a) - _f32(b), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6, ddof: int = 1) -> jax.Array:
  """Group-relative advantages A_i, same shape as `rewards` ([N*G] grouped contiguously, or
  [N, G]).

  `normalize_std=True` is GRPO, (r - mean) / (std + eps) with the unbiased std (`ddof=1`, as
  verl and tunix); `False` is Dr.GRPO, r - mean. A group whose rewards are all equal gets 0.
  """
  if not isinstance(group_size, int) or group_size <= 0:
    raise ValueError(f"group_advantages: group_size={group_size!r}; expected a positive int")
  r = _f32(rewards)
  if r.ndim == 2 and r.shape[1] != group_size:
    raise ValueError(f"group_advantages: rewards shape {r.shape} has {r.shape[1]} columns but "
                     f"group_size={group_size}; expected [N, {group_size}]")
  if r.ndim not in (1, 2) or r.size % group_size:
    raise ValueError(f"group_advantages: rewards shape {r.shape}; expected [N*G] with group_size="
                     f"{group_size} dividing its length, or [N, G]")
  grouped = r.reshape(-1, group_size)  # [N, G]
  centered = grouped - jnp.mean(grouped, axis=-1, keepdims=True)  # [N, G]
  if normalize_std:
    var = jnp.sum(centered**2, axis=-1, keepdims=True) / max(group_size - ddof, 1)  # [N, 1]
    centered = centered / (jnp.sqrt(var) + eps)
  return centered.reshape(r.shape)


def ragged_group_advantages(rewards, group_ids, *, normalize_std: bool = True,
                            eps: float = 1e-6, ddof: int = 1) -> np.ndarray:
  """`group_advantages` for groups of unequal sizes (ARRoL prunes some members of a group):
  rewards `[N]`, group_ids `[N]` (any hashable labels, members need not be contiguous) ->
  float32 advantages `[N]`. A group of one member, or of equal rewards, gets 0; the unbiased
  std of a group of n members divides by max(n - ddof, 1). Host-side (numpy): group sizes
  change every step, so a traced version would recompile."""
  r = np.asarray(rewards, np.float64).reshape(-1)
  ids = list(group_ids)
  if len(ids) != r.size:
    raise ValueError(f"ragged_group_advantages: {r.size} rewards but {len(ids)} group ids")
  out = np.zeros_like(r)
  groups: dict = {}
  for i, g in enumerate(ids):
    groups.setdefault(g, []).append(i)
  for idx in groups.values():
    x = r[idx]
    c = x - x.mean()
    if normalize_std:
      c = c / (np.sqrt(np.sum(c * c) / max(len(idx) - ddof, 1)) + eps)
    out[idx] = c
  return out.astype(np.float32)


# ----------------------------------------------------------------------------- aggregation


def aggregate_loss(per_token: jax.Array, mask: jax.Array, mode: str = "token-mean",
                   norm_len: int | None = None, *, num_tokens=None,
                   num_seqs=None) -> jax.Array:
  """Reduces a [B, T] per-token loss to a scalar (see the module docstring for the modes).

  `norm_len` is Dr.GRPO's constant (the generation budget); it defaults to T. `num_tokens` /
  `num_seqs` (scalars) replace the denominators sum(m) / number of valid rows of this batch by
  those of a larger batch it is a micro-batch of (`loss_denominators`).
  """
  if mode not in AGG_MODES:
    raise ValueError(f"aggregate_loss: mode={mode!r}; expected one of {AGG_MODES}")
  if per_token.shape != mask.shape or per_token.ndim != 2:
    raise ValueError(f"aggregate_loss: per_token shape {per_token.shape} and mask shape "
                     f"{mask.shape}; expected equal [B, T] shapes")
  m = _f32(mask)  # [B, T]
  x = jnp.where(m > 0, _f32(per_token), 0.0) * m  # [B, T]
  if mode == "token-mean":
    denom = jnp.sum(m) if num_tokens is None else _f32(num_tokens)
    return jnp.sum(x) / jnp.maximum(denom, 1.0)
  tokens = jnp.sum(m, axis=-1)  # [B]
  if mode == "seq-mean-token-mean":
    seq = jnp.sum(x, axis=-1) / jnp.maximum(tokens, 1.0)  # [B]
  elif mode == "seq-mean-token-sum":
    seq = jnp.sum(x, axis=-1)  # [B]
  else:  # verl's seq-mean-token-sum-norm: no division by the number of sequences
    if norm_len is None:
      norm_len = per_token.shape[-1]
    if not norm_len > 0:
      raise ValueError(f"aggregate_loss: norm_len={norm_len!r}; expected > 0")
    return jnp.sum(x) / float(norm_len)
  valid = (tokens > 0).astype(jnp.float32)  # [B]
  denom = jnp.sum(valid) if num_seqs is None else _f32(num_seqs)
  return jnp.sum(seq * valid) / jnp.maximum(denom, 1.0)


def loss_denominators(mask: jax.Array) -> dict[str, jax.Array]:
  """Denominators of `aggregate_loss` for a whole (mini-)batch mask [B, T]: the number of
  valid tokens and of rows with at least one valid token (float32 scalars)."""
  m = _f32(mask)  # [B, T]
  return {"num_tokens": jnp.sum(m), "num_seqs": jnp.sum((jnp.sum(m, axis=-1) > 0)
                                                         .astype(jnp.float32))}


# ----------------------------------------------------------------------------- PPO clip


def _check_clip(eps_low: float, eps_high: float, dual_clip_c: float | None) -> None:
  if not 0.0 <= eps_low < 1.0:
    raise ValueError(f"eps_low={eps_low!r}: expected 0 <= eps_low < 1 (ratio floor 1 - eps_low)")
  if not eps_high >= 0.0:
    raise ValueError(f"eps_high={eps_high!r}: expected >= 0")
  if dual_clip_c is not None and not dual_clip_c > 1.0:
    raise ValueError(f"dual_clip_c={dual_clip_c!r}: expected None or a value > 1")


def ppo_clip_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
                  mask: jax.Array, *, eps_low: float = 0.2, eps_high: float = 0.28,
                  dual_clip_c: float | None = None, agg: str = "token-mean",
                  norm_len: int | None = None,
                  is_weights: jax.Array | None = None, num_tokens=None,
                  num_seqs=None) -> tuple[jax.Array, Metrics]:
  """PPO clipped surrogate with clip-higher and optional dual clip -> (loss, metrics).

  Per token: l = max(-A rho, -A clip(rho, 1 - ε_low, 1 + ε_high)); for A < 0 with dual clip,
  l = min(l, -A c). `is_weights` [B, T] (TIS) multiply l after clipping. Shapes: logp,
  old_logp, mask [B, T]; advantages [B] (one per sequence) or [B, T]. `num_tokens` /
  `num_seqs`: mini-batch denominators for a micro-batch (`aggregate_loss`).

  Metrics (token means over the mask): clip_frac_low (A < 0 and rho < 1 - ε_low: the floor
  is active), clip_frac_high (A > 0 and rho > 1 + ε_high), dual_clip_frac (A < 0 and
  -A max(rho, clip(rho)) > -A c), approx_kl (k1 of old vs new, mean(old_logp - logp)),
  approx_kl_k3, ratio_mean / ratio_max / ratio_min.
  """
  _check_clip(eps_low, eps_high, dual_clip_c)
  if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.ndim != 2:
    raise ValueError(f"ppo_clip_loss: logp {logp.shape}, old_logp {old_logp.shape}, mask "
                     f"{mask.shape}; expected equal [B, T] shapes")
  adv = jax.lax.stop_gradient(_f32(advantages))
  if adv.ndim == 1:
    adv = adv[:, None]  # [B, 1]
  if adv.shape[0] != logp.shape[0] or adv.ndim != 2:
    raise ValueError(f"ppo_clip_loss: advantages shape {jnp.shape(advantages)}; expected "
                     f"[{logp.shape[0]}] or {logp.shape}")
  adv = jnp.broadcast_to(adv, logp.shape)  # [B, T]
  log_ratio = _log_ratio(logp, jax.lax.stop_gradient(old_logp))  # [B, T]
  ratio = jnp.exp(log_ratio)  # [B, T]

  unclipped = -adv * ratio  # [B, T]
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
  per_token = jnp.maximum(unclipped, clipped)  # [B, T]
  clip_active = clipped > unclipped
  metrics: Metrics = {
      "clip_frac_low": masked_mean(clip_active & (adv < 0), mask),
      "clip_frac_high": masked_mean(clip_active & (adv > 0), mask),
  }
  if dual_clip_c is not None:
    cap = -adv * dual_clip_c  # [B, T]
    dual_active = (adv < 0) & (per_token > cap)
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, cap), per_token)
    metrics["dual_clip_frac"] = masked_mean(dual_active, mask)
  else:
    metrics["dual_clip_frac"] = jnp.zeros((), jnp.float32)
  if is_weights is not None:
    if is_weights.shape != logp.shape:
      raise ValueError(f"ppo_clip_loss: is_weights shape {is_weights.shape}; expected "
                       f"{logp.shape}")
    per_token = per_token * jax.lax.stop_gradient(_f32(is_weights))

  loss = aggregate_loss(per_token, mask, agg, norm_len, num_tokens=num_tokens,
                        num_seqs=num_seqs)
  neg_log_ratio = jax.lax.stop_gradient(-log_ratio)
  metrics.update(
      pg_loss=loss,
      approx_kl=masked_mean(neg_log_ratio, mask),
      approx_kl_k3=masked_mean(jnp.exp(-neg_log_ratio) - 1.0 + neg_log_ratio, mask),
      ratio_mean=masked_mean(jax.lax.stop_gradient(ratio), mask),
      ratio_max=_masked_max(jax.lax.stop_gradient(ratio), mask),
      ratio_min=_masked_min(jax.lax.stop_gradient(ratio), mask),
  )
  return loss, metrics


# ----------------------------------------------------------------------------- KL, entropy


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "low_var_kl") -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from sampled-token log-probs -> [B, T].

  k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = low_var_kl = exp(ref - logp) - (ref - logp) - 1,
  with ref - logp clamped to [-20, 20] and the result to [-10, 10] (verl).
  """
  if kind not in KL_KINDS:
    raise ValueError(f"kl_penalty: kind={kind!r}; expected one of {KL_KINDS}")
  ref = jax.lax.stop_gradient(_f32(ref_logp))
  logp = _f32(logp)
  if kind == "k1":
    return logp - ref
  if kind == "k2":
    return 0.5 * jnp.square(logp - ref)
  d = _log_ratio(ref, logp)  # [B, T] log(pi_ref / pi_theta)
  return jnp.clip(jnp.exp(d) - d - 1.0, -_K3_CLAMP, _K3_CLAMP)


def entropy_from_logits(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Per-token entropy H_t = -sum_v p log p of softmax(logits) in float32 -> [B, T] (0 where
  mask is 0). Logits [B, T, V] must be finite."""
  logits = _f32(logits)
  logp = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [B, T]
  if mask is not None:
    ent = jnp.where(_f32(mask) > 0, ent, 0.0)
  return ent


# ----------------------------------------------------------------------------- mismatch


def rollout_correction(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *,
                       tis_cap: float | None = 2.0, mask_threshold: float | None = None,
                       mask_low: float | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
  """Sparse-rollout vs dense-policy correction -> (weights [B, T], mask [B, T], stats).

  ratio_t = exp(old_logp - rollout_logp) (dense recompute over sparse actor). Truncated IS:
  w_t = min(ratio_t, C) with C = `tis_cap` (None: w_t = 1, masking only). Masking: with
  `mask_threshold` = h > 1, tokens whose ratio lies outside [1/h, h] are dropped (the lower
  bound is `mask_low` when given; 0 disables it). The returned mask is the input mask with
  those tokens removed (same dtype); the weights are 0 on dropped tokens and carry no gradient.

  Stats over the input mask: is_ratio_mean/max/min, is_weight_mean (kept tokens),
  is_frac_truncated (ratio > C), is_frac_masked.
  """
  if tis_cap is not None and not tis_cap > 0:
    raise ValueError(f"rollout_correction: tis_cap={tis_cap!r}; expected None or > 0")
  if mask_threshold is not None and not mask_threshold > 1.0:
    raise ValueError(f"rollout_correction: mask_threshold={mask_threshold!r}; expected None or "
                     f"> 1 (tokens kept when 1/threshold <= ratio <= threshold)")
  if mask_low is not None and (mask_threshold is None or not 0 <= mask_low < mask_threshold):
    raise ValueError(f"rollout_correction: mask_low={mask_low!r}; expected 0 <= mask_low < "
                     f"mask_threshold={mask_threshold!r}")
  if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
    raise ValueError(f"rollout_correction: old_logp {old_logp.shape}, rollout_logp "
                     f"{rollout_logp.shape}, mask {mask.shape}; expected equal [B, T] shapes")
  ratio = jax.lax.stop_gradient(jnp.exp(_log_ratio(old_logp, rollout_logp)))  # [B, T]
  valid = _f32(mask) > 0  # [B, T]
  keep = valid
  if mask_threshold is not None:
    low = 1.0 / mask_threshold if mask_low is None else mask_low
    keep = valid & (ratio >= low) & (ratio <= mask_threshold)
  weights = jnp.ones_like(ratio) if tis_cap is None else jnp.minimum(ratio, tis_cap)
  weights = jnp.where(keep, weights, 0.0)  # [B, T]
  truncated = (ratio > tis_cap) if tis_cap is not None else jnp.zeros_like(valid)
  stats: Metrics = {
      "is_ratio_mean": masked_mean(ratio, valid),
      "is_ratio_max": _masked_max(ratio, valid),
      "is_ratio_min": _masked_min(ratio, valid),
      "is_weight_mean": masked_mean(weights, keep),
      "is_frac_truncated": masked_mean(truncated, valid),
      "is_frac_masked": masked_mean(valid & ~keep, valid),
  }
  new_mask = jnp.where(keep, mask, jnp.zeros_like(mask))
  return weights, new_mask, stats


# ----------------------------------------------------------------------------- combinator


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOLossConfig:
  """Loss settings (hashable, so it can be a static argument of the jitted step).

  Defaults follow the Sparrow release (verl's actor defaults): ε_low 0.2, ε_high 0.28, dual
  clip c = 3, low_var_kl with β = 0, entropy coefficient 0. `tis_cap` (C) and
  `tis_mask_threshold` turn on the sparse-rollout correction and then require `rollout_logp`.

  The rollout-correction family (`corrections`, docs/rollout_correction.md), verl's names:
  `rollout_is` token | sequence | geometric with `rollout_is_threshold` "C" (truncate) or
  "lo_hi" (IcePop band), `rollout_is_batch_normalize`; `rollout_rs` a comma-separated list of
  rejection statistics with `rollout_rs_threshold` ("hi" or "lo_hi", one or one each);
  `rollout_token_veto_threshold` tau (Sparse-RL's sparsity-aware rejection); `rollout_mode`
  decoupled | bypass (bypass: the learner passes rollout_logp as old_logp). The legacy
  tis_* fields and these are exclusive: tis_cap=C is rollout_is=token, threshold C;
  tis_mask_threshold=h is rollout_rs=token, threshold h (or "tis_mask_low_h").
  """

  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip_c: float | None = 3.0
  agg: str = "token-mean"
  norm_len: int | None = None
  kl_coef: float = 0.0
  kl_kind: str = "low_var_kl"
  entropy_coeff: float = 0.0
  tis_cap: float | None = None
  tis_mask_threshold: float | None = None
  tis_mask_low: float | None = None
  rollout_is: str | None = None
  rollout_is_threshold: str | float = "2.0"
  rollout_is_batch_normalize: bool = False
  rollout_rs: str | None = None
  rollout_rs_threshold: str | None = None
  rollout_token_veto_threshold: float | None = None
  rollout_mode: str = "decoupled"

  def __post_init__(self):
    _check_clip(self.eps_low, self.eps_high, self.dual_clip_c)
    if self.agg not in AGG_MODES:
      raise ValueError(f"GRPOLossConfig.agg={self.agg!r}: expected one of {AGG_MODES}")
    if self.norm_len is not None and (not isinstance(self.norm_len, int) or self.norm_len <= 0):
      raise ValueError(f"GRPOLossConfig.norm_len={self.norm_len!r}: expected None or a "
                       f"positive int")
    if self.kl_kind not in KL_KINDS:
      raise ValueError(f"GRPOLossConfig.kl_kind={self.kl_kind!r}: expected one of {KL_KINDS}")
    for f in ("kl_coef", "entropy_coeff"):
      if not getattr(self, f) >= 0:
        raise ValueError(f"GRPOLossConfig.{f}={getattr(self, f)!r}: expected >= 0")
    if self.tis_cap is not None and not self.tis_cap > 0:
      raise ValueError(f"GRPOLossConfig.tis_cap={self.tis_cap!r}: expected None or > 0")
    if self.tis_mask_threshold is not None and not self.tis_mask_threshold > 1:
      raise ValueError(f"GRPOLossConfig.tis_mask_threshold={self.tis_mask_threshold!r}: "
                       f"expected None or > 1")
    if self.tis_mask_low is not None and self.tis_mask_threshold is None:
      raise ValueError(f"GRPOLossConfig.tis_mask_low={self.tis_mask_low!r} needs "
                       f"tis_mask_threshold; expected both or neither")
    spec = self.correction  # validates the rollout_* fields
    if spec.active and (self.tis_cap is not None or self.tis_mask_threshold is not None):
      raise ValueError(f"GRPOLossConfig: tis_cap={self.tis_cap!r} / tis_mask_threshold="
                       f"{self.tis_mask_threshold!r} together with rollout_is / rollout_rs / "
                       f"rollout_token_veto_threshold; expected one family (tis_cap=C is "
                       f"rollout_is='token', rollout_is_threshold=C)")
    if self.rollout_bypass and (self.tis_cap is not None or self.tis_mask_threshold is not None):
      raise ValueError("GRPOLossConfig: rollout_mode='bypass' with tis_cap / "
                       "tis_mask_threshold; expected the rollout_* keys (rollout_rs) in bypass "
                       "mode")

  @property
  def correction(self) -> corr_lib.CorrectionSpec:
    """The parsed rollout_* fields (`corrections.make_spec`)."""
    return corr_lib.make_spec(
        rollout_is=self.rollout_is, rollout_is_threshold=self.rollout_is_threshold,
        rollout_is_batch_normalize=self.rollout_is_batch_normalize, rollout_rs=self.rollout_rs,
        rollout_rs_threshold=self.rollout_rs_threshold,
        rollout_token_veto_threshold=self.rollout_token_veto_threshold,
        rollout_mode=self.rollout_mode)

  @property
  def rollout_bypass(self) -> bool:
    """Bypass mode: old = the rollout policy; the learner must pass rollout_logp as old_logp."""
    return self.rollout_mode == "bypass"

  @property
  def uses_rollout_correction(self) -> bool:
    """The loss needs `rollout_logp` (a legacy TIS setting or a rollout_* correction)."""
    return (self.tis_cap is not None or self.tis_mask_threshold is not None
            or self.correction.active)


def grpo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
              config: GRPOLossConfig = GRPOLossConfig(), *, ref_logp: jax.Array | None = None,
              rollout_logp: jax.Array | None = None, entropy: jax.Array | None = None,
              num_tokens=None, num_seqs=None, is_norm=None) -> tuple[jax.Array, Metrics]:
  """loss = PG(w_TIS) + β KL - entropy_coeff H, each aggregated with `config.agg` -> (loss,
  metrics).

  logp [B, T]: current policy (the only input with gradient, besides `entropy`); old_logp
  [B, T]: dense recompute before the update; ref_logp [B, T]: reference policy (needed when
  β > 0; KL is still reported when given); rollout_logp [B, T]: the sparse actor's log-probs
  (needed when the correction is on); entropy [B, T]: per-token entropy, e.g. from
  `entropy_from_logits` inside the grad function (needed when entropy_coeff > 0).
  num_tokens / num_seqs: the denominators of the whole mini-batch when this is one of its
  micro-batches (`loss_denominators(loss_mask(...))` of the mini-batch); every term uses them.
  is_norm: the mini-batch's IS batch-normalisation divisor (`mini_batch_denominators` gives
  all three); None computes it over this batch.

  Rollout correction (`config.correction`, docs/rollout_correction.md): IS weights multiply
  the clipped per-token loss; rejected tokens leave the mask every term aggregates over. In
  decoupled mode rho = pi_old / pi_rollout; in bypass mode (old_logp must be rollout_logp)
  rho = sg(pi_theta) / pi_rollout, and since that is unknown before the forward, rejection
  only zeroes tokens: the denominators stay those of the input mask. Every `rollout_corr/*`
  metric is for the learner's log (`combine_micro_metrics` combines them).
  """
  cfg = config
  spec = cfg.correction
  weights = None
  metrics: Metrics = {}
  if cfg.uses_rollout_correction and rollout_logp is None:
    raise ValueError(f"grpo_loss: rollout_logp=None but tis_cap={cfg.tis_cap!r} / "
                     f"tis_mask_threshold={cfg.tis_mask_threshold!r} / rollout_is="
                     f"{cfg.rollout_is!r} / rollout_rs={cfg.rollout_rs!r} / "
                     f"rollout_token_veto_threshold={cfg.rollout_token_veto_threshold!r}; "
                     f"expected the sparse actor's log-probs [B, T]")
  if spec.active and spec.mode == "bypass" and num_tokens is None:
    num_tokens, num_seqs = loss_denominators(mask).values()
  den = dict(num_tokens=num_tokens, num_seqs=num_seqs)
  if cfg.tis_cap is not None or cfg.tis_mask_threshold is not None:  # legacy TIS, unchanged
    input_mask = mask
    weights, mask, is_stats = rollout_correction(
        old_logp, rollout_logp, mask, tis_cap=cfg.tis_cap,
        mask_threshold=cfg.tis_mask_threshold, mask_low=cfg.tis_mask_low)
    metrics.update(is_stats)
    metrics.update(_legacy_corr_metrics(old_logp, rollout_logp, input_mask, mask, cfg.tis_cap))
  elif spec.active:
    target = corr_lib.CORRECTIONS.get("mode:" + spec.mode)(logp, old_logp)
    weights, mask, corr_metrics = corr_lib.apply(spec, target, rollout_logp, mask, norm=is_norm)
    metrics.update(corr_metrics)
  pg, pg_metrics = ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=cfg.eps_low,
                                 eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
                                 agg=cfg.agg, norm_len=cfg.norm_len, is_weights=weights,
                                 **den)
  metrics.update(pg_metrics)
  loss = pg
  if cfg.kl_coef > 0 and ref_logp is None:
    raise ValueError(f"grpo_loss: ref_logp=None but kl_coef={cfg.kl_coef}; expected reference "
                     f"log-probs [B, T]")
  if ref_logp is not None:
    kl = aggregate_loss(kl_penalty(logp, ref_logp, cfg.kl_kind), mask, cfg.agg, cfg.norm_len,
                        **den)
    metrics["kl"] = jax.lax.stop_gradient(kl)
    if cfg.kl_coef > 0:
      loss = loss + cfg.kl_coef * kl
  if cfg.entropy_coeff > 0 and entropy is None:
    raise ValueError(f"grpo_loss: entropy=None but entropy_coeff={cfg.entropy_coeff}; "
                     f"expected per-token entropy [B, T]")
  if entropy is not None:
    ent = aggregate_loss(entropy, mask, cfg.agg, cfg.norm_len, **den)
    metrics["entropy"] = jax.lax.stop_gradient(ent)
    if cfg.entropy_coeff > 0:
      loss = loss - cfg.entropy_coeff * ent
  metrics["loss"] = jax.lax.stop_gradient(loss)
  metrics["num_tokens"] = jnp.sum(_f32(mask))
  return loss, metrics


def loss_mask(mask: jax.Array, config: GRPOLossConfig = GRPOLossConfig(), *,
              old_logp: jax.Array | None = None,
              rollout_logp: jax.Array | None = None) -> jax.Array:
  """The mask `grpo_loss` aggregates over: `mask` [B, T] less the tokens the rollout
  correction drops (`tis_mask_threshold`, or rejection in decoupled mode; in bypass mode the
  denominators keep the input mask). Feed it to `loss_denominators` for a mini-batch."""
  spec = config.correction
  if config.tis_mask_threshold is None and not (spec.rejects and spec.mode == "decoupled"):
    return mask
  if old_logp is None or rollout_logp is None:
    raise ValueError("loss_mask: tis_mask_threshold / rollout_rs / rollout_token_veto_threshold "
                     "is set; expected old_logp and rollout_logp")
  if config.tis_mask_threshold is not None:
    return rollout_correction(old_logp, rollout_logp, mask, tis_cap=config.tis_cap,
                              mask_threshold=config.tis_mask_threshold,
                              mask_low=config.tis_mask_low)[1]
  keep = corr_lib.keep_mask(spec, corr_lib.log_ratio(old_logp, rollout_logp), _f32(mask) > 0)
  return jnp.where(keep, mask, jnp.zeros_like(mask))


def mini_batch_denominators(mask: jax.Array, config: GRPOLossConfig = GRPOLossConfig(), *,
                            old_logp: jax.Array | None = None,
                            rollout_logp: jax.Array | None = None) -> dict[str, jax.Array]:
  """Everything a micro-batch's `grpo_loss` needs from its whole mini-batch, as keyword
  arguments: `loss_denominators(loss_mask(...))`, plus `is_norm` (the IS batch-normalisation
  divisor) when `rollout_is_batch_normalize` is on."""
  den = loss_denominators(loss_mask(mask, config, old_logp=old_logp, rollout_logp=rollout_logp))
  spec = config.correction
  if spec.batch_normalize:
    if old_logp is None or rollout_logp is None:
      raise ValueError("mini_batch_denominators: rollout_is_batch_normalize is set; expected "
                       "old_logp and rollout_logp")
    den["is_norm"] = corr_lib.is_norm(spec, corr_lib.log_ratio(old_logp, rollout_logp),
                                      _f32(mask) > 0)
  return den


def _legacy_corr_metrics(old_logp, rollout_logp, input_mask, new_mask, cap) -> Metrics:
  """`rollout_corr/*` metrics of the legacy tis_cap / tis_mask_* correction (token units; the
  weights min(rho, C), or 1 without a cap, before the mask)."""
  lr = corr_lib.log_ratio(old_logp, rollout_logp)
  valid = _f32(input_mask) > 0
  kept = _f32(new_mask) > 0
  n_tok, row_valid = jnp.sum(valid.astype(jnp.float32)), jnp.any(valid, axis=-1)
  n_seq = jnp.sum(row_valid.astype(jnp.float32))
  w = jnp.ones_like(lr) if cap is None else jnp.minimum(jnp.exp(lr), cap)
  w = jnp.where(valid, w, 0.0)
  w_mean, w_sq = masked_mean(w, valid), masked_mean(jnp.square(w), valid)
  p = corr_lib.PREFIX
  out = {p + "num_seqs": n_seq, p + "is_units": n_tok, p + "is_weight_mean": w_mean,
         p + "is_weight_sq_mean": w_sq, p + "is_weight_max": _masked_max(w, valid),
         p + "ess": corr_lib.ess(w_mean, w_sq),
         p + "rejected_token_frac": masked_mean(valid & ~kept, valid),
         p + "rejected_seq_frac": (jnp.sum((row_valid & ~jnp.any(kept, axis=-1))
                                           .astype(jnp.float32)) / jnp.maximum(n_seq, 1.0))}
  for k, v in corr_lib.token_divergences(lr).items():
    out[p + k] = masked_mean(v, valid)
  return out


# ----------------------------------------------------------------------------- DAPO sampling


def filter_groups(rewards: jax.Array, *, atol: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """DAPO dynamic sampling: keep [N] bool for groups whose rewards are not all equal
  (max - min > atol), and the number kept (int32 scalar). rewards [N, G]."""
  r = _f32(rewards)
  if r.ndim != 2:
    raise ValueError(f"filter_groups: rewards shape {r.shape}; expected [N, G]")
  keep = (jnp.max(r, axis=-1) - jnp.min(r, axis=-1)) > atol  # [N]
  return keep, jnp.sum(keep.astype(jnp.int32))


class GroupPool:
  """Host-side pool of kept groups for DAPO's batch refill.

  `add(rewards, **arrays)` takes one rollout batch: rewards [N*G] (groups contiguous) or
  [N, G], and arrays whose leading dimension is N*G (tokens, masks, log-probs, ...); groups
  with equal rewards are dropped (kept aside with `keep_dropped=True`). `pop(k)` returns the
  first k kept groups, FIFO, as a dict of arrays with leading dimension k*G (plus "rewards"),
  leaving the rest for the next step. `take(k)` returns k groups, the kept ones first and then,
  when there are too few, dropped ones (to keep a static batch shape; the loss masks them
  out), with the number of kept groups among them, and empties the pool.
  """

  def __init__(self, group_size: int, *, keep_dropped: bool = False):
    if not isinstance(group_size, int) or group_size <= 0:
      raise ValueError(f"GroupPool.group_size={group_size!r}: expected a positive int")
    self.group_size = group_size
    self.keep_dropped = keep_dropped
    self._chunks: list[dict[str, np.ndarray]] = []  # each array [n_kept, G, ...]
    self._dropped: list[dict[str, np.ndarray]] = []  # zero-variance groups, same layout
    self.num_seen = 0

  @property
  def num_groups(self) -> int:
    return sum(len(c["rewards"]) for c in self._chunks)

  @property
  def num_dropped(self) -> int:
    return sum(len(c["rewards"]) for c in self._dropped)

  def add(self, rewards, *, atol: float = 0.0, **arrays) -> int:
    """Adds the non-degenerate groups of one batch; returns how many were kept."""
    g = self.group_size
    r = np.asarray(rewards, np.float32).reshape(-1, g)  # [N, G]
    if "rewards" in arrays:
      raise ValueError("GroupPool.add: 'rewards' is reserved; pass it as the first argument")
    grouped = {}
    for name, a in arrays.items():
      a = np.asarray(a)
      if a.shape[:1] != (r.size,):
        raise ValueError(f"GroupPool.add: {name} has shape {a.shape}; expected leading "
                         f"dimension N*G={r.size}")
      grouped[name] = a.reshape((r.shape[0], g) + a.shape[1:])
    keep, _ = filter_groups(r, atol=atol)
    keep = np.asarray(keep)
    self.num_seen += r.shape[0]
    names = set(grouped) | {"rewards"}
    first = (self._chunks or self._dropped)
    if first and names != set(first[0]):
      raise ValueError(f"GroupPool.add: arrays {sorted(names)}; expected the same names as "
                       f"before, {sorted(first[0])}")
    for sel, chunks, on in ((keep, self._chunks, True), (~keep, self._dropped,
                                                         self.keep_dropped)):
      if on and sel.any():
        chunk = {"rewards": r[sel]}
        chunk.update({k: v[sel] for k, v in grouped.items()})
        chunks.append(chunk)
    return int(keep.sum())

  def pop(self, num_groups: int) -> dict[str, np.ndarray]:
    if num_groups <= 0 or num_groups > self.num_groups:
      raise ValueError(f"GroupPool.pop: num_groups={num_groups}; expected 1..{self.num_groups} "
                       f"(groups in the pool)")
    merged = {k: np.concatenate([c[k] for c in self._chunks]) for k in self._chunks[0]}
    out = {k: v[:num_groups] for k, v in merged.items()}
    rest = {k: v[num_groups:] for k, v in merged.items()}
    self._chunks = [rest] if len(rest["rewards"]) else []
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in out.items()}

  def take(self, num_groups: int) -> tuple[dict[str, np.ndarray], int]:
    """`num_groups` groups, kept ones first (FIFO) then dropped ones -> (arrays with leading
    dimension num_groups*G, number of kept groups among them); the pool is emptied."""
    if not self.keep_dropped:
      raise ValueError("GroupPool.take needs keep_dropped=True (it pads with dropped groups)")
    chunks = self._chunks + self._dropped
    total = self.num_groups + self.num_dropped
    if num_groups <= 0 or num_groups > total:
      raise ValueError(f"GroupPool.take: num_groups={num_groups}; expected 1..{total} (groups "
                       f"seen and kept aside)")
    n_kept = min(self.num_groups, num_groups)
    merged = {k: np.concatenate([c[k] for c in chunks])[:num_groups] for k in chunks[0]}
    self._chunks, self._dropped = [], []
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in merged.items()}, n_kept

  def state(self) -> Mapping[str, int]:
    return {"num_groups": self.num_groups, "num_seen": self.num_seen}


# ----------------------------------------------------------------------------- micro-batches

_SUM_METRICS = ("loss", "pg_loss", "kl", "entropy", "num_tokens")  # mini-batch denominators
_MAX_METRICS = ("ratio_max", "is_ratio_max")
_MIN_METRICS = ("ratio_min", "is_ratio_min")
_INPUT_MASK_METRICS = ("is_ratio_mean", "is_frac_truncated", "is_frac_masked")


def combine_micro_metrics(per_micro: Mapping[str, jax.Array], n_input) -> Metrics:
  """Mini-batch metrics of `grpo_loss` from stacked per-micro-batch ones ([n_micro] each):
  sums for the terms already divided by mini-batch denominators (loss, pg_loss, kl, entropy,
  num_tokens), max / min over micro-batches with tokens, and token-weighted means for the rest
  (weights: the loss mask's tokens, `num_tokens`; for the rollout-correction statistics, which
  are means over the input mask, `n_input` [n_micro] = its tokens per micro-batch). The
  `rollout_corr/*` metrics combine by `corrections.combine` (by IS units, rows or input
  tokens; ESS from the combined moments)."""
  n_input = _f32(n_input)
  has = n_input > 0  # [n_micro]
  out: Metrics = corr_lib.combine({k: v for k, v in per_micro.items()
                                   if k.startswith(corr_lib.PREFIX)}, n_input)
  for k, v in per_micro.items():
    if k.startswith(corr_lib.PREFIX):
      continue
    if k in _SUM_METRICS:
      out[k] = jnp.sum(v)
    elif k in _MAX_METRICS:
      out[k] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, v, -jnp.inf)), 0.0)
    elif k in _MIN_METRICS:
      out[k] = jnp.where(jnp.any(has), jnp.min(jnp.where(has, v, jnp.inf)), 0.0)
    else:
      w = n_input if k in _INPUT_MASK_METRICS else _f32(per_micro["num_tokens"])
      out[k] = jnp.sum(v * w) / jnp.maximum(jnp.sum(w), 1.0)
  return out
