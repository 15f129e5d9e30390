"""`experiments/train.py --dry-run`: abstract shapes only, per-device memory against the device.

Builds the model with `jax.eval_shape` (no weights are allocated), applies the mesh and the
partition rules for the requested device count (fake CPU devices are not even needed: the
per-device bytes follow from the PartitionSpecs), and prints parameters, optimizer state,
LoRA, an activation estimate, and the KV pool the rollout engine gets from what is left (with
how many sequences it holds at the mean and the maximum length). Exit status 0 when the
configuration fits, 1 (with a message naming what does not fit) when it does not.
"""

from __future__ import annotations

import math
import sys

import jax

from sparrow_jax.models.config import get_config
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.memory import plan_memory


def memory_plan(cfg: TrainConfig, num_devices: int, *, mean_response_len: int | None = None):
  """The memory plan of a training config, as `--dry-run` prints it. The trainer calls
  `plan_for_model` with its built model config, so both size the KV pool with one model."""
  mcfg = get_config(cfg.model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  return plan_for_model(cfg, mcfg, num_devices, mean_response_len=mean_response_len)


def plan_for_model(cfg: TrainConfig, mcfg, num_devices: int, *,
                   mean_response_len: int | None = None):
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  targets = tuple(t for t in cfg.lora_targets.split(",") if t) if cfg.distill else ()
  mean_resp = mean_response_len or max(cfg.max_new_tokens // 2, 1)
  return plan_memory(
      mcfg, sh.parse_mesh(cfg.mesh), num_devices=num_devices, batch_slots=cfg.num_slots,
      context_len=seq, page_size=cfg.page_size, train_micro_batch=cfg.micro_batch,
      train_seq_len=seq, lora_rank=cfg.lora_rank if cfg.distill else 0, lora_targets=targets,
      reference_model=cfg.kl_coef > 0, remat=cfg.remat, logits_chunk=cfg.logprob_chunk,
      landmark="none" if cfg.schedule == "dense" else cfg.landmark,
      landmark_dtype=cfg.landmark_dtype,
      device_bytes=cfg.device_memory_gb * 1e9,
      kv_cache_bytes=int(cfg.kv_cache_gb * 1e9) if cfg.kv_cache_gb else None,
      kv_cache_fraction=cfg.kv_cache_fraction,
      mean_context_len=min(cfg.max_prompt_len, seq) + mean_resp)


def dry_run(cfg: TrainConfig, *, num_devices: int | None = None,
            mean_response_len: int | None = None, out=None) -> int:
  out = out if out is not None else sys.stdout  # looked up per call (captured output)
  mesh = sh.parse_mesh(cfg.mesh)
  if num_devices is None:
    num_devices = (jax.device_count() if not mesh.is_resolved else math.prod(mesh.shape))
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  plan = memory_plan(cfg, num_devices, mean_response_len=mean_response_len)
  print(f"dry run: {cfg.model} ({plan.param_count / 1e9:.3f} B params) on {num_devices} "
        f"device(s), mesh {mesh.resolve(num_devices).describe()}, {cfg.num_slots} rollout "
        f"slots per device, sequences up to {seq} tokens, train micro-batch "
        f"{cfg.micro_batch}", file=out)
  print(plan.format_table(), file=out)
  c = plan.concurrency
  print(f"KV pool: {plan.kv_pool_pages} pages of {cfg.page_size} tokens per device "
        f"({plan.kv_cache_bytes / 1e9:.2f} GB, {plan.kv_bytes_per_page / 1e6:.3f} MB per "
        f"page); concurrent sequences per device: {c['at_mean']} at the mean length "
        f"{c['mean_len']} (prompt {cfg.max_prompt_len} + mean response "
        f"{c['mean_len'] - cfg.max_prompt_len}, assumed max_new_tokens/2 unless "
        f"--mean-response-len), {c['at_max']} at the maximum {c['max_len']}; "
        f"{num_devices * c['at_mean']} / {num_devices * c['at_max']} over all devices, for "
        f"{cfg.batch_size} rollouts per step", file=out)
  if not plan.fits:
    print(f"error: {plan.message()}", file=out)
    return 1
  print("fits.", file=out)
  return 0
