"""One place from `TrainConfig` to the algorithm's own configs: the GRPO loss, DistillSparse,
its LoRA and optimizer, the rollout engine and the rollout temperature (ARRoL's:
`TrainConfig.arrol_config`). The trainer and the compile plan
both call these, so a key reaches the same setting in the run and in its memory plan.
"""

from __future__ import annotations

import optax

from sparrow_jax.engine.config import EngineConfig
from sparrow_jax.models import lora as lora_lib
from sparrow_jax.rl import distill as distill_lib
from sparrow_jax.rl import grpo
from sparrow_jax.run.config import TrainConfig


def rollout_temperature(cfg: TrainConfig) -> float:
  """T of every training-side log-prob. The engine samples greedily at temperature 0 and then
  reports untempered log-probs, so 0 maps to 1."""
  return cfg.temperature if cfg.temperature > 0 else 1.0


# Asynchronous training without a correction key: decoupled PPO's behaviour weight
# pi_prox / mu goes through the TIS cap at this C (AReaL caps it too).
ASYNC_TIS_CAP = 2.0


def _tis_cap(cfg: TrainConfig) -> float | None:
  """`tis_cap`, or ASYNC_TIS_CAP under max_staleness > 0 when no correction key is set."""
  if cfg.max_staleness and cfg.tis_cap is None and cfg.tis_mask_threshold is None and (
      cfg.rollout_is is None and cfg.rollout_rs is None
      and cfg.rollout_token_veto_threshold is None):
    return ASYNC_TIS_CAP
  return cfg.tis_cap


def loss_config(cfg: TrainConfig) -> grpo.GRPOLossConfig:
  """The GRPO loss of a run: every field of `GRPOLossConfig` comes from a key."""
  return grpo.GRPOLossConfig(
      eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
      agg=cfg.loss_agg, norm_len=cfg.max_new_tokens if cfg.loss_agg.endswith("norm") else None,
      kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, entropy_coeff=cfg.entropy_coeff,
      tis_cap=_tis_cap(cfg), tis_mask_threshold=cfg.tis_mask_threshold,
      tis_mask_low=cfg.tis_mask_low, rollout_is=cfg.rollout_is,
      rollout_is_threshold=cfg.rollout_is_threshold,
      rollout_is_batch_normalize=cfg.rollout_is_batch_normalize, rollout_rs=cfg.rollout_rs,
      rollout_rs_threshold=cfg.rollout_rs_threshold,
      rollout_token_veto_threshold=cfg.rollout_token_veto_threshold,
      rollout_mode=cfg.rollout_mode)


def distill_config(cfg: TrainConfig) -> distill_lib.DistillConfig | None:
  """DistillSparse's loss settings (None when `distill=false`)."""
  if not cfg.distill:
    return None
  return distill_lib.DistillConfig(kind=cfg.distill_kind, coef=cfg.distill_coef,
                                   pg_coef=cfg.distill_pg_coef, tis_cap=cfg.distill_pg_clip,
                                   temperature=rollout_temperature(cfg),
                                   logprob_chunk=cfg.logprob_chunk,
                                   min_gap=cfg.distill_min_gap)


def distill_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """The LoRA's optimizer: `distill_lr`, reached linearly over `distill_warmup_steps` (Adam's
  first steps are full-size)."""
  lr = (optax.linear_schedule(cfg.distill_lr / cfg.distill_warmup_steps, cfg.distill_lr,
                              cfg.distill_warmup_steps)
        if cfg.distill_warmup_steps else cfg.distill_lr)
  return distill_lib.default_optimizer(lr)


def lora_config(cfg: TrainConfig) -> lora_lib.LoRAConfig:
  return lora_lib.LoRAConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets)


def engine_config(cfg: TrainConfig, **pool) -> EngineConfig:
  """The rollout engine of a run; `pool`: its KV pool (`kv_cache_bytes=` or `num_pages=`,
  from the memory plan) and any field to override (the compile plan's abstract engine passes
  `cpu_decode_weights=None`)."""
  kw = dict(num_slots=cfg.num_slots, max_seq_len=cfg.max_prompt_len + cfg.max_new_tokens,
            page_size=cfg.page_size, decode_chunk=cfg.decode_chunk,
            max_prefill_tokens=cfg.max_prefill_tokens, logprobs_topk=cfg.monitor_topk,
            cpu_decode_weights=cfg.cpu_decode_weights or None,
            cache_dtype=cfg.kv_cache_dtype or None)
  return EngineConfig(**{**kw, **pool})
