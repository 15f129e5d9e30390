"""A training run on disk (its `out_dir`): what marks one, starting over, resuming it with its
saved config, and loading its policy for evaluation, export and generation.

  existing_run / clear_run
        A folder holds a run when it has finalized checkpoints or a non-empty metrics.jsonl.
        `train.py` refuses such a folder unless told `--resume` or `--overwrite`;
        `clear_run` (the latter) removes only the files a run writes (RUN_OUTPUTS).
  saved_config / resume_config / record_config_changes
        `--resume` starts from the run's `config.json` (or, if that is gone, the config in
        its newest checkpoint), then applies the command line's key=value overrides. Keys in
        SAFE_TO_CHANGE say how the run is executed or logged, not what it trains; changing any
        other key (group_size, data, model, seed, lr, ...) needs `allow_change` and every
        change is appended to `config_changes.jsonl` (time, resumed step, old -> new).
  load_run_policy
        The policy of the newest intact checkpoint (optionally the sparse actor's LoRA and the
        schedule it was trained with), without the optimizer state or data position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable, Mapping

from sparrow_jax.run.config import TrainConfig, config_from_dict

RUN_OUTPUTS = ("checkpoints", "checkpoints.damaged", "metrics.jsonl", "samples.jsonl",
               "summary.json", "training.png", "config.json", "config_changes.jsonl", "tb",
               "hf", "wandb_run_id", "wandb")

# Keys that change how a run is executed, logged or how long it goes, not what it learns.
SAFE_TO_CHANGE = frozenset({
    "num_steps", "out_dir", "save_every", "keep_last", "export_hf", "export_dtype",
    "tensorboard", "logger", "wandb_project", "sample_every", "samples_per_log", "val_data",
    "val_every", "val_k", "val_max_prompts", "device_memory_gb", "mesh", "attention_backend",
    "page_scorer", "num_slots", "decode_chunk", "max_prefill_tokens", "remat", "logprob_chunk",
    "micro_batch_size", "reward_timeout_s", "max_bad_steps"})


def _checkpoint_steps(out_dir: str) -> list[int]:
  d = os.path.join(out_dir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d)
                if n.isdigit() and os.path.isdir(os.path.join(d, n)))


def existing_run(out_dir: str) -> list[str]:
  """What in `out_dir` belongs to an earlier run ([] when nothing does)."""
  found = []
  steps = _checkpoint_steps(out_dir)
  if steps:
    found.append(f"checkpoints (steps {steps[0]}..{steps[-1]})" if len(steps) > 1
                 else f"checkpoints (step {steps[0]})")
  metrics = os.path.join(out_dir, "metrics.jsonl")
  if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
    found.append("metrics.jsonl")
  return found


def clear_run(out_dir: str) -> list[str]:
  """Remove the outputs of an earlier run (RUN_OUTPUTS only; other files stay)."""
  removed = []
  for name in RUN_OUTPUTS:
    path = os.path.join(out_dir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    elif os.path.lexists(path):
      os.remove(path)
    else:
      continue
    removed.append(name)
  return removed


def saved_config(out_dir: str) -> tuple[dict[str, Any], str] | None:
  """(config dict, the file it came from) of the run in `out_dir`, or None if it has none."""
  path = os.path.join(out_dir, "config.json")
  if os.path.isfile(path):
    try:
      with open(path) as f:
        return json.load(f), path
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"cannot read {path}: {e}; fix or remove it (the newest checkpoint "
                       "also holds the config)") from None
  for step in reversed(_checkpoint_steps(out_dir)):
    meta = os.path.join(out_dir, "checkpoints", str(step), "metadata", "metadata")
    try:
      with open(meta) as f:
        cfg = json.load(f).get("config")
    except (OSError, json.JSONDecodeError, AttributeError):
      continue  # a damaged step: try an older one
    if isinstance(cfg, dict):
      return cfg, meta
  return None


def _is_safe(key: str, old: TrainConfig) -> bool:
  if key == "num_steps" and old.lr_schedule == "cosine":
    return False  # the cosine decay spans num_steps: more steps reshape the schedule
  return key in SAFE_TO_CHANGE


@dataclasses.dataclass(frozen=True)
class Resume:
  """The config a `--resume` continues with, what the command line changed ({key: (old,
  new)}) and which of those changes alter what the run trains."""
  cfg: TrainConfig
  changes: dict[str, tuple[Any, Any]]
  alters_run: tuple[str, ...]


def resume_config(out_dir: str, overrides: Mapping[str, Any], *,
                  allow_change: bool = False) -> Resume:
  """The saved config of the run in `out_dir` with `overrides` (parsed key -> value) applied.

  Raises FileNotFoundError when there is no saved config, ValueError for an unreadable one or
  for a change outside SAFE_TO_CHANGE without `allow_change`.
  """
  found = saved_config(out_dir)
  if found is None:
    raise FileNotFoundError(f"--resume: {out_dir} holds no run (no config.json and no "
                            "checkpoint); start it without --resume")
  saved, source = found
  base = config_from_dict(saved, where=source)
  overrides = dict(overrides)
  if os.path.abspath(base.out_dir) != os.path.abspath(out_dir):
    overrides.setdefault("out_dir", out_dir)  # the folder was moved: keep writing here
  new = base.replace(**overrides)
  changes = {k: (getattr(base, k), getattr(new, k)) for k in overrides
             if getattr(base, k) != getattr(new, k)}
  alters = tuple(k for k in changes if not _is_safe(k, base))
  if alters and not allow_change:
    listed = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in alters)
    raise ValueError(f"--resume: changing {listed} alters what the run in {out_dir} trains; "
                     "pass --allow-config-change to accept (it is recorded in "
                     "config_changes.jsonl), or start a new out_dir")
  return Resume(cfg=new, changes=changes, alters_run=alters)


def record_config_changes(out_dir: str, step: int, resume: Resume) -> str | None:
  """Append one line for this resume's changes to `config_changes.jsonl` (None if none)."""
  if not resume.changes:
    return None
  path = os.path.join(out_dir, "config_changes.jsonl")
  rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_step": int(step),
         "changes": {k: [a, b] for k, (a, b) in resume.changes.items()},
         "alters_run": list(resume.alters_run)}
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(rec) + "\n")
  return path


