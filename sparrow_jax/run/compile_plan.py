"""`train.py --dry-run --compile`: every jitted program of one step, compiled ahead of time at
the preset's real shapes and mesh, and XLA's own memory analysis per device.

Nothing is allocated: parameters, optimizer state, LoRA and micro-batches are
`jax.ShapeDtypeStruct`s carrying the shardings the trainer would give them (`nnx.eval_shape`
for the model), and `jax.jit(f).lower(*abstract).compile().memory_analysis()` reports what one
device would hold: arguments, outputs, temporaries and the donated bytes outputs reuse. The
programs are the trainer's own (`run/programs.py`), so what compiles here is what runs.

Each phase is compiled at its worst micro-batch: the longest sequence a run can have
(max_prompt_len + max_new_tokens) with as many rows as the micro-batch knobs allow (the
token budget, else the micro-batch size). A program's peak per device is
`arguments + outputs + temporaries - aliased`; the phase's total adds what stays resident
while it runs but is not an argument (e.g. the optimizer state during the forward/backward).
`run/memory.py: phase_estimates` gives the analytic plan of the same peaks; the dry run prints
both side by side.

Devices: `--num-devices N` CPU devices (forced host devices when the machine has fewer: the
CLI sets `--xla_force_host_platform_device_count` before jax starts). CPU and GPU compilers
fuse differently, so the figures are XLA:CPU's reading of the GPU program; the rollout phases
run the XLA attention path here (the Pallas kernels compile only on a GPU).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import Decoder
from sparrow_jax.rl import distill as distill_lib
from sparrow_jax.rl import grpo
from sparrow_jax.models import lora as lora_lib
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.builders import build_schedule, make_optimizer
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.programs import build_programs
from sparrow_jax.schedule.schedule import attention_spec


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
  """XLA's memory analysis of one compiled program, bytes per device."""

  name: str
  arguments: int
  outputs: int
  temporaries: int
  aliased: int
  compile_s: float
  shape: str  # the micro-batch it was compiled for

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs + self.temporaries - self.aliased


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def worst_micro_batch(cfg: TrainConfig, divisor: int, *, grad: bool) -> tuple[int, int]:
  """(rows, length) of the largest micro-batch a phase can see: the longest sequence, with
  the rows the token budget (per device) or the micro-batch size allows."""
  length = cfg.max_prompt_len + cfg.max_new_tokens
  budget = (cfg.max_tokens_per_micro_batch if grad else
            (cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch))
  if budget:
    return divisor * max(1, budget // length), length
  rows = cfg.micro_batch if grad else (cfg.logprob_micro_batch_size or cfg.micro_batch)
  return rows, length


def _analyse(name: str, fn, args, shape: str) -> PhaseMemory:
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  ma = compiled.memory_analysis()
  return PhaseMemory(name=name, arguments=int(ma.argument_size_in_bytes),
                     outputs=int(ma.output_size_in_bytes),
                     temporaries=int(ma.temp_size_in_bytes),
                     aliased=int(ma.alias_size_in_bytes),
                     compile_s=time.perf_counter() - t0, shape=shape)


def training_phases(cfg: TrainConfig, mesh, *, report: Callable[[str], None] = lambda m: None
                    ) -> dict[str, PhaseMemory]:
  """Compile the training-side programs of one step on `mesh` (recompute, reference, update
  forward/backward and optimizer step, DistillSparse, ladder probe: what `cfg` enables)."""
  mcfg = get_config(cfg.model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract = nnx.split(model)
  pshard = sh.param_shardings(abstract, mesh)
  params = _abstract(abstract, pshard)
  tx, _ = make_optimizer(cfg)
  opt_abs = jax.eval_shape(tx.init, params)
  opt = _abstract(opt_abs, sh.opt_state_shardings(opt_abs, pshard, mesh, abstract))
  temperature = cfg.temperature if cfg.temperature > 0 else 1.0
  loss_cfg = grpo.GRPOLossConfig(
      eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
      agg=cfg.loss_agg, norm_len=cfg.max_new_tokens if cfg.loss_agg.endswith("norm") else None,
      kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, entropy_coeff=cfg.entropy_coeff,
      tis_cap=cfg.tis_cap, tis_mask_threshold=cfg.tis_mask_threshold)
  schedule = build_schedule(cfg)
  attention = attention_spec(schedule, backend="xla", landmark_dtype=cfg.landmark_dtype)
  dcfg = lora_tx = lora = lora_opt = None
  if cfg.distill:
    dcfg = distill_lib.DistillConfig(kind=cfg.distill_kind, coef=cfg.distill_coef,
                                     pg_coef=cfg.distill_pg_coef, tis_cap=cfg.distill_pg_clip,
                                     temperature=temperature, logprob_chunk=cfg.logprob_chunk)
    lora_tx = distill_lib.default_optimizer(cfg.distill_lr)
    lcfg = lora_lib.LoRAConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                               targets=cfg.lora_targets)
    lora_abs = jax.eval_shape(lambda: lora_lib.init_lora(mcfg, lcfg, jax.random.PRNGKey(0)))
    lshard = sh.param_shardings(lora_abs, mesh)
    lora = _abstract(lora_abs, lshard)
    lopt_abs = jax.eval_shape(lora_tx.init, lora)
    lora_opt = _abstract(lopt_abs, sh.opt_state_shardings(lopt_abs, lshard, mesh, lora_abs))
  progs = build_programs(graphdef, cfg, loss_cfg=loss_cfg, tx=tx, temperature=temperature,
                         skip_recompute=cfg.skips_recompute, attention=attention,
                         lora_tx=lora_tx, dcfg=dcfg)
  div = sh.batch_divisor(mesh)
  rows_sh = NamedSharding(mesh, P(sh.BATCH_AXES))
  rep = NamedSharding(mesh, P())

  def batch(rows, length, keys):
    spec = {"tokens": ((rows, length), jnp.int32), "lengths": ((rows,), jnp.int32),
            "prompt_lens": ((rows,), jnp.int32), "advantages": ((rows,), jnp.float32),
            "budgets": ((rows, length), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(*spec.get(k, ((rows, length), jnp.float32)),
                                    sharding=rows_sh) for k in keys}

  den = {k: jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
         for k in ("num_tokens", "num_seqs")}
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  out: dict[str, PhaseMemory] = {}

  def run(name, fn, args, rows, length):
    report(f"compiling {name} ({rows} x {length} tokens) ...")
    out[name] = _analyse(name, fn, args, f"{rows}x{length}")
    report(f"  {name}: peak {out[name].peak / 1e9:.2f} GB per device "
           f"({out[name].compile_s:.1f} s)")

  r, l = worst_micro_batch(cfg, div, grad=False)
  if not cfg.skips_recompute:
    run("recompute", progs.logprobs, (params, batch(r, l, ("tokens", "lengths"))), r, l)
  if cfg.kl_coef > 0:
    run("reference", progs.ref_logprobs, (params, batch(r, l, ("tokens", "lengths"))), r, l)
  if cfg.ladder.strip():
    from sparrow_jax.rl.switching import _probe_alpha
    cand = build_schedule(cfg, cfg.ladder.split(",")[0].strip())
    att = attention_spec(cand, max_position=l, backend="xla",
                         landmark_dtype=cfg.landmark_dtype)
    probe = jax.jit(lambda p, lo, mb, t: _probe_alpha(
        graphdef, p, lo, mb["tokens"], mb["budgets"], mb["prompt_lens"], mb["lengths"], t,
        attention=att, chunk=cfg.logprob_chunk))
    run("probe", probe, (params, lora, batch(r, l, ("tokens", "budgets", "prompt_lens",
                                                    "lengths")), scalar), r, l)
  r, l = worst_micro_batch(cfg, div, grad=True)
  keys = ["tokens", "lengths", "mask", "advantages"]
  if not cfg.skips_recompute:
    keys.append("old_logp")
  if loss_cfg.uses_rollout_correction:
    keys.append("rollout_logp")
  if cfg.kl_coef > 0:
    keys.append("ref_logp")
  run("update", progs.grad_step, (params, params, batch(r, l, keys), den), r, l)
  run("update_apply", progs.apply, (params, opt, params, scalar), r, l)
  if cfg.distill:
    dkeys = ["tokens", "mask", "old_logp", "prompt_lens", "lengths", "budgets"]
    if cfg.distill_pg_coef > 0:
      dkeys += ["advantages", "rollout_logp"]
    run("distill", progs.distill_grad,
        (lora, lora, params, batch(r, l, dkeys), {"num_tokens": scalar}), r, l)
    run("distill_apply", progs.distill_apply, (lora, lora_opt, lora, scalar), r, l)
  return out


def all_phases(cfg: TrainConfig, mesh, *, plan=None,
               report: Callable[[str], None] = lambda m: None) -> dict[str, PhaseMemory]:
  """Every program of one step that `cfg` enables (training side; see `training_phases`)."""
  return training_phases(cfg, mesh, report=report)


def check_devices(num_devices: int) -> list:
  """The first `num_devices` devices, or a clear error naming the XLA flag."""
  devs = jax.devices()
  if len(devs) < num_devices:
    raise ValueError(
        f"--compile on {num_devices} devices: this process has {len(devs)} "
        f"({devs[0].platform}); run it as `python experiments/train.py ... --dry-run --compile "
        f"--num-devices {num_devices}` (the CLI forces host devices before jax starts) or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}")
  return devs[:num_devices]


def make_compile_mesh(cfg: TrainConfig, num_devices: int):
  return sh.make_mesh(sh.parse_mesh(cfg.mesh), devices=check_devices(num_devices))
