"""Tokenizers for local checkpoints, built by transformers without touching the network.

An HF directory gives `AutoTokenizer.from_pretrained(dir)`; a GGUF file gives the tokenizer
transformers reconstructs from the file's `tokenizer.ggml.*` metadata
(`AutoTokenizer.from_pretrained(parent_dir, gguf_file=name)`). Both run with
`local_files_only=True`, so a missing file is an error rather than a download.
"""

from __future__ import annotations

import os

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path):
  """transformers tokenizer for an HF checkpoint directory or a `.gguf` file.

  Raises:
    FileNotFoundError: the path does not exist, or the directory has no tokenizer files.
    ValueError: the path is a file that is not a `.gguf`.
  """
  from transformers import AutoTokenizer

  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"tokenizer source not found: {path} (expected an HF checkpoint "
                            "directory or a .gguf file)")
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