@dataclasses.dataclass
class RunPolicy:
  """A trained policy loaded from a run: the model (policy weights), its tokenizer, the
  sparse actor's LoRA when asked for, the schedule the run's actor used at `step`."""
  cfg: TrainConfig
  model: Any
  tokenizer: Any
  lora: Any
  schedule: Any
  step: int


def run_config(out_dir: str, overrides: Mapping[str, Any] = ()) -> TrainConfig:
  """The saved config of the run in `out_dir` (out_dir pointing here), with `overrides`."""
  found = saved_config(out_dir)
  if found is None:
    raise FileNotFoundError(f"{out_dir} holds no training run (no config.json and no "
                            "checkpoint); expected the out_dir of a train.py run")
  cfg = config_from_dict(found[0], where=found[1])
  return cfg.replace(**{**dict(overrides), "out_dir": out_dir})


def load_run_policy(out_dir: str, *, lora: bool = False,
                    report: Callable[[str], None] | None = None) -> RunPolicy:
  """Policy (and with `lora` the sparse actor's LoRA) of the newest intact checkpoint."""
  import jax
  from flax import nnx

  from sparrow_jax.models import lora as lora_lib
  from sparrow_jax.run.checkpointing import Checkpointer
  from sparrow_jax.run.builders import build_model, build_schedule
  from sparrow_jax.schedule.schedule import SparsitySchedule

  cfg = run_config(out_dir)
  if lora and not cfg.distill:
    raise ValueError(f"--lora: the run in {out_dir} trained no LoRA (distill=false)")
  ck_dir = os.path.join(out_dir, "checkpoints")
  if not _checkpoint_steps(out_dir):
    raise FileNotFoundError(f"no checkpoint in {ck_dir}")
  model, tokenizer = build_model(cfg)
  graphdef, params = nnx.split(model)
  abstract = {"params": params}
  if lora:
    lcfg = lora_lib.LoRAConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                               targets=cfg.lora_targets)
    abstract["lora"] = jax.eval_shape(  # shapes only: the values come from the checkpoint
        lambda: lora_lib.init_lora(model.cfg, lcfg, jax.random.PRNGKey(0)))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), abstract)
  ck = Checkpointer(ck_dir, read_only=True)  # the run may still be training
  step, state, meta, _ = ck.restore_latest_intact(abstract, partial=True, report=report)
  ck.close()
  if isinstance(meta.get("schedule"), Mapping):  # the ladder may have moved on
    schedule = SparsitySchedule.from_dict(meta["schedule"], source=f"{ck_dir}/{step}")
  else:
    schedule = build_schedule(cfg)
  return RunPolicy(cfg=cfg, model=nnx.merge(graphdef, state["params"]), tokenizer=tokenizer,
                   lora=state.get("lora"), schedule=schedule, step=step)
