"""Tokenizers for local checkpoints, built by transformers without touching the network.

An HF directory gives `AutoTokenizer.from_pretrained(dir)` (or, for a directory exported from
the random-init tiny model, its `ByteTokenizer`: see `byte_tokenizer.py`); a GGUF file gives the
tokenizer transformers reconstructs from the file's `tokenizer.ggml.*` metadata
(`AutoTokenizer.from_pretrained(parent_dir, gguf_file=name)`). Both run with
`local_files_only=True`, so a missing file is an error rather than a download. `save_tokenizer`
writes either kind (with its chat template) beside exported weights.
"""

from __future__ import annotations

import os

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path):
  """transformers tokenizer for an HF checkpoint directory or a `.gguf` file (a `ByteTokenizer`
  for a directory holding `sparrow_tokenizer.json`).

  Raises:
    FileNotFoundError: the path does not exist, or the directory has no tokenizer files.
    ValueError: the path is a file that is not a `.gguf`.
  """
  from sparrow_jax.models.checkpoints.byte_tokenizer import ByteTokenizer, is_byte_tokenizer_dir

  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"tokenizer source not found: {path} (expected an HF checkpoint "
                            "directory or a .gguf file)")
  if is_byte_tokenizer_dir(path):
    return ByteTokenizer.from_pretrained(path)
  from transformers import AutoTokenizer  # (seconds to import: not for a ByteTokenizer)

  if os.path.isdir(path):
    present = [n for n in _TOKENIZER_FILES if os.path.exists(os.path.join(path, n))]
    if not present:
      raise FileNotFoundError(f"no tokenizer in {path}: expected one of {list(_TOKENIZER_FILES)}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
  if not path.endswith(".gguf"):
    raise ValueError(f"tokenizer source {path}: expected an HF checkpoint directory or a .gguf "
                     "file")
  parent, name = os.path.split(os.path.abspath(path))
  return AutoTokenizer.from_pretrained(parent, gguf_file=name, local_files_only=True)


def save_tokenizer(tokenizer, path, *, model_max_length: int | None = None) -> list[str]:
  """Write `tokenizer` (a `ByteTokenizer` or a transformers tokenizer, chat template
  included) into directory `path`, where `load_tokenizer(path)` reads it back."""
  path = os.fspath(path)
  if hasattr(tokenizer, "_marker"):  # ByteTokenizer
    return tokenizer.save_pretrained(path, model_max_length=model_max_length)
  if not hasattr(tokenizer, "save_pretrained"):
    raise ValueError(f"save_tokenizer: {type(tokenizer).__name__} has no save_pretrained; "
                     "expected a ByteTokenizer or a transformers tokenizer")
  return [os.path.basename(f) for f in tokenizer.save_pretrained(path)]
