"""The rollout-correction family: importance-sampling (IS) weights and rejection sampling (RS)
for rollouts that another policy sampled (the sparse actor; a stale or lower-precision one).
verl's vocabulary (`rollout_is`, `rollout_is_threshold`, `rollout_rs`, ...) names the pieces;
each is registered in `registry.CORRECTIONS`. docs/rollout_correction.md has every formula.

Symbols (per token t of row b, over the valid tokens m_bt = 1):
  log rho_t   log pi_target(y_t) - log q(y_t), clamped to [-20, 20]; q = the policy that
              sampled (`rollout_logp`), pi_target = the dense old policy (decoupled mode,
              `old_logp`) or the current policy under stop_gradient (bypass mode).
  k1_t        -log rho_t                    (the three KL(q || pi) estimators on q's samples)
  k2_t        (log rho_t)^2 / 2
  k3_t        rho_t - 1 - log rho_t
IS levels: token w_t = rho_t; sequence w_b = exp(sum_t log rho_t) (clamped to [-20, 20] in
log space); geometric w_b = exp(mean_t log rho_t). Bounds: "C" truncates, w <- min(w, C);
"lo_hi" is IcePop's band, w <- w on [lo, hi] and 0 outside (the mask is unchanged).
Batch normalisation divides by the mean weight over the mini-batch's units (tokens, or rows
for the sequence levels). RS removes tokens (token statistics) or whole rows (sequence
statistics) from the loss mask; the veto (Sparse-RL's sparsity-aware rejection) removes a row
when any of its tokens has rho_t < tau.

Everything here is a pure jnp function under stop_gradient: the corrections are targets.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from sparrow_jax.rl.registry import CORRECTIONS

IS_LEVELS = ("token", "sequence", "geometric")
MODES = ("decoupled", "bypass")
_LOG_CLAMP = 20.0
PREFIX = "rollout_corr/"


def _f32(x) -> jax.Array:
  return jnp.asarray(x).astype(jnp.float32)


# ----------------------------------------------------------------------------- thresholds


@dataclasses.dataclass(frozen=True)
class Band:
  """A threshold: `hi` alone ("2.0") or `lo` and `hi` ("0.5_5.0", verl's lower_upper)."""

  lo: float | None
  hi: float

  @property
  def text(self) -> str:
    return f"{self.hi:g}" if self.lo is None else f"{self.lo:g}_{self.hi:g}"


def parse_band(raw, *, what: str) -> Band:
  """"hi" or "lo_hi" (or a number) -> Band; a clear error names `what` otherwise."""
  if isinstance(raw, (int, float)) and not isinstance(raw, bool):
    parts = [float(raw)]
  elif isinstance(raw, str) and raw.strip():
    try:
      parts = [float(p) for p in raw.strip().split("_")]
    except ValueError:
      parts = []
  else:
    parts = []
  if len(parts) not in (1, 2) or not all(math.isfinite(p) for p in parts):
    raise ValueError(f"{what}={raw!r}: expected a number 'hi' or a band 'lo_hi' (e.g. '2.0' "
                     f"or '0.5_5.0')")
  if len(parts) == 2 and not parts[0] < parts[1]:
    raise ValueError(f"{what}={raw!r}: expected lo < hi in 'lo_hi'")
  return Band(None, parts[0]) if len(parts) == 1 else Band(parts[0], parts[1])


# ----------------------------------------------------------------------------- statistics


def log_ratio(target_logp: jax.Array, rollout_logp: jax.Array) -> jax.Array:
  """log rho = log pi_target - log q, clamped to [-20, 20], without gradient -> [B, T]."""
  d = _f32(jax.lax.stop_gradient(target_logp)) - _f32(jax.lax.stop_gradient(rollout_logp))
  return jnp.clip(d, -_LOG_CLAMP, _LOG_CLAMP)


def token_divergences(lr: jax.Array) -> dict[str, jax.Array]:
  """Per-token k1, k2, k3 estimators of KL(q || pi_target) from log rho [B, T]."""
  return {"k1": -lr, "k2": 0.5 * jnp.square(lr), "k3": jnp.exp(lr) - 1.0 - lr}


def _row_sum(x, valid):
  return jnp.sum(jnp.where(valid, x, 0.0), axis=-1)  # [B]


def _row_mean(x, valid):
  return _row_sum(x, valid) / jnp.maximum(jnp.sum(valid, axis=-1).astype(jnp.float32), 1.0)


def _row_max(x, valid):
  m = jnp.max(jnp.where(valid, x, -jnp.inf), axis=-1)  # [B]
  return jnp.where(jnp.any(valid, axis=-1), m, 0.0)


# ----------------------------------------------------------------------------- IS weights


@CORRECTIONS.register("is:token")
def is_token(lr: jax.Array, valid: jax.Array) -> jax.Array:
  """Token-level IS: w_t = rho_t (verl rollout_is=token)."""
  return jnp.where(valid, jnp.exp(lr), 0.0)


@CORRECTIONS.register("is:sequence")
def is_sequence(lr: jax.Array, valid: jax.Array) -> jax.Array:
  """Sequence-level IS: w_b = prod_t rho_t = exp(sum_t log rho_t), on every token of b."""
  s = jnp.clip(_row_sum(lr, valid), -_LOG_CLAMP, _LOG_CLAMP)  # [B]
  return jnp.where(valid, jnp.exp(s)[:, None], 0.0)


@CORRECTIONS.register("is:geometric")
def is_geometric(lr: jax.Array, valid: jax.Array) -> jax.Array:
  """Geometric-mean IS: w_b = exp(mean_t log rho_t), on every token of b."""
  return jnp.where(valid, jnp.exp(_row_mean(lr, valid))[:, None], 0.0)


@CORRECTIONS.register("is_bound:truncate")
def is_truncate(w: jax.Array, band: Band) -> jax.Array:
  """Truncated IS (TIS): w <- min(w, C) with C = rollout_is_threshold."""
  return jnp.minimum(w, band.hi)


@CORRECTIONS.register("is_bound:icepop")
def is_icepop(w: jax.Array, band: Band) -> jax.Array:
  """IcePop: w kept on [lo, hi], 0 outside (rollout_is_threshold='lo_hi'; mask unchanged)."""
  return jnp.where((w >= band.lo) & (w <= band.hi), w, 0.0)


@CORRECTIONS.register("is:batch_normalize")
def is_batch_normalize(w: jax.Array, norm: jax.Array) -> jax.Array:
  """Batch normalisation: w <- w / mean(w) over the mini-batch's units (no-op if mean ~ 0)."""
  norm = _f32(norm)
  return w / jnp.where(norm > 1e-8, norm, 1.0)


def is_units(level: str, valid: jax.Array) -> jax.Array:
  """[B, T] weights of the IS units: tokens (token level) or one per valid row."""
  if level == "token":
    return valid.astype(jnp.float32)
  first = jnp.cumsum(valid.astype(jnp.int32), axis=-1) == 1
  return (valid & first).astype(jnp.float32)  # the first valid token stands for its row


# ----------------------------------------------------------------------------- rejection


@dataclasses.dataclass(frozen=True)
class RSStat:
  """One rejection statistic: its level ("token" or "sequence"), its space ("ratio": a band
  on a ratio, default [1/hi, hi]; "k": a divergence, `hi` alone is an upper bound, |k1| <= hi
  for the signed k1) and the function (log rho [B, T], valid [B, T]) -> [B, T] or [B]."""

  level: str
  space: str
  fn: Callable


RS_STATS: dict[str, RSStat] = {}


def _register_rs(name: str, level: str, space: str, doc: str, fn: Callable) -> None:
  fn.__doc__ = doc
  CORRECTIONS.register("rs:" + name, doc)(fn)
  RS_STATS[name] = RSStat(level, space, fn)


_register_rs("token", "token", "ratio", "Token RS on rho_t: tokens outside [lo, hi] dropped "
             "(hi alone: [1/hi, hi]).", lambda lr, v: jnp.exp(lr))
_register_rs("sequence", "sequence", "ratio", "Sequence RS on prod_t rho_t: rows outside the "
             "band dropped.",
             lambda lr, v: jnp.exp(jnp.clip(_row_sum(lr, v), -_LOG_CLAMP, _LOG_CLAMP)))
_register_rs("geometric", "sequence", "ratio", "Geometric RS on exp(mean_t log rho_t): rows "
             "outside the band dropped.", lambda lr, v: jnp.exp(_row_mean(lr, v)))
for _k in ("k1", "k2", "k3"):
  _register_rs(f"token_{_k}", "token", "k", f"Token RS on {_k}_t: tokens outside the bound "
               f"dropped.", lambda lr, v, k=_k: token_divergences(lr)[k])
  _register_rs(f"seq_sum_{_k}", "sequence", "k", f"Sequence RS on sum_t {_k}_t: rows outside "
               f"the bound dropped.", lambda lr, v, k=_k: _row_sum(token_divergences(lr)[k], v))
  _register_rs(f"seq_mean_{_k}", "sequence", "k", f"Sequence RS on mean_t {_k}_t: rows "
               f"outside the bound dropped.",
               lambda lr, v, k=_k: _row_mean(token_divergences(lr)[k], v))
for _k in ("k2", "k3"):
  _register_rs(f"seq_max_{_k}", "sequence", "k", f"Sequence RS on max_t {_k}_t: rows outside "
               f"the bound dropped.", lambda lr, v, k=_k: _row_max(token_divergences(lr)[k], v))
RS_NAMES = tuple(RS_STATS)


def rs_keep(name: str, band: Band, lr: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, T] bool: the valid tokens that RS statistic `name` with threshold `band` keeps."""
  st = RS_STATS[name]
  x = st.fn(lr, valid)
  if st.space == "ratio":
    lo = 1.0 / band.hi if band.lo is None else band.lo
    ok = (x >= lo) & (x <= band.hi)
  elif band.lo is None:
    ok = (jnp.abs(x) <= band.hi) if name.endswith("k1") else (x <= band.hi)
  else:
    ok = (x >= band.lo) & (x <= band.hi)
  if st.level == "sequence":
    ok = ok[:, None]
  return valid & ok


@CORRECTIONS.register("rs:token_veto")
def token_veto_keep(lr: jax.Array, valid: jax.Array, tau: float) -> jax.Array:
  """Sparse-RL's sparsity-aware rejection (verl's token veto): a row is dropped when any valid
  token has rho_t < tau."""
  bad = jnp.any(valid & (lr < math.log(tau)), axis=-1)  # [B]
  return valid & ~bad[:, None]


@CORRECTIONS.register("mode:decoupled")
def target_decoupled(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
  """Decoupled mode (three policies): rho = pi_old / q; the PPO ratio is pi_theta / pi_old."""
  return old_logp


@CORRECTIONS.register("mode:bypass")
def target_bypass(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
  """Bypass mode (pi_old = q): the learner passes q's log-probs as old_logp, the PPO ratio is
  pi_theta / q, and rejection uses rho = sg(pi_theta) / q."""
  return jax.lax.stop_gradient(logp)


# ----------------------------------------------------------------------------- the spec


@dataclasses.dataclass(frozen=True)
class CorrectionSpec:
  """Parsed, validated correction settings (from `GRPOLossConfig`'s rollout_* fields)."""

  is_level: str | None = None
  is_band: Band | None = None
  batch_normalize: bool = False
  rs: tuple[tuple[str, Band], ...] = ()
  veto: float | None = None
  mode: str = "decoupled"

  @property
  def active(self) -> bool:
    return self.is_level is not None or bool(self.rs) or self.veto is not None

  @property
  def rejects(self) -> bool:
    return bool(self.rs) or self.veto is not None


def make_spec(*, rollout_is=None, rollout_is_threshold="2.0", rollout_is_batch_normalize=False,
              rollout_rs=None, rollout_rs_threshold=None, rollout_token_veto_threshold=None,
              rollout_mode="decoupled", where: str = "GRPOLossConfig") -> CorrectionSpec:
  """Validates the rollout_* settings -> CorrectionSpec; errors name the field and the
  accepted values."""
  if rollout_mode not in MODES:
    raise ValueError(f"{where}.rollout_mode={rollout_mode!r}: expected one of {MODES}")
  if rollout_is is not None and rollout_is not in IS_LEVELS:
    raise ValueError(f"{where}.rollout_is={rollout_is!r}: expected None or one of {IS_LEVELS}")
  band = None
  if rollout_is is not None:
    band = parse_band(rollout_is_threshold, what=f"{where}.rollout_is_threshold")
    if not band.hi > 0 or (band.lo is not None and band.lo < 0):
      raise ValueError(f"{where}.rollout_is_threshold={rollout_is_threshold!r}: expected C > 0 "
                       f"(truncation) or 0 <= lo < hi (IcePop band)")
    if rollout_mode == "bypass":
      raise ValueError(f"{where}.rollout_is={rollout_is!r} with rollout_mode='bypass': the PPO "
                       f"ratio is already pi_theta / pi_rollout there; expected rollout_is=None "
                       f"(or rollout_mode='decoupled')")
  if rollout_is_batch_normalize and rollout_is is None:
    raise ValueError(f"{where}.rollout_is_batch_normalize=True needs rollout_is (token, "
                     f"sequence or geometric)")
  rs: list[tuple[str, Band]] = []
  if rollout_rs is not None:
    names = [n.strip() for n in str(rollout_rs).split(",")]
    for n in names:
      if n not in RS_STATS:
        raise ValueError(f"{where}.rollout_rs={rollout_rs!r}: unknown statistic {n!r}; expected "
                         f"a comma-separated list of {RS_NAMES}")
    if len(set(names)) != len(names):
      raise ValueError(f"{where}.rollout_rs={rollout_rs!r}: a statistic is listed twice")
    if rollout_rs_threshold is None:
      raise ValueError(f"{where}.rollout_rs={rollout_rs!r} needs rollout_rs_threshold ('hi' or "
                       f"'lo_hi', one per statistic, comma-separated)")
    raw = [t.strip() for t in str(rollout_rs_threshold).split(",")]
    if len(raw) == 1:
      raw = raw * len(names)
    if len(raw) != len(names):
      raise ValueError(f"{where}.rollout_rs_threshold={rollout_rs_threshold!r}: {len(raw)} "
                       f"thresholds for {len(names)} statistics {names}; expected one, or one "
                       f"each")
    for n, t in zip(names, raw):
      b = parse_band(t, what=f"{where}.rollout_rs_threshold[{n}]")
      if RS_STATS[n].space == "ratio" and (b.lo is None and not b.hi > 1 or (
          b.lo is not None and b.lo < 0)):
        raise ValueError(f"{where}.rollout_rs_threshold={t!r} for {n!r}: a ratio band needs "
                         f"hi > 1 (kept: [1/hi, hi]) or 0 <= lo < hi")
      if RS_STATS[n].space == "k" and b.lo is None and not b.hi >= 0:
        raise ValueError(f"{where}.rollout_rs_threshold={t!r} for {n!r}: expected an upper "
                         f"bound >= 0 on the divergence")
      rs.append((n, b))
  elif rollout_rs_threshold is not None:
    raise ValueError(f"{where}.rollout_rs_threshold={rollout_rs_threshold!r} without "
                     f"rollout_rs; expected both or neither")
  veto = rollout_token_veto_threshold
  if veto is not None and not 0 < veto < 1:
    raise ValueError(f"{where}.rollout_token_veto_threshold={veto!r}: expected None or "
                     f"0 < tau < 1 (rows with any rho_t < tau are dropped)")
  return CorrectionSpec(is_level=rollout_is, is_band=band,
                        batch_normalize=bool(rollout_is_batch_normalize), rs=tuple(rs),
                        veto=None if veto is None else float(veto), mode=rollout_mode)


# ----------------------------------------------------------------------------- application


def raw_is_weights(spec: CorrectionSpec, lr: jax.Array, valid: jax.Array) -> jax.Array:
  """The bounded IS weights before batch normalisation -> [B, T] (0 where not valid)."""
  w = CORRECTIONS.get("is:" + spec.is_level)(lr, valid)
  bound = "icepop" if spec.is_band.lo is not None else "truncate"
  return jnp.where(valid, CORRECTIONS.get("is_bound:" + bound)(w, spec.is_band), 0.0)


def is_norm(spec: CorrectionSpec, lr: jax.Array, valid: jax.Array) -> jax.Array:
  """The batch-normalisation divisor of a (mini-)batch: mean bounded weight over its units."""
  u = is_units(spec.is_level, valid)
  return jnp.sum(raw_is_weights(spec, lr, valid) * u) / jnp.maximum(jnp.sum(u), 1.0)


def keep_mask(spec: CorrectionSpec, lr: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, T] bool: the valid tokens every RS statistic and the veto keep."""
  keep = valid
  for name, band in spec.rs:
    keep = keep & rs_keep(name, band, lr, valid)
  if spec.veto is not None:
    keep = keep & token_veto_keep(lr, valid, spec.veto)
  return keep


def apply(spec: CorrectionSpec, target_logp: jax.Array, rollout_logp: jax.Array,
          mask: jax.Array, *, norm=None):
  """-> (weights [B, T] or None, mask [B, T] less the rejected tokens (same dtype), metrics).

  `norm`: the mini-batch's batch-normalisation divisor (`is_norm`) when this is one of its
  micro-batches; None computes it over this batch. Metrics (prefix `rollout_corr/`), over
  the input mask: is_weight_mean / is_weight_sq_mean / is_weight_max / ess (ESS / N =
  mean(w)^2 / mean(w^2)) over the IS units, rejected_token_frac, rejected_seq_frac (valid rows
  left without a token), rs_<name>_frac (valid tokens it rejects) per statistic,
  veto_seq_frac, k1 / k2 / k3 (token means), num_seqs and is_units (counts, for
  `combine_micro_metrics`).
  """
  if target_logp.shape != rollout_logp.shape or target_logp.shape != mask.shape:
    raise ValueError(f"rollout correction: target log-probs {target_logp.shape}, rollout_logp "
                     f"{rollout_logp.shape}, mask {mask.shape}; expected equal [B, T] shapes")
  lr = log_ratio(target_logp, rollout_logp)  # [B, T]
  valid = _f32(mask) > 0  # [B, T]
  vf = valid.astype(jnp.float32)
  n_tok = jnp.sum(vf)
  row_valid = jnp.any(valid, axis=-1)  # [B]
  n_seq = jnp.sum(row_valid.astype(jnp.float32))
  tok_mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n_tok, 1.0)
  m: dict[str, jax.Array] = {PREFIX + "num_seqs": n_seq}
  for k, v in token_divergences(lr).items():
    m[PREFIX + k] = tok_mean(v)
  weights = None
  if spec.is_level is not None:
    weights = raw_is_weights(spec, lr, valid)
    if spec.batch_normalize:
      weights = is_batch_normalize(weights, is_norm(spec, lr, valid) if norm is None else norm)
    u = is_units(spec.is_level, valid)
    n_u = jnp.maximum(jnp.sum(u), 1.0)
    w_mean = jnp.sum(weights * u) / n_u
    w_sq = jnp.sum(jnp.square(weights) * u) / n_u
    m.update({PREFIX + "is_units": jnp.sum(u), PREFIX + "is_weight_mean": w_mean,
              PREFIX + "is_weight_sq_mean": w_sq,
              PREFIX + "is_weight_max": jnp.where(jnp.any(valid),
                                                  jnp.max(jnp.where(valid, weights, -jnp.inf)),
                                                  0.0),
              PREFIX + "ess": ess(w_mean, w_sq)})
    weights = jax.lax.stop_gradient(weights)
  keep = valid
  for name, band in spec.rs:
    k = rs_keep(name, band, lr, valid)
    m[PREFIX + f"rs_{name}_frac"] = tok_mean((valid & ~k).astype(jnp.float32))
    keep = keep & k
  if spec.veto is not None:
    k = token_veto_keep(lr, valid, spec.veto)
    m[PREFIX + "veto_seq_frac"] = (jnp.sum((row_valid & ~jnp.any(k, axis=-1))
                                           .astype(jnp.float32)) / jnp.maximum(n_seq, 1.0))
    keep = keep & k
  m[PREFIX + "rejected_token_frac"] = tok_mean((valid & ~keep).astype(jnp.float32))
  m[PREFIX + "rejected_seq_frac"] = (jnp.sum((row_valid & ~jnp.any(keep, axis=-1))
                                             .astype(jnp.float32)) / jnp.maximum(n_seq, 1.0))
  new_mask = jnp.where(keep, mask, jnp.zeros_like(mask))
  return weights, new_mask, m


def ess(w_mean, w_sq_mean) -> jax.Array:
  """Effective sample size over N: (sum w)^2 / (N sum w^2) = mean(w)^2 / mean(w^2) (1 when
  the weights are equal; 0 when there are none)."""
  w_sq_mean = _f32(w_sq_mean)
  return jnp.where(w_sq_mean > 0, jnp.square(_f32(w_mean)) / jnp.maximum(w_sq_mean, 1e-30), 0.0)


def combine(per_micro, n_input) -> dict[str, jax.Array]:
  """Mini-batch values of the `rollout_corr/` metrics from stacked per-micro-batch ones
  ([n_micro] each): counts summed, is_weight_max a max, the IS-unit means weighted by
  is_units, rejected/veto sequence fractions by num_seqs, the token means by the input mask's
  tokens `n_input`, and ess recomputed from the combined moments."""
  n_input = _f32(n_input)
  has = n_input > 0
  out = {}
  for k, v in per_micro.items():
    name = k[len(PREFIX):]
    if name in ("num_seqs", "is_units"):
      out[k] = jnp.sum(v)
    elif name == "is_weight_max":
      out[k] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, v, -jnp.inf)), 0.0)
    elif name == "ess":
      continue
    else:
      if name in ("is_weight_mean", "is_weight_sq_mean"):
        w = _f32(per_micro[PREFIX + "is_units"])
      elif name in ("rejected_seq_frac", "veto_seq_frac"):
        w = _f32(per_micro[PREFIX + "num_seqs"])
      else:
        w = n_input
      out[k] = jnp.sum(_f32(v) * w) / jnp.maximum(jnp.sum(w), 1.0)
  if PREFIX + "ess" in per_micro:
    out[PREFIX + "ess"] = ess(out[PREFIX + "is_weight_mean"], out[PREFIX + "is_weight_sq_mean"])
  return out


# ----------------------------------------------------------------------------- presets

# Preset-like combinations as TrainConfig keys (verl's preset names where it has one). The IS
# thresholds are verl's defaults (2.0; IcePop 0.5_5.0) and the Sparse-RL release's (mis.yaml:
# token TIS at 1.5, token RS on [0.5, 1.5], veto 1e-4, batch normalisation). The RS thresholds
# of geo_rs / k3_rs are NOT verl's (1.001 and 0.01, sized for precision mismatch, would reject
# nearly every row of a sparse actor with KL(q || pi) ~0.2 per token, docs/sparse_rl_study.md):
# they are untuned starting points for sparse rollouts. Used by the docs, the trainer tests and
# experiments/sparse_rl_study.py's arms.
PRESETS: dict[str, dict] = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold="2.0"),
    "seq_tis": dict(rollout_is="sequence", rollout_is_threshold="2.0"),
    "seq_mis": dict(rollout_is="sequence", rollout_is_threshold="2.0", rollout_rs="sequence",
                    rollout_rs_threshold="2.0"),
    "geo_rs": dict(rollout_rs="geometric", rollout_rs_threshold="1.3",
                   rollout_token_veto_threshold=1e-4),
    "geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold="2.0",
                             rollout_rs="geometric", rollout_rs_threshold="1.3",
                             rollout_token_veto_threshold=1e-4),
    "k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.3"),
    "icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "bypass_ppo_clip": dict(rollout_mode="bypass"),
    "sparse_rl": dict(rollout_is="token", rollout_is_threshold="1.5", rollout_rs="token",
                      rollout_rs_threshold="0.5_1.5", rollout_token_veto_threshold=1e-4,
                      rollout_is_batch_normalize=True),
}
