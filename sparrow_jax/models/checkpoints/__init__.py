"""Checkpoint I/O: local HF safetensors directories and GGUF files, plus their tokenizers.

`load_pretrained` dispatches on the path: a directory is read as a transformers checkpoint
(`hf_safetensors.load_hf_dir`), a `.gguf` file with `gguf.load_gguf`. `save_pretrained` writes
the HF format (optionally cast to another dtype, with the tokenizer and its chat template
beside the weights). Key names and layouts live in one table, `keymap.TABLE`.
"""

from __future__ import annotations

import os

from sparrow_jax.models.checkpoints.gguf import load_gguf
from sparrow_jax.models.checkpoints.gguf import read_config as gguf_read_config
from sparrow_jax.models.checkpoints.hf_safetensors import load_hf_dir, save_hf_dir
from sparrow_jax.models.checkpoints.hf_safetensors import read_config as hf_read_config
from sparrow_jax.models.checkpoints.tokenizer import load_tokenizer, save_tokenizer
from sparrow_jax.models.config import ModelConfig
from sparrow_jax.models.decoder import Decoder


def _checkpoint_kind(path) -> tuple[str, str]:
  """(path, "hf" | "gguf") of a local checkpoint; FileNotFoundError for a missing path,
  ValueError for anything that is neither an HF directory nor a `.gguf` file."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"checkpoint not found: {path} (expected an HF checkpoint "
                            "directory or a .gguf file)")
  if os.path.isdir(path):
    return path, "hf"
  if path.endswith(".gguf"):
    return path, "gguf"
  raise ValueError(f"checkpoint {path}: expected an HF checkpoint directory (config.json + "
                   "safetensors) or a .gguf file")


def load_pretrained(path, dtype: str = "float32", param_dtype: str | None = None) -> Decoder:
  """A `Decoder` from a local HF checkpoint directory or a local `.gguf` file.

  Raises FileNotFoundError for a missing path and ValueError for anything that is neither.
  """
  path, kind = _checkpoint_kind(path)
  if kind == "hf":
    return load_hf_dir(path, dtype=dtype, param_dtype=param_dtype)
  return load_gguf(path, dtype=dtype, param_dtype=param_dtype)[0]


def checkpoint_config(path, dtype: str = "float32", param_dtype: str | None = None
                      ) -> ModelConfig:
  """The `ModelConfig` `load_pretrained(path)` would build, read from the checkpoint's
  config.json or GGUF metadata without reading its weights (the memory plan of a run sizes
  the model it will load). Raises as `load_pretrained` does for a path that is neither."""
  path, kind = _checkpoint_kind(path)
  read = hf_read_config if kind == "hf" else gguf_read_config
  return read(path, dtype=dtype, param_dtype=param_dtype)


_EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def cast_params(model: Decoder, dtype: str) -> Decoder:
  """A copy of `model` whose floating-point weights are stored as `dtype` (config follows)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  if dtype not in _EXPORT_DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {_EXPORT_DTYPES}")
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                       else x, state)
  out = nnx.merge(graphdef, state)
  out.cfg = model.cfg.replace(param_dtype=dtype)
  return out


def save_pretrained(model: Decoder, path, *, max_shard_bytes: int | None = None,
                    overwrite: bool = False, tokenizer=None,
                    dtype: str | None = None) -> list[str]:
  """Write `model` as an HF checkpoint directory; see `hf_safetensors.save_hf_dir`.

  `dtype` casts the stored weights (default: the model's `param_dtype`); `tokenizer` (a
  transformers tokenizer or the tiny model's `ByteTokenizer`) is written beside them, chat
  template included, so `load_tokenizer(path)` and transformers read the directory alone.
  """
  if dtype is not None and dtype != model.cfg.param_dtype:
    model = cast_params(model, dtype)
  written = save_hf_dir(model, path, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
  if tokenizer is not None:
    written += save_tokenizer(tokenizer, path,
                              model_max_length=model.cfg.max_position_embeddings)
  return written


__all__ = ["load_pretrained", "save_pretrained", "load_hf_dir", "save_hf_dir", "load_gguf",
           "load_tokenizer", "save_tokenizer", "cast_params"]
