"""The one table between checkpoint tensor names and decoder parameter paths.

Every loader and saver goes through `TABLE`: one row per tensor kind, naming the transformers
key, the decoder's `nnx.Param` path, the GGUF (llama.cpp) tensor name and the `Rule` that turns
the HF layout into the decoder layout and back. Rules only reshape and transpose, so a round
trip HF -> decoder -> HF is bit-exact.

HF stores `nn.Linear` weights as `[out, in]`; the decoder keeps einsum layouts whose names end
in their axes (D hidden, N query heads, K kv heads, H head_dim, F intermediate, V vocab):

  q_proj.weight [N*H, D]  <->  q_DNH [D, N, H]        (HEADS_IN)
  o_proj.weight [D, N*H]  <->  o_NHD [N, H, D]        (HEADS_OUT)
  q_proj.bias   [N*H]     <->  q_bias_NH [N, H]       (HEADS_BIAS)
  gate_proj.weight [F, D] <->  gate_DF [D, F]         (TRANSPOSE)
  norms, embeddings            unchanged              (COPY)

GGUF tensors, once dequantized by the `gguf` package, are in HF's `[out, in]` order (llama's Q/K
rows additionally permuted; `gguf.py` undoes that before applying the rule here).

`params_from_hf` builds a `Decoder` from any source of HF-named tensors and checks names and
shapes; `hf_from_params` is its inverse, used by the saver.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.models.config import ModelConfig
from sparrow_jax.models.decoder import Decoder

Shape = tuple[int, ...]
ParamPath = tuple  # e.g. ("layers", 3, "attn", "q_DNH")


@dataclasses.dataclass(frozen=True)
class Rule:
  """Exact layout change between an HF tensor and a decoder parameter.

  Every function takes the decoder parameter's shape, so one rule serves q (N heads) and k/v
  (K heads) alike.
  """

  name: str
  hf_shape: Callable[[Shape], Shape]  # param shape -> HF shape
  to_param: Callable[[np.ndarray, Shape], np.ndarray]  # HF array -> param array
  to_hf: Callable[[np.ndarray], np.ndarray]  # param array -> HF array


COPY = Rule("copy", lambda s: tuple(s), lambda x, s: x, lambda p: p)
# [out, in] <-> [in, out]
TRANSPOSE = Rule("transpose", lambda s: (s[1], s[0]), lambda x, s: x.T, lambda p: p.T)
# [heads*H, D] <-> [D, heads, H]
HEADS_IN = Rule(
    "heads_in", lambda s: (s[1] * s[2], s[0]),
    lambda x, s: x.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
    lambda p: p.transpose(1, 2, 0).reshape(p.shape[1] * p.shape[2], p.shape[0]))
# [D, N*H] <-> [N, H, D]
HEADS_OUT = Rule(
    "heads_out", lambda s: (s[2], s[0] * s[1]),
    lambda x, s: x.T.reshape(s),
    lambda p: p.reshape(p.shape[0] * p.shape[1], p.shape[2]).T)
# [heads*H] <-> [heads, H]
HEADS_BIAS = Rule(
    "heads_bias", lambda s: (s[0] * s[1],),
    lambda x, s: x.reshape(s),
    lambda p: p.reshape(-1))


@dataclasses.dataclass(frozen=True)
class Entry:
  """One row of the table; `{i}` stands for the layer index in all three names."""

  hf: str
  param: str
  gguf: str
  rule: Rule


_L = "model.layers.{i}."
TABLE: tuple[Entry, ...] = (
    Entry("model.embed_tokens.weight", "embed_VD", "token_embd.weight", COPY),
    Entry(_L + "input_layernorm.weight", "layers.{i}.input_norm.scale",
          "blk.{i}.attn_norm.weight", COPY),
    Entry(_L + "self_attn.q_proj.weight", "layers.{i}.attn.q_DNH", "blk.{i}.attn_q.weight",
          HEADS_IN),
    Entry(_L + "self_attn.k_proj.weight", "layers.{i}.attn.k_DKH", "blk.{i}.attn_k.weight",
          HEADS_IN),
    Entry(_L + "self_attn.v_proj.weight", "layers.{i}.attn.v_DKH", "blk.{i}.attn_v.weight",
          HEADS_IN),
    Entry(_L + "self_attn.o_proj.weight", "layers.{i}.attn.o_NHD",
          "blk.{i}.attn_output.weight", HEADS_OUT),
    Entry(_L + "self_attn.q_proj.bias", "layers.{i}.attn.q_bias_NH", "blk.{i}.attn_q.bias",
          HEADS_BIAS),
    Entry(_L + "self_attn.k_proj.bias", "layers.{i}.attn.k_bias_KH", "blk.{i}.attn_k.bias",
          HEADS_BIAS),
    Entry(_L + "self_attn.v_proj.bias", "layers.{i}.attn.v_bias_KH", "blk.{i}.attn_v.bias",
          HEADS_BIAS),
    Entry(_L + "self_attn.q_norm.weight", "layers.{i}.attn.q_norm.scale",
          "blk.{i}.attn_q_norm.weight", COPY),
    Entry(_L + "self_attn.k_norm.weight", "layers.{i}.attn.k_norm.scale",
          "blk.{i}.attn_k_norm.weight", COPY),
    Entry(_L + "post_attention_layernorm.weight", "layers.{i}.post_attn_norm.scale",
          "blk.{i}.ffn_norm.weight", COPY),
    Entry(_L + "mlp.gate_proj.weight", "layers.{i}.mlp.gate_DF", "blk.{i}.ffn_gate.weight",
          TRANSPOSE),
    Entry(_L + "mlp.up_proj.weight", "layers.{i}.mlp.up_DF", "blk.{i}.ffn_up.weight",
          TRANSPOSE),
    Entry(_L + "mlp.down_proj.weight", "layers.{i}.mlp.down_FD", "blk.{i}.ffn_down.weight",
          TRANSPOSE),
    Entry("model.norm.weight", "final_norm.scale", "output_norm.weight", COPY),
    Entry("lm_head.weight", "lm_head_DV", "output.weight", TRANSPOSE),
)

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
# Derived buffers some older checkpoints carry; they hold no weights and are skipped.
IGNORED_HF = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _regex(template: str) -> re.Pattern:
  return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + r"\Z")


_HF_RE = [(_regex(e.hf), e) for e in TABLE]
_GGUF_RE = [(_regex(e.gguf), e) for e in TABLE]
_PARAM_RE = [(_regex(e.param), e) for e in TABLE]


def _path_str(path: ParamPath) -> str:
  return ".".join(str(p) for p in path)


def _str_path(s: str) -> ParamPath:
  return tuple(int(p) if p.isdigit() else p for p in s.split("."))


def _match(table, name: str):
  for rx, e in table:
    m = rx.match(name)
    if m:
      return e, (m.group(1) if m.groups() else None)
  return None, None


def param_to_hf(path: ParamPath) -> tuple[str, Rule]:
  """Decoder parameter path -> (HF key, rule)."""
  e, i = _match(_PARAM_RE, _path_str(path))
  if e is None:
    raise ValueError(f"decoder parameter {_path_str(path)!r} has no row in the checkpoint "
                     "key table (keymap.TABLE)")
  return e.hf.replace("{i}", i or ""), e.rule


def hf_to_param(key: str) -> tuple[ParamPath, Rule] | None:
  """HF key -> (decoder parameter path, rule), or None for a key outside the table."""
  e, i = _match(_HF_RE, key)
  if e is None:
    return None
  return _str_path(e.param.replace("{i}", i or "")), e.rule


def gguf_to_hf(name: str) -> str | None:
  """GGUF tensor name -> HF key, or None for a name outside the table."""
  e, i = _match(_GGUF_RE, name)
  return None if e is None else e.hf.replace("{i}", i or "")


def hf_to_gguf(key: str) -> str | None:
  """HF key -> GGUF tensor name, or None for a key outside the table."""
  e, i = _match(_HF_RE, key)
  return None if e is None else e.gguf.replace("{i}", i or "")


def is_ignored(key: str) -> bool:
  return any(rx.fullmatch(key) for rx in IGNORED_HF)


def _abstract_params(cfg: ModelConfig):
  """(graphdef, abstract Param state, other state) without allocating weights."""
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract, nnx.Param, ...)


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, Shape]:
  """HF key -> expected HF shape for every tensor a checkpoint of `cfg` must hold."""
  _, params, _ = _abstract_params(cfg)
  out = {}
  for path, var in nnx.to_flat_state(params):
    key, rule = param_to_hf(path)
    out[key] = rule.hf_shape(tuple(var.get_value().shape))
  return out


def _names(keys: Iterable[str], limit: int = 8) -> str:
  keys = sorted(keys)
  more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
  return ", ".join(keys[:limit]) + more


def params_from_hf(cfg: ModelConfig, keys: Iterable[str],
                   get_tensor: Callable[[str], np.ndarray], *, source: str,
                   display: Callable[[str], str] | None = None) -> Decoder:
  """Build a `Decoder` of `cfg` from HF-named tensors.

  Args:
    cfg: the architecture (its `param_dtype` is the storage dtype of the result).
    keys: every tensor name the source holds.
    get_tensor: reads one tensor (HF layout) by name.
    source: the checkpoint, for error messages.
    display: how to name a tensor in errors (default its HF key), e.g. with its file or its
      GGUF name.
  Raises:
    ValueError naming the tensor for a missing, unexpected or wrongly shaped tensor, and for an
    `lm_head.weight` that differs from the embeddings when the config ties them.
  """
  display = display or (lambda k: k)
  graphdef, params, rest = _abstract_params(cfg)
  flat = list(nnx.to_flat_state(params))
  wanted = {}
  for path, var in flat:
    key, rule = param_to_hf(path)
    wanted[key] = (path, rule, var)
  keys = set(keys)
  arch = (f"{cfg.num_layers} layers, attention_bias={cfg.attention_bias}, "
          f"qk_norm={cfg.qk_norm}, tie_word_embeddings={cfg.tie_word_embeddings}")
  missing = set(wanted) - keys
  if missing:
    raise ValueError(f"{source}: missing tensor(s) {_names(map(display, missing))} "
                     f"(expected by the config: {arch})")
  extra = {k for k in keys - set(wanted) if not is_ignored(k)}
  tied_head = cfg.tie_word_embeddings and LM_HEAD_KEY in extra
  if tied_head:
    extra.discard(LM_HEAD_KEY)
  if extra:
    raise ValueError(f"{source}: unexpected tensor(s) {_names(map(display, extra))} "
                     f"(not used by the config: {arch})")
  pdtype = jnp.dtype(cfg.param_dtype)
  values = {}
  for key, (path, rule, var) in wanted.items():
    pshape = tuple(var.get_value().shape)
    x = np.asarray(get_tensor(key))
    expect = rule.hf_shape(pshape)
    if tuple(x.shape) != expect:
      raise ValueError(f"{source}: tensor {display(key)} has shape {tuple(x.shape)}, "
                       f"expected {expect} from the config")
    values[path] = jnp.asarray(np.ascontiguousarray(rule.to_param(x, pshape)), dtype=pdtype)
    if key == EMBED_KEY and tied_head:
      head = np.asarray(get_tensor(LM_HEAD_KEY))
      if head.shape != x.shape or not np.array_equal(head, x):
        raise ValueError(f"{source}: tensor {LM_HEAD_KEY} differs from {EMBED_KEY} but the "
                         "config has tie_word_embeddings=True; expected equal tensors or no "
                         f"{LM_HEAD_KEY}")
  loaded = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in flat])
  return nnx.merge(graphdef, loaded, rest)


def hf_from_params(model: Decoder) -> dict[str, np.ndarray]:
  """Decoder -> {HF key: numpy array in HF layout}, in the parameters' storage dtype."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key, rule = param_to_hf(path)
    out[key] = np.ascontiguousarray(rule.to_hf(np.asarray(var.get_value())))
  return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(key: str):
  """Embeddings, then layers in numeric order, then final norm and head."""
  m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
  if m:
    return (1, int(m.group(1)), m.group(2))
  return (0 if key == EMBED_KEY else 2, 0, key)
