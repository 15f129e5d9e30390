"""`experiments/train.py --dry-run`: abstract shapes only, per-device memory against the device.

Builds the model with `jax.eval_shape` (no weights are allocated), applies the mesh and the
partition rules for the requested device count (fake CPU devices are not even needed: the
per-device bytes follow from the PartitionSpecs), and prints parameters, optimizer state,
LoRA, KV cache at batch x context, and an activation estimate. Exit status 0 when the
configuration fits, 1 (with a message naming what does not fit) when it does not.
"""

from __future__ import annotations

import math
import sys

import jax

from sparrow_jax.models.config import get_config
from sparrow_jax.rl import sharding as sh
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.memory import plan_memory


def dry_run(cfg: TrainConfig, *, num_devices: int | None = None, out=sys.stdout) -> int:
  mcfg = get_config(cfg.model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  mesh = sh.parse_mesh(cfg.mesh)
  if num_devices is None:
    num_devices = (jax.device_count() if not mesh.is_resolved else math.prod(mesh.shape))
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  targets = tuple(t for t in cfg.lora_targets.split(",") if t) if cfg.distill else ()
  plan = plan_memory(
      mcfg, mesh, num_devices=num_devices, batch_slots=cfg.num_slots, context_len=seq,
      page_size=cfg.page_size, train_micro_batch=cfg.micro_batch,
      train_seq_len=seq, lora_rank=cfg.lora_rank if cfg.distill else 0, lora_targets=targets,
      reference_model=cfg.kl_coef > 0, remat=cfg.remat, logits_chunk=cfg.logprob_chunk,
      landmark=cfg.landmark, device_bytes=cfg.device_memory_gb * 1e9)
  print(f"dry run: {cfg.model} ({plan.param_count / 1e9:.3f} B params) on {num_devices} "
        f"device(s), mesh {mesh.resolve(num_devices).describe()}, {cfg.num_slots} rollout "
        f"slots x {seq} tokens, train micro-batch {cfg.micro_batch}",
        file=out)
  print(plan.format_table(), file=out)
  if not plan.fits:
    print(f"error: {plan.message()}", file=out)
    return 1
  print("fits.", file=out)
  return 0
