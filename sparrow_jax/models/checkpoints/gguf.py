"""Local GGUF (llama.cpp) checkpoints: architectures `llama`, `qwen2` and `qwen3`.

`load_gguf` reads the architecture from the file's metadata (`{arch}.block_count`,
`.embedding_length`, `.feed_forward_length`, `.attention.head_count[_kv]`, `.rope.freq_base`,
`.attention.layer_norm_rms_epsilon`, `.context_length`), dequantizes every tensor to float32 with
the `gguf` package, renames it through `keymap.TABLE` and builds a `Decoder`.

llama.cpp's converter stores the Q and K projection rows of `llama` models permuted, because its
rope rotates adjacent pairs (x0, x1), (x2, x3), ... where HF rotates the two halves of each head
(x_i, x_{i+H/2}). `unpermute_llama_qk` undoes that. `qwen2`/`qwen3` use the half-rotation in
llama.cpp too, so their rows are stored as in HF.

Settings the decoder does not implement (rope scaling, sliding windows, experts, partial rotary)
are refused with the metadata key named; so are unknown architectures and quantization types
the `gguf` package cannot dequantize.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from sparrow_jax.models.checkpoints import keymap
from sparrow_jax.models.config import ModelConfig
from sparrow_jax.models.decoder import Decoder

# architecture -> (attention_bias, qk_norm): what the llama.cpp graph of each one computes.
ARCHITECTURES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}
# Short metadata arrays are returned; token lists and merges are left to the tokenizer.
_MAX_META_ARRAY = 1024


def unpermute_llama_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation; `w` is `[heads * H, D]` (or `[heads * H]`).

  Within each head llama.cpp stores row r = 2j + c (pair j, member c) where HF has row
  c * H/2 + j; reading `[heads, H/2, 2, ...]` and swapping the two middle axes restores HF.
  """
  if w.shape[0] % (2 * heads):
    raise ValueError(f"cannot un-permute a Q/K tensor of shape {w.shape} for {heads} heads: "
                     "rows must be a multiple of 2 * heads")
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_llama_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """The permutation llama.cpp's converter applies (inverse of `unpermute_llama_qk`)."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _value(field) -> Any:
  """A metadata field as a Python value; float32 scalars as their shortest decimal."""
  import gguf
  val = field.contents()
  if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
    # 1e-5 stored as float32 reads back as 9.99999974e-06; keep the value that was written.
    val = float(str(np.float32(val)))
  return val


def _metadata(reader) -> dict[str, Any]:
  import gguf
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
      if len(field.data) > _MAX_META_ARRAY:
        continue
    out[key] = _value(field)
  return out


def _config(path: str, meta: dict[str, Any], names: set[str], vocab_rows: int | None,
            n_tokens: int | None, dtype: str, param_dtype: str | None) -> ModelConfig:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: unsupported GGUF architecture general.architecture={arch!r}; "
                     f"expected one of {sorted(ARCHITECTURES)}")

  def need(suffix: str):
    key = f"{arch}.{suffix}"
    if key not in meta:
      raise ValueError(f"{path}: GGUF metadata {key} missing (needed for the config)")
    return meta[key]

  def refuse(key: str, why: str):
    raise ValueError(f"{path}: unsupported GGUF metadata {key}={meta[key]!r}: {why}")

  scaling = meta.get(f"{arch}.rope.scaling.type")
  if scaling not in (None, "none"):
    refuse(f"{arch}.rope.scaling.type", "rope scaling is not implemented")
  for key in (f"{arch}.attention.sliding_window", f"{arch}.attention.sliding_window_pattern"):
    if meta.get(key):
      refuse(key, "sliding-window attention is not implemented")
  for key in (f"{arch}.expert_count", f"{arch}.expert_used_count"):
    if meta.get(key):
      refuse(key, "mixture-of-experts is not implemented")

  hidden = int(need("embedding_length"))
  heads = int(need("attention.head_count"))
  kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
  head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
  vlen = meta.get(f"{arch}.attention.value_length")
  if vlen is not None and int(vlen) != head_dim:
    refuse(f"{arch}.attention.value_length", f"expected the key length {head_dim}")
  rot = meta.get(f"{arch}.rope.dimension_count")
  if rot is not None and int(rot) != head_dim:
    refuse(f"{arch}.rope.dimension_count", f"partial rotary embeddings are not implemented "
           f"(expected head_dim={head_dim})")
  if vocab_rows is None:
    raise ValueError(f"{path}: tensor token_embd.weight missing")
  if n_tokens is not None and n_tokens > vocab_rows:
    raise ValueError(f"{path}: tokenizer.ggml.tokens has {n_tokens} tokens, more than the "
                     f"{vocab_rows} rows of token_embd.weight")
  declared = meta.get(f"{arch}.vocab_size")
  if declared is not None and int(declared) != vocab_rows:
    raise ValueError(f"{path}: {arch}.vocab_size={declared} but token_embd.weight has "
                     f"{vocab_rows} rows")
  bias, qk_norm = ARCHITECTURES[arch]
  eos = meta.get("tokenizer.ggml.eos_token_id")
  return ModelConfig(
      name=os.path.splitext(os.path.basename(path))[0], vocab_size=vocab_rows,
      hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
      num_layers=int(need("block_count")), num_heads=heads, num_kv_heads=kv_heads,
      head_dim=head_dim, rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
      rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
      max_position_embeddings=int(need("context_length")),
      tie_word_embeddings="output.weight" not in names, attention_bias=bias, qk_norm=qk_norm,
      dtype=dtype, param_dtype=param_dtype or dtype,
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def _open_reader(path: str):
  import gguf

  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:
    raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def _file_config(path: str, reader, dtype: str, param_dtype: str | None
                 ) -> tuple[ModelConfig, dict[str, Any], dict]:
  meta = _metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  embed = tensors.get("token_embd.weight")
  # GGUF shapes are listed innermost first: token_embd is [D, V].
  vocab_rows = int(embed.shape[-1]) if embed is not None else None
  tok = reader.fields.get("tokenizer.ggml.tokens")
  n_tokens = len(tok.data) if tok is not None else None
  return (_config(path, meta, set(tensors), vocab_rows, n_tokens, dtype, param_dtype), meta,
          tensors)


def read_config(path, *, dtype: str = "float32", param_dtype: str | None = None
                ) -> ModelConfig:
  """The `ModelConfig` of a GGUF file, from its metadata (the weights are not read)."""
  path = os.fspath(path)
  return _file_config(path, _open_reader(path), dtype, param_dtype)[0]


def load_gguf(path, *, dtype: str = "float32",
              param_dtype: str | None = None) -> tuple[Decoder, dict[str, Any]]:
  """Load a local GGUF file into a `Decoder`.

  Args:
    path: the `.gguf` file.
    dtype: compute dtype; param_dtype: storage dtype of the weights (default `dtype`).
  Returns:
    (model, metadata): metadata holds the file's key/value fields (arrays longer than
    1024 entries, such as the token list, are left out).
  Raises:
    FileNotFoundError for a missing file; ValueError for an unreadable file, an unsupported
    architecture, metadata setting or quantization type, and a missing, unexpected or wrongly
    shaped tensor (each named).
  """
  import gguf

  path = os.fspath(path)
  cfg, meta, tensors = _file_config(path, _open_reader(path), dtype, param_dtype)
  arch = meta["general.architecture"]

  hf_names = {}
  for name in tensors:
    hf = keymap.gguf_to_hf(name)
    if hf is None:
      if name == "rope_freqs.weight" or name.endswith(".rope_freqs.weight"):
        raise ValueError(f"{path}: tensor {name} (rope frequency factors, i.e. rope scaling) "
                         "is not supported")
      raise ValueError(f"{path}: unexpected tensor {name} (no row for it in keymap.TABLE)")
    hf_names[hf] = name

  def get(hf_key: str) -> np.ndarray:
    t = tensors[hf_names[hf_key]]
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise ValueError(f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                       "which the gguf package cannot dequantize") from None
    w = np.asarray(w, dtype=np.float32)
    if arch == "llama" and hf_key.endswith(("q_proj.weight", "k_proj.weight")):
      heads = cfg.num_heads if hf_key.endswith("q_proj.weight") else cfg.num_kv_heads
      if w.ndim == 2 and w.shape[0] == heads * cfg.head_dim:
        w = unpermute_llama_qk(w, heads)
      # otherwise the shape check in keymap reports the mismatch
    return w

  def display(hf_key: str) -> str:
    return f"{hf_names.get(hf_key) or keymap.hf_to_gguf(hf_key)} ({hf_key})"

  model = keymap.params_from_hf(cfg, hf_names.keys(), get, source=path, display=display)
  return model, meta
