r"""Train a Qwen3 policy with GRPO on sparse rollouts.

    python experiments/train.py                        # the embedded `tiny` default (CPU, minutes)
    python experiments/train.py --config qwen3_1p7b model_path=/ckpt/Qwen3-1.7B data=train.jsonl
    python experiments/train.py --config qwen3_14b --dry-run --num-devices 32
    python experiments/train.py --config my.yaml num_steps=2     # a YAML/JSON config file
    python experiments/train.py --config runs/tiny/config.json out_dir=runs/again  # rerun it
    python experiments/train.py --resume out_dir=runs/tiny           # continue a run
    python experiments/train.py --resume out_dir=runs/tiny num_steps=100   # ... for longer
    python experiments/train.py --config qwen3_14b --coordinator host0:1234 --num-processes 4 \
        --process-id $I          # one process per host (README: "Several hosts")

Any TrainConfig field can be overridden as key=value; unknown keys and bad values exit with 2.
An out_dir that already holds a run is refused unless --resume (continue it: its saved
config.json is the base, overrides apply on top; those that change what the run trains need
--allow-config-change and are recorded in config_changes.jsonl) or --overwrite (delete its
outputs and start over). Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and
exits with 130; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _err(msg: str) -> int:
  print(f"error: {msg}", file=sys.stderr)
  return 2


def _force_host_devices(n: int | None) -> None:
  """--dry-run --compile compiles for N devices: give XLA:CPU N host devices and its
  memory-optimized scheduler (the closest to a GPU's memory-aware one) before jax starts.
  (A process that already started jax keeps its devices; compile_plan says so.)"""
  flags = os.environ.get("XLA_FLAGS", "")
  if n and "xla_force_host_platform_device_count" not in flags:
    flags += f" --xla_force_host_platform_device_count={n}"
  if "xla_cpu_scheduler_type" not in flags:
    flags += " --xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
  os.environ["XLA_FLAGS"] = flags.strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# What `--dry-run` plans against (`run/memory.py`: usable_fraction). jax's GPU allocator
# takes 75% of the device unless told otherwise: 21 GB less than that plan on an H200.
GPU_MEMORY_FRACTION = "0.9"


def _gpu_memory_fraction() -> None:
  """A GPU run's allocator gets the fraction of device memory the memory plan counts on
  (XLA_PYTHON_CLIENT_MEM_FRACTION, unless already set); the rest holds the CUDA context and
  the cuBLAS / cuDNN workspaces. Before jax starts a backend; no effect on a CPU."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)


def _epilog() -> str:
  from sparrow_jax.run.config_help import groups_text, presets_text
  return ("presets (--config NAME):\n" + presets_text()
          + "\n\nconfig keys by group (key=value; --list-keys prints types and defaults):\n"
          + groups_text())


def _resumed_line(trainer, step: int) -> str:
  """What --resume restored, e.g. "resuming from step 60 (checkpoint runs/tiny/checkpoints/60):
  policy, optimizer, LoRA, data position, schedule constant-1; training to step 80"."""
  cfg = trainer.cfg
  parts = ["policy", "optimizer"]
  parts += ["KL reference"] if trainer.ref_params is not None else []
  parts += ["LoRA and its optimizer"] if trainer.lora is not None else []
  parts += ["ARRoL head"] if trainer.arrol is not None else []
  parts += ["data position", f"schedule {trainer.schedule.name}"]
  where = os.path.join(cfg.out_dir, "checkpoints", str(step))
  todo = (f"training to step {cfg.num_steps}" if step < cfg.num_steps
          else f"nothing left to train (num_steps={cfg.num_steps})")
  return f"resuming from step {step} (checkpoint {where}): {', '.join(parts)}; {todo}"


def _dry_run_devices(args) -> int | None:
  """--dry-run of a multi-process job: --num-devices counts every process's devices; without
  it, the mesh's size, else --num-processes x this host's devices. None: one process."""
  n = args.num_processes
  if not n or n == 1:
    return args.num_devices
  from sparrow_jax.run import sharding as sh
  from sparrow_jax.run.config import get_train_config
  mesh = sh.parse_mesh(get_train_config(args.config, args.overrides).mesh)
  if args.num_devices is not None:
    total = args.num_devices
  elif mesh.is_resolved:
    total = int(np.prod(mesh.shape))
  else:
    import jax
    total = n * jax.local_device_count()
  if total % n:
    raise ValueError(f"--num-processes {n}: {total} devices do not split evenly over the "
                     "processes; expected a multiple of it")
  print(f"dry run of {n} processes x {total // n} devices", file=sys.stderr)
  return total


def main(argv=None) -> int:
  from experiments._cli import positive
  ap = argparse.ArgumentParser(description=__doc__, epilog=_epilog(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny",
                  help="training preset (listed below) or a YAML/JSON config file, e.g. a "
                       "run's config.json; key=value overrides apply on top (default: tiny)")
  ap.add_argument("--list-keys", action="store_true",
                  help="print every config key with its type, the preset's (or file's) value "
                       "and its meaning, exit (reference: docs/config.md)")
  ap.add_argument("--resume", action="store_true",
                  help="continue the run in out_dir from its newest intact checkpoint, with "
                       "its saved config")
  ap.add_argument("--overwrite", action="store_true",
                  help="delete the outputs of an earlier run in out_dir and start over")
  ap.add_argument("--allow-config-change", action="store_true",
                  help="with --resume: accept overrides that change what the run trains")
  ap.add_argument("--dry-run", action="store_true",
                  help="abstract shapes only: print per-device memory and exit")
  ap.add_argument("--num-devices", type=positive(int), default=None,
                  help="device count for --dry-run (default: the mesh's or local devices)")
  ap.add_argument("--compile", action="store_true",
                  help="--dry-run: also compile every program of a step at the real shapes "
                       "on --num-devices (forced host) devices and print XLA's memory "
                       "analysis beside the plan (minutes)")
  ap.add_argument("--json", action="store_true",
                  help="--dry-run: end with one JSON line (fits, device memory, phases)")
  ap.add_argument("--mean-response-len", type=positive(int), default=None,
                  help="--dry-run: mean response length for the concurrency estimate "
                       "(default max_new_tokens/2)")
  ap.add_argument("--quiet", action="store_true",
                  help="no progress bar and no per-step console lines (metrics.jsonl, "
                       "TensorBoard and the final summary are still written)")
  from sparrow_jax.run import distributed
  distributed.add_cli_args(ap)
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = ap.parse_intermixed_args(argv)  # flags may come after key=value overrides
  if args.list_keys:
    from sparrow_jax.run.config_help import list_keys
    try:
      print(list_keys(args.config))
    except ValueError as e:
      return _err(str(e))
    return 0
  if (args.compile or args.json) and not args.dry_run:
    return _err("--compile and --json go with --dry-run")
  if args.compile:
    _force_host_devices(args.num_devices)
  if args.dry_run:  # abstract shapes: no job to join; the device count is all processes'
    try:
      args.num_devices = _dry_run_devices(args)
    except ValueError as e:
      return _err(str(e))
  else:
    _gpu_memory_fraction()
    try:  # first thing: before anything touches a jax backend
      distributed.initialize(**distributed.cli_kwargs(args))
    except ValueError as e:
      return _err(str(e))
    if distributed.is_multi():  # `kill -USR1 PID` prints where a process of the job waits
      import faulthandler
      import signal
      faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not distributed.is_writer():  # process 0 reports; the others only say what fails
      import logging
      logging.getLogger("sparrow_jax").setLevel(logging.ERROR)
  try:
    rc = _train(args)
  except BaseException as e:  # (peers end at once, naming this process and the cause)
    distributed.report_failure(f"{type(e).__name__}: {e}")
    raise
  if rc in (0, 130):
    distributed.finish()
  else:
    distributed.report_failure(f"exited with status {rc} (see its log)")
  return rc


def _train(args) -> int:
  from sparrow_jax.run import distributed, runs
  from sparrow_jax.run.config import get_train_config, parse_overrides
  resume = None
  try:
    if args.resume and args.overwrite:
      raise ValueError("give --resume or --overwrite, not both")
    if args.allow_config_change and not args.resume:
      raise ValueError("--allow-config-change only applies with --resume")
    cfg = get_train_config(args.config, args.overrides)
    if args.resume:
      resume = runs.resume_config(cfg.out_dir, parse_overrides(args.overrides),
                                  allow_change=args.allow_config_change)
      cfg = resume.cfg
  except (ValueError, FileNotFoundError) as e:
    return _err(str(e))
  if args.dry_run:
    from sparrow_jax.run.dry_run import dry_run
    try:
      return dry_run(cfg, num_devices=args.num_devices,
                     mean_response_len=args.mean_response_len, compile=args.compile,
                     as_json=args.json)
    except ValueError as e:
      return _err(str(e))

  found = [] if args.resume else runs.existing_run(cfg.out_dir)
  if found and not args.overwrite:  # refused before any work
    return _err(f"out_dir {cfg.out_dir} already holds a run ({', '.join(found)}); pass "
                "--resume to continue it or --overwrite to delete it and start over")
  from sparrow_jax.run.builders import preflight
  from sparrow_jax.run.trainer import Trainer, TrainingInterrupted, TrainingStopped
  try:
    checked = preflight(cfg)  # data, reward, schedule, ... before the model is built
    if found and distributed.is_writer():
      removed = runs.clear_run(cfg.out_dir)
      print(f"--overwrite: removed {', '.join(removed)} from {cfg.out_dir}", file=sys.stderr)
    if found and distributed.is_multi():  # nobody reads the old run after this
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("sparrow_jax: --overwrite")
    trainer = Trainer(cfg, quiet=args.quiet, checked=checked)
    if resume is not None:
      step = trainer.resume()
      if distributed.is_writer():
        print(_resumed_line(trainer, step), file=sys.stderr, flush=True)
      if resume.changes and distributed.is_writer():
        runs.record_config_changes(cfg.out_dir, step, resume)
        print("resume: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b)
                                     in resume.changes.items())
              + " (recorded in config_changes.jsonl)", file=sys.stderr)
  except (ValueError, FileNotFoundError) as e:
    return _err(str(e))
  hint = f"python experiments/train.py --resume out_dir={cfg.out_dir}"
  try:
    summary = trainer.fit()
  except TrainingStopped as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except TrainingInterrupted as e:
    print(f"{e.signame}: stopped after step {e.step}, checkpoint saved; resume with: {hint}",
          file=sys.stderr)
    return 130
  except KeyboardInterrupt:
    last = trainer.checkpointer.all_steps()
    print(f"stopped at once without saving step {trainer.step + 1}; "
          + (f"the newest checkpoint is step {last[-1]}; resume with: {hint}" if last
             else "no checkpoint was written yet"), file=sys.stderr)
    return 130
  if not distributed.is_writer():
    return 0
  print("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
