"""`experiments/train.py --dry-run [--compile] [--json]`: per-device memory of one step.

The plan (`run/memory.py`) comes from abstract shapes only (`jax.eval_shape`, nothing
allocated, no devices needed: per-device bytes follow from the PartitionSpecs): parameters,
optimizer state, LoRA, the KV pool the rollout engine gets from what the rollout phase leaves,
and one row per phase of a step (rollout, recompute, update, DistillSparse, ...: the phases
never overlap, so the step peaks at its largest phase). With `--compile` every jitted program
of a step is compiled ahead of time at the preset's real shapes on `--num-devices` devices
(`run/compile_plan.py`) and XLA's own memory analysis is printed beside the plan's estimate of
the same program. `--json` ends the output with one JSON line:
`{"fits", "device_memory_bytes", "num_devices", "phases": {NAME: {"compiled_peak_bytes",
"planned_bytes"}}, "cpu_only_compiler_options": {NAME: options}}`; a phase compiled with
CPU-only compiler options (the decode chunk on an XLA:CPU mesh, `compile_plan.
CPU_DECODE_OPTIONS`) also has "compiler_options" and "compiled_peak_bytes_default" (the peak
as compiled without them), and the text output says so under its row. Exit status 0 when the configuration fits, 1 (with a message naming what
does not fit and the knob to change) when it does not.
"""

from __future__ import annotations

import json
import math
import os
import sys

from sparrow_jax.run import sharding as sh
from sparrow_jax.run.builders import model_config
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.memory import GB, device_memory_bytes, plan_memory


def memory_plan(cfg: TrainConfig, num_devices: int, *, mean_response_len: int | None = None,
                **kw):
  """The memory plan of a training config, as `--dry-run` prints it. The trainer calls
  `plan_for_model` with its built model config, so both size the KV pool with one model."""
  mcfg = model_config(cfg)
  return plan_for_model(cfg, mcfg, num_devices, mean_response_len=mean_response_len, **kw)


