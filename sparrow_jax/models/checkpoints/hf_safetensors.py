"""Local transformers checkpoints: a directory with `config.json` and safetensors weights.

`load_hf_dir` reads a single `model.safetensors` or a sharded set described by
`model.safetensors.index.json`; `save_hf_dir` writes the same format back (sharded when the
weights exceed `max_shard_bytes`). Tensor names and layouts come from `keymap.TABLE`; the
conversion only reshapes and transposes, so load -> save -> load is bit-exact. Nothing here
downloads: a path that is not a local directory is an error.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from sparrow_jax.models.checkpoints import keymap
from sparrow_jax.models.config import ModelConfig, from_hf_config, to_hf_config
from sparrow_jax.models.decoder import Decoder

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _read_index(index_path: str) -> dict[str, str]:
  """`model.safetensors.index.json` -> {tensor name: shard file name}."""
  try:
    with open(index_path) as f:
      index = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"malformed safetensors index {index_path}: {e}") from None
  wm = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(wm, dict) or not wm:
    raise ValueError(f"malformed safetensors index {index_path}: expected a non-empty "
                     f"'weight_map' object {{tensor name: shard file}}, found {wm!r}")
  for k, v in wm.items():
    if not isinstance(v, str) or os.path.basename(v) != v:
      raise ValueError(f"malformed safetensors index {index_path}: weight_map[{k!r}]={v!r}, "
                       "expected a shard file name in the same directory")
  return wm


def _weight_files(path: str) -> dict[str, str]:
  """{tensor name: absolute file} for the checkpoint in directory `path`."""
  single = os.path.join(path, SINGLE_NAME)
  index_path = os.path.join(path, INDEX_NAME)
  if os.path.exists(single):
    with _open(single) as f:
      return {k: single for k in f.keys()}
  if os.path.exists(index_path):
    wm = _read_index(index_path)
    files = {}
    for name, shard in wm.items():
      files[name] = os.path.join(path, shard)
    for shard in sorted(set(files.values())):
      if not os.path.exists(shard):
        raise FileNotFoundError(f"safetensors shard {shard} listed in {index_path} not found")
    return files
  found = sorted(os.listdir(path))
  hint = (" (only PyTorch .bin weights found: convert them to safetensors)"
          if any(n.endswith(".bin") for n in found) else "")
  raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_NAME} or {INDEX_NAME}, "
                          f"found {found}{hint}")


@contextlib.contextmanager
def _open(file: str):
  """safe_open with errors that name the file (truncated or corrupt headers included)."""
  try:
    handle = safe_open(file, framework="numpy")
  except Exception as e:  # safetensors raises its own SafetensorError and OSError subclasses
    raise ValueError(f"cannot read safetensors file {file}: {e}") from None
  with handle as f:
    yield f


def _check_dir(path) -> str:
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"HF checkpoint directory not found: {path}")
  if not os.path.isdir(path):
    raise ValueError(f"HF checkpoint {path}: expected a directory with {CONFIG_NAME} and "
                     "safetensors weights, found a file")
  if not os.path.exists(os.path.join(path, CONFIG_NAME)):
    raise FileNotFoundError(f"{os.path.join(path, CONFIG_NAME)} not found: an HF checkpoint "
                            "directory needs transformers' config.json beside the weights")
  return path


def read_config(path, *, dtype: str = "float32", param_dtype: str | None = None
                ) -> ModelConfig:
  """The `ModelConfig` of an HF checkpoint directory, from its config.json (no weights read);
  named after the directory."""
  path = _check_dir(path)
  return from_hf_config(os.path.join(path, CONFIG_NAME),
                        name=os.path.basename(os.path.normpath(path)), dtype=dtype,
                        param_dtype=param_dtype)


def load_hf_dir(path, *, dtype: str = "float32", param_dtype: str | None = None) -> Decoder:
  """Load a local HF checkpoint directory into a `Decoder`.

  Args:
    path: directory holding `config.json` and `model.safetensors` (or a sharded set with
      `model.safetensors.index.json`).
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the weights (default: `dtype`); stored tensors are cast.
  Raises:
    FileNotFoundError: missing directory, config or weight files.
    ValueError: malformed index, unreadable/truncated safetensors, unsupported config field,
      missing/unexpected tensor or wrong shape (each named).
  """
  path = _check_dir(path)
  cfg = read_config(path, dtype=dtype, param_dtype=param_dtype)
  files = _weight_files(path)
  with contextlib.ExitStack() as stack:
    handles = {}

    def get(name: str) -> np.ndarray:
      file = files[name]
      if file not in handles:
        handles[file] = stack.enter_context(_open(file))
      try:
        return handles[file].get_tensor(name)
      except Exception as e:
        raise ValueError(f"cannot read tensor {name} from {file}: {e}") from None

    def display(name: str) -> str:
      return f"{name} (in {os.path.basename(files[name])})" if name in files else name

    return keymap.params_from_hf(cfg, files.keys(), get, source=path, display=display)


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> list[list[str]]:
  """Greedy split of the (ordered) tensor names into shards of at most max_shard_bytes."""
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    return [list(tensors)]
  shards, cur, size = [], [], 0
  for name, t in tensors.items():
    if cur and size + t.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(name)
    size += t.nbytes
  shards.append(cur)
  return shards


def _existing_weights(path: str) -> list[str]:
  return sorted(n for n in os.listdir(path)
                if n == INDEX_NAME or (n.startswith("model") and n.endswith(".safetensors")))


def _save_file(tensors: dict[str, np.ndarray], file: str, *, metadata: dict) -> None:
  """safetensors' `save_file`, with the mode any other file of the directory gets (0644 under
  the usual umask 022): safetensors creates its file 0600 whatever the umask, so an exported
  model was readable only by its owner while config.json and the tokenizer were not."""
  save_file(tensors, file, metadata=metadata)
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(file, 0o666 & ~mask)


def save_hf_dir(model: Decoder, path, *, max_shard_bytes: int | None = None,
                overwrite: bool = False) -> list[str]:
  """Write `model` as a transformers checkpoint directory (config.json + safetensors).

  Args:
    model: the decoder; weights are written in their storage dtype.
    path: output directory (created if needed).
    max_shard_bytes: split into `model-0000k-of-0000n.safetensors` + index when the weights
      are larger than this; default one `model.safetensors`.
    overwrite: replace weight files already in `path`; without it they are an error, so a
      checkpoint already written is never lost.
  Returns:
    the names of the files written.
  """
  if max_shard_bytes is not None and max_shard_bytes <= 0:
    raise ValueError(f"save_hf_dir: max_shard_bytes={max_shard_bytes}, expected > 0 or None")
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"save_hf_dir: {path} is a file, expected a directory")
  os.makedirs(path, exist_ok=True)
  old = _existing_weights(path)
  if old and not overwrite:
    raise FileExistsError(f"save_hf_dir: {path} already holds weights {old}; pass "
                          "overwrite=True to replace them")
  for n in old:
    os.remove(os.path.join(path, n))

  tensors = keymap.hf_from_params(model)
  shards = _shards(tensors, max_shard_bytes)
  meta = {"format": "pt"}
  written = [CONFIG_NAME]
  cfg_dict: dict[str, Any] = to_hf_config(model.cfg)
  with open(os.path.join(path, CONFIG_NAME), "w") as f:
    json.dump(cfg_dict, f, indent=2)
    f.write("\n")
  if len(shards) == 1:
    _save_file(tensors, os.path.join(path, SINGLE_NAME), metadata=meta)
    return written + [SINGLE_NAME]
  weight_map = {}
  n = len(shards)
  for k, names in enumerate(shards, start=1):
    fname = f"model-{k:05d}-of-{n:05d}.safetensors"
    _save_file({name: tensors[name] for name in names}, os.path.join(path, fname),
               metadata=meta)
    weight_map.update({name: fname for name in names})
    written.append(fname)
  index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
           "weight_map": weight_map}
  with open(os.path.join(path, INDEX_NAME), "w") as f:
    json.dump(index, f, indent=2)
    f.write("\n")
  return written + [INDEX_NAME]
