"""Checkpoint I/O: local HF safetensors directories and GGUF files, plus their tokenizers.

`load_pretrained` dispatches on the path: a directory is read as a transformers checkpoint
(`hf_safetensors.load_hf_dir`), a `.gguf` file with `gguf.load_gguf`. `save_pretrained` writes
the HF format. Key names and layouts live in one table, `keymap.TABLE`.
"""

from __future__ import annotations

import os

from sparrow_jax.models.checkpoints.gguf import load_gguf
from sparrow_jax.models.checkpoints.hf_safetensors import load_hf_dir, save_hf_dir
from sparrow_jax.models.checkpoints.tokenizer import load_tokenizer
from sparrow_jax.models.decoder import Decoder


def load_pretrained(path, dtype: str = "float32", param_dtype: str | None = None) -> Decoder:
  """A `Decoder` from a local HF checkpoint directory or a local `.gguf` file.

  Raises FileNotFoundError for a missing path and ValueError for anything that is neither.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"checkpoint not found: {path} (expected an HF checkpoint "
                            "directory or a .gguf file)")
  if os.path.isdir(path):
    return load_hf_dir(path, dtype=dtype, param_dtype=param_dtype)
  if path.endswith(".gguf"):
    return load_gguf(path, dtype=dtype, param_dtype=param_dtype)[0]
  raise ValueError(f"checkpoint {path}: expected an HF checkpoint directory (config.json + "
                   "safetensors) or a .gguf file")


def save_pretrained(model: Decoder, path, *, max_shard_bytes: int | None = None,
                    overwrite: bool = False) -> list[str]:
  """Write `model` as an HF checkpoint directory; see `hf_safetensors.save_hf_dir`."""
  return save_hf_dir(model, path, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


__all__ = ["load_pretrained", "save_pretrained", "load_hf_dir", "save_hf_dir", "load_gguf",
           "load_tokenizer"]