def _rows_and_len(cfg: TrainConfig, budget: int, rows: int, groups: int) -> tuple[int, int]:
  """The largest micro-batch of a phase: (global rows, padded length)."""
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  if budget:
    return groups * max(1, budget // seq), seq
  return rows, seq


def decode_backend(cfg: TrainConfig) -> str:
  """The decode attention the plan models: "xla" when the config names it, or when `auto`
  resolves to it (no GPU/TPU: this machine, unless `device_memory_gb` names a GPU target);
  else the kernels (Pallas, or the C++ CPU kernels of `cpu`: no gathered pages either)."""
  if cfg.attention_backend == "xla":
    return "xla"
  if cfg.attention_backend != "auto" or cfg.device_memory_gb:
    return "pallas"
  import jax
  return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"


def decode_pages(cfg: TrainConfig) -> int | None:
  """Pages one sparse decode step reads per sequence (None: a dense schedule)."""
  if cfg.schedule == "dense":
    return None
  from sparrow_jax.run.builders import build_schedule
  from sparrow_jax.schedule.schedule import attention_spec
  spec = attention_spec(build_schedule(cfg), backend="xla")
  return spec.max_budget + spec.reserved_bos + spec.reserved_recent


def plan_for_model(cfg: TrainConfig, mcfg, num_devices: int, *,
                   mean_response_len: int | None = None, device_bytes: float | None = None,
                   activation_dtype: str | None = None, backend: str | None = None,
                   kv_pool_pages: int | None = None):
  """`kv_pool_pages`: plan with this pool (pages per device) instead of sizing one (the
  compile report compares programs compiled at the real plan's pool)."""
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  targets = tuple(t for t in cfg.lora_targets.split(",") if t) if cfg.distill else ()
  mean_resp = mean_response_len or max(cfg.max_new_tokens // 2, 1)
  mesh = sh.parse_mesh(cfg.mesh).resolve(num_devices)
  groups = sh.batch_divisor(mesh)
  train_rows, train_len = _rows_and_len(cfg, cfg.max_tokens_per_micro_batch, cfg.micro_batch,
                                        groups)
  lp_rows, lp_len = _rows_and_len(
      cfg, cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch,
      cfg.logprob_micro_batch_size or cfg.micro_batch, groups)
  return plan_memory(
      mcfg, mesh, num_devices=num_devices, batch_slots=cfg.num_slots,
      context_len=seq, page_size=cfg.page_size, train_micro_batch=train_rows,
      train_seq_len=train_len, lora_rank=cfg.lora_rank if cfg.distill else 0,
      lora_targets=targets, reference_model=cfg.kl_coef > 0, remat=cfg.remat,
      logits_chunk=cfg.logprob_chunk,
      landmark="none" if cfg.schedule == "dense" else cfg.landmark,
      landmark_dtype=cfg.landmark_dtype, cache_dtype=cfg.kv_cache_dtype or None,
      device_bytes=(device_bytes if device_bytes is not None else
                    cfg.device_memory_gb * 1e9 or device_memory_bytes()[0]),
      kv_cache_bytes=(int(cfg.kv_cache_gb * 1e9) if cfg.kv_cache_gb and kv_pool_pages is None
                      else None),
      kv_cache_pages=kv_pool_pages,
      kv_cache_fraction=cfg.kv_cache_fraction,
      mean_context_len=min(cfg.max_prompt_len, seq) + mean_resp,
      logprob_micro_batch=lp_rows, logprob_seq_len=lp_len, logprob_topk=cfg.monitor_topk,
      skip_recompute=cfg.skips_recompute, distill=cfg.distill,
      release_kv_cache=cfg.kv_pool_released, prefill_len=cfg.max_prompt_len,
      probe=bool(cfg.ladder.strip()) or (bool(cfg.exact_alpha_every) and cfg.schedule != "dense"),
      activation_dtype=activation_dtype, decode_backend=backend or decode_backend(cfg),
      decode_pages=decode_pages(cfg), max_prefill_tokens=cfg.max_prefill_tokens)


def dry_run(cfg: TrainConfig, *, num_devices: int | None = None,
            mean_response_len: int | None = None, compile: bool = False,
            as_json: bool = False, out=None) -> int:
  out = out if out is not None else sys.stdout  # looked up per call (captured output)
  mesh = sh.parse_mesh(cfg.mesh)
  if num_devices is None:
    import jax
    from sparrow_jax.run.setup import check_rollout_devices
    check_rollout_devices(cfg)  # (K below this job's device count, one process)
    num_devices = (jax.device_count() - cfg.rollout_devices if not mesh.is_resolved
                   else math.prod(mesh.shape))
  seq = cfg.max_prompt_len + cfg.max_new_tokens
  plan = memory_plan(cfg, num_devices, mean_response_len=mean_response_len)
  name = cfg.model
  if cfg.model_path and os.path.exists(cfg.model_path):  # planned as the checkpoint it loads
    name = f"{cfg.model_path} (config.json / GGUF metadata)"
  if cfg.model_path == "random":  # builders.RANDOM_WEIGHTS
    name = f"{cfg.model} with RANDOM weights (model_path=random)"
  print(f"dry run: {name} ({plan.param_count / 1e9:.3f} B params) on {num_devices} "
        f"device(s), mesh {mesh.resolve(num_devices).describe()}, {cfg.num_slots} rollout "
        f"slots per device, sequences up to {seq} tokens, train micro-batch "
        f"{cfg.micro_batch}" + (f" / {cfg.max_tokens_per_micro_batch} tokens per device"
                                if cfg.max_tokens_per_micro_batch else ""), file=out)
  if cfg.rollout_devices:
    print(f"rollout_devices={cfg.rollout_devices}: the engine runs on {cfg.rollout_devices} "
          "device(s) of its own (the process's last ones: a replicated rollout copy of the "
          "policy and actor LoRA, the KV pool, the rollout workspaces); the learner's mesh "
          f"is the other {num_devices} (parameters, optimizer, activations). The table "
          "below is per learner device and sizes the pool as if it shared them (held "
          "through training): an upper bound for both sides.", file=out)
  print(plan.format_table(), file=out)
  c, h = plan.concurrency, plan.concurrency_held
  print(f"KV pool: {plan.kv_pool_pages} pages of {cfg.page_size} tokens per device "
        f"({plan.kv_cache_bytes / 1e9:.2f} GB, {plan.kv_bytes_per_page / 1e6:.3f} MB per "
        f"page); concurrent sequences per device: {c['at_mean']} at the mean length "
        f"{c['mean_len']} (prompt {cfg.max_prompt_len} + mean response "
        f"{c['mean_len'] - cfg.max_prompt_len}, assumed max_new_tokens/2 unless "
        f"--mean-response-len), {c['at_max']} at the maximum {c['max_len']}; "
        f"{num_devices * c['at_mean']} / {num_devices * c['at_max']} over all devices, for "
        f"{cfg.batch_size} rollouts per step", file=out)
  print(f"KV pool held through training (release_kv_cache=false): {h['at_mean']} / "
        f"{h['at_max']} concurrent sequences per device at the mean / maximum length; "
        f"released while training (release_kv_cache=true): {c['at_mean']} / {c['at_max']}"
        f"{' (this run)' if cfg.kv_pool_released else ''}", file=out)
  fits = plan.fits
  phases = {}
  if compile:
    fits &= _compile_report(cfg, num_devices, plan, phases, out)
  if not fits:
    print(f"error: {plan.message() if not plan.fits else 'the compiled programs do not fit'}",
          file=out)
  else:
    print("fits.", file=out)
  if as_json:
    print(json.dumps({"fits": bool(fits), "device_memory_bytes": int(plan.device_bytes),
                      "usable_bytes": int(plan.usable_bytes), "num_devices": num_devices,
                      "plan_peak_bytes": int(plan.total), "phases": phases,
                      # the phases compiled with CPU-only options (run/compile_plan.py)
                      "cpu_only_compiler_options": {
                          k: v["compiler_options"] for k, v in phases.items()
                          if "compiler_options" in v}}), file=out)
  return 0 if fits else 1


def _compile_report(cfg: TrainConfig, num_devices: int, plan, phases: dict, out) -> bool:
  """Compile every program, print compiled vs planned per phase; fill `phases` (JSON)."""
  from sparrow_jax.run import compile_plan
  mesh = compile_plan.make_compile_mesh(cfg, num_devices)
  # XLA:CPU computes bf16 dots in float32: compare with a plan that holds activations so.
  cpu = plan_for_model(cfg, model_config(cfg), num_devices,
                       activation_dtype="float32", backend="xla",
                       kv_pool_pages=plan.kv_pool_pages)
  say = lambda m: print(m, file=out, flush=True)
  compiled = compile_plan.all_phases(cfg, mesh, plan=plan, report=say)
  say(f"compiled programs on {num_devices} {mesh.devices.flat[0].platform} device(s) "
      f"(XLA's memory analysis, GB per device; planned = this plan with float32 activations, "
      "as XLA:CPU holds them):")
  say(f"  {'phase':<16}{'compiled':>10}{'planned':>10}{'ratio':>8}{'resident':>10}"
      f"{'total':>9}  micro-batch")
  ok = True
  for name, pm in compiled.items():
    planned = cpu.phase(name).program
    resident = plan.phase(name).resident
    total = pm.peak + resident
    ok &= total <= plan.usable_bytes
    say(f"  {name:<16}{pm.peak / GB:>10.3f}{planned / GB:>10.3f}{planned / max(pm.peak, 1):>8.2f}"
        f"{resident / GB:>10.3f}{total / GB:>9.3f}  {pm.shape} ({pm.compile_s:.0f} s)")
    phases[name] = {"compiled_peak_bytes": int(pm.peak), "planned_bytes": int(planned),
                    "resident_bytes": int(resident), "arguments_bytes": pm.arguments,
                    "outputs_bytes": pm.outputs, "temporaries_bytes": pm.temporaries,
                    "aliased_bytes": pm.aliased, "micro_batch": pm.shape}
    if pm.options:  # the CPU-only compile (compile_plan.CPU_DECODE_OPTIONS), said so
      phases[name].update(compiler_options=pm.options,
                          compiled_peak_bytes_default=int(pm.default_peak),
                          temporaries_bytes_default=int(pm.default_temporaries))
      say(f"    ^ {name}: compiled with "
          + ", ".join(f"{k}={v}" for k, v in pm.options.items())
          + f" (CPU only: {compile_plan.CPU_DECODE_WHY}); as compiled by default: peak "
          f"{pm.default_peak / GB:.3f}, total {(pm.default_peak + resident) / GB:.3f} GB "
          f"({'fits' if pm.default_peak + resident <= plan.usable_bytes else 'does not fit'})")
  worst = max(compiled.values(), key=lambda pm: pm.peak + plan.phase(pm.name).resident)
  say(f"largest compiled phase: {worst.name}, "
      f"{(worst.peak + plan.phase(worst.name).resident) / GB:.2f} GB of "
      f"{plan.usable_bytes / GB:.2f} GB usable")
  return ok
