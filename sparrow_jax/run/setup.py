"""Building a run's pieces before the first step: the mesh and its checks, the memory the plan
is checked against, optimizer states placed on the mesh, the sparse actor's LoRA, the
prompt sets."""

from __future__ import annotations

import os

import jax
import numpy as np

from sparrow_jax.models import lora as lora_lib
from sparrow_jax.rl import data as data_lib
from sparrow_jax.run import algorithm
from sparrow_jax.run import distributed
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.builders import fit_prompts
from sparrow_jax.run.memory import device_memory_bytes


def enable_compile_cache(path: str) -> str:
  """Turn on JAX's persistent compilation cache in `path` (created) for every program that
  takes >= 1 s to compile; returns the absolute path. Works as long as nothing has compiled
  with a cache directory set before (JAX initialises its cache once, at the first compile
  that has one)."""
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


def learner_device_count(cfg) -> int:
  """Devices the training mesh may use: all of the job's, less `rollout_devices`."""
  return jax.device_count() - cfg.rollout_devices


def check_rollout_devices(cfg) -> None:
  """`rollout_devices=K`: one process, and at least one device left for the learner."""
  k = cfg.rollout_devices
  if not k:
    return
  if distributed.is_multi():
    raise ValueError(
        f"rollout_devices={k} with {jax.process_count()} processes: not supported; a "
        "multi-host run rolls out on every process's devices between the learner's steps "
        "(use rollout_devices=0)")
  if k >= jax.device_count():
    raise ValueError(f"rollout_devices={k}: this process has {jax.device_count()} device(s); "
                     f"expected at most {jax.device_count() - 1} (the learner needs the rest; "
                     "rollout_devices=0 time-shares them)")


def build_mesh(cfg) -> jax.sharding.Mesh:
  """The training mesh `cfg.mesh` over this job's devices (less the engine's
  `rollout_devices`), refused when it cannot be run."""
  check_rollout_devices(cfg)
  mesh_cfg = sh.parse_mesh(cfg.mesh)
  avail = learner_device_count(cfg)
  n_mesh = int(np.prod(mesh_cfg.shape)) if mesh_cfg.is_resolved else avail
  if n_mesh > avail:
    raise ValueError(f"mesh={cfg.mesh!r} needs {n_mesh} devices; {avail} available" +
                     (f" ({jax.device_count()} less rollout_devices={cfg.rollout_devices})"
                      if cfg.rollout_devices else ""))
  if distributed.is_multi():
    if n_mesh != jax.device_count():
      raise ValueError(f"mesh={cfg.mesh!r} has {n_mesh} devices; a run over "
                       f"{jax.process_count()} processes needs all {jax.device_count()} "
                       "of theirs (e.g. mesh=data=-1)")
    if cfg.arrol:
      raise ValueError(f"arrol=true with {jax.process_count()} processes: ARRoL's head "
                       "and calibrator are trained on one process's rollouts; expected "
                       "arrol=false in a multi-process run (not supported yet)")
  return sh.make_mesh(mesh_cfg, devices=jax.devices()[:n_mesh])


def rollout_mesh(mesh, rollout_devices: int = 0) -> jax.sharding.Mesh:
  """The engine's devices: this process's part of the mesh (each process rolls out its
  share of the prompts on its own devices; the producer gathers the completions), or with
  `rollout_devices=K` the process's last K devices, which the training mesh leaves out."""
  if rollout_devices:
    return jax.sharding.Mesh(np.asarray(jax.devices()[-rollout_devices:]), ("rollout",))
  mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  return jax.sharding.Mesh(np.asarray(mine), ("rollout",))


def plan_device(mesh, cfg) -> tuple[dict, str]:
  """The memory the plan is checked against: this machine's (an accelerator's limit, or the
  host RAM available on CPU, where XLA holds bf16 activations in float32);
  `device_memory_gb` only where the device reports none. -> (plan kwargs, where from)."""
  dev = mesh.devices.flat[0]
  nbytes, where = device_memory_bytes(dev, fallback=cfg.device_memory_gb * 1e9)
  return ({"device_bytes": nbytes,
           "activation_dtype": "float32" if dev.platform == "cpu" else None}, where)


def check_memory(plan, source: str) -> None:
  if not plan.fits:
    raise ValueError(f"{plan.message()} [per device: {source}; plan: "
                     "python experiments/train.py --dry-run with the same arguments]")


def init_opt(tx, params, mesh):
  """(`tx.init(params)`, its shardings) placed explicitly: moments like their parameters,
  counters replicated on the mesh. (Left to jit, a counter comes out on one device,
  uncommitted; restored from a checkpoint it is committed there, which a multi-process
  program over the global mesh refuses.)"""
  shardings = sh.opt_state_shardings(jax.eval_shape(tx.init, params),
                                     jax.tree.map(lambda x: x.sharding, params), mesh, params)
  return jax.jit(tx.init, out_shardings=shardings)(params), shardings


def build_lora(cfg, model_cfg, mesh):
  """DistillSparse's LoRA, its optimizer and optimizer state, placed on `mesh`."""
  lora = lora_lib.init_lora(model_cfg, algorithm.lora_config(cfg),
                            jax.random.PRNGKey(cfg.seed + 7))
  lora = sh.shard_tree(lora, sh.param_shardings(lora, mesh))
  lora_tx = algorithm.distill_optimizer(cfg)
  lora_opt_state, _ = init_opt(lora_tx, lora, mesh)
  return lora, lora_opt_state, lora_tx


def load_prompts(cfg, tokenizer, checked, with_dataset: bool):
  """-> (examples, dropped count, validation examples, dataset or None): the prompts that fit
  `max_prompt_len`, refused when too few remain for a step."""
  examples = fit_prompts(tokenizer, checked.examples, cfg, "data")
  val = fit_prompts(tokenizer, checked.val_examples, cfg, "val_data")
  if cfg.val_max_prompts:
    val = val[:cfg.val_max_prompts]
  if cfg.val_data and with_dataset and not val:
    raise ValueError(f"val_data={cfg.val_data!r}: no prompt fits max_prompt_len="
                     f"{cfg.max_prompt_len}")
  dataset = None
  if with_dataset:
    if len(examples) < cfg.prompts_per_step:
      raise ValueError(f"only {len(examples)} prompts fit max_prompt_len="
                       f"{cfg.max_prompt_len}; need at least prompts_per_step="
                       f"{cfg.prompts_per_step}")
    dataset = data_lib.PromptDataset(examples, batch_size=cfg.prompts_per_step, seed=cfg.seed)
  return examples, len(checked.examples) - len(examples), val, dataset
