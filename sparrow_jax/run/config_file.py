"""Config files: `--config my.yaml` / `--config runs/x/config.json` (issue 50).

A file is a mapping of `TrainConfig` keys, read with PyYAML (JSON is YAML, so a run's own
`config.json` reads the same way). One extra key, `preset`, names the preset the file starts
from (default `tiny`, as without `--config`); every other key must be a `TrainConfig` field:

    preset: qwen3_1p7b
    model_path: /ckpt/Qwen3-1.7B
    data: /data/gsm8k_train.jsonl
    num_steps: 200

Unknown keys, and values of the wrong type, are errors naming the file, the line and the key
(a misspelt key gets the closest field as a suggestion). `key=value` overrides from the
command line apply on top of the file.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Callable

PRESET_KEY = "preset"
EXTENSIONS = (".yaml", ".yml", ".json")


def is_config_file(name: str) -> bool:
  """`--config NAME` names a file (not a preset): a YAML/JSON extension or a path."""
  return name.lower().endswith(EXTENSIONS) or os.sep in name or "/" in name


def _read_mapping(path: str) -> tuple[dict[str, Any], dict[str, int]]:
  """The file's top-level mapping and the 1-based line of each key."""
  import yaml

  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config {path}: no such file (expected a preset name or a "
                            "YAML/JSON config file)")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    data = yaml.safe_load(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ValueError(f"{where}: not valid YAML/JSON ({problem})") from None
  if data is None:
    return {}, {}
  if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
    raise ValueError(f"{path}: expected a mapping of config keys (key: value), got "
                     f"{type(data).__name__}")
  lines = {k.value: k.start_mark.line + 1 for k, _ in node.value
           if isinstance(k, yaml.ScalarNode)}
  return data, lines


def _coerce(field: dataclasses.Field, value: Any, where: str, hints: dict,
            parse_value: Callable) -> Any:
  """A file value as the field's type (`hints`: the config class's type hints): strings parse
  as on the command line (`parse_value`: `1e-6`, `true`), ints widen to floats; anything else
  of the wrong type is an error."""
  tp = hints[field.name]
  args = typing.get_args(tp)
  optional = type(None) in args
  base = next((a for a in args if a is not type(None)), tp) if args else tp
  if value is None:
    if optional:
      return None
    raise ValueError(f"{where}: {field.name}: null is not allowed; expected {base.__name__}")
  if isinstance(value, str) and base is not str:
    try:
      return parse_value(field, value)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
  if base is bool and isinstance(value, bool):
    return value
  if base is int and isinstance(value, int) and not isinstance(value, bool):
    return value
  if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if base is str and isinstance(value, str):
    return value
  if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)  # e.g. `dense_layers: 0`
  raise ValueError(f"{where}: {field.name}={value!r}: expected {base.__name__}"
                   + (" or null" if optional else ""))


def load_config_file(path: str, overrides: dict[str, Any] | None, *, config_cls: type,
                     presets: dict, parse_value: Callable, close_keys: Callable):
  """The config a YAML/JSON file describes, `overrides` (parsed `key=value`) on top.
  `config_cls` (TrainConfig), `presets`, `parse_value` and `close_keys` come from
  `run/config.py`, which calls this (this module imports nothing of the package)."""
  data, lines = _read_mapping(path)
  fields = {f.name: f for f in dataclasses.fields(config_cls)}
  hints = typing.get_type_hints(config_cls)
  preset = data.pop(PRESET_KEY, "tiny")
  if preset not in presets:
    raise ValueError(f"{path}:{lines.get(PRESET_KEY, 1)}: preset={preset!r}: unknown training "
                     f"preset; valid presets: {sorted(presets)}")
  values = {}
  for key, value in data.items():
    where = f"{path}:{lines.get(key, 1)}"
    if not isinstance(key, str) or key not in fields:
      close = close_keys(str(key), list(fields) + [PRESET_KEY])
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ValueError(f"{where}: unknown config key {key!r}{hint}; `python "
                       "experiments/train.py --list-keys` lists every key")
    values[key] = _coerce(fields[key], value, where, hints, parse_value)
  values.update(overrides or {})
  try:
    return presets[preset].replace(**values)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
