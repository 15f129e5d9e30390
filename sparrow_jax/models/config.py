"""Model configuration: a frozen, keyword-only `ModelConfig`, named presets and HF config import.

The decoder (`decoder.py`) covers the Qwen3 family and, through two flags, the Qwen2 and Llama
families: `qk_norm` (Qwen3's per-head RMSNorm on queries and keys) and `attention_bias` (Qwen2's
bias on the q/k/v projections). Everything else that changes the math (rope scaling, sliding
windows, mixture of experts) is refused by `from_hf_config` with the offending field named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a decoder-only transformer (Qwen3 / Qwen2 / Llama).

  `dtype` is the activation/computation dtype; `param_dtype` the storage dtype of weights.
  Softmax, norms, logits and losses always accumulate in float32 regardless of `dtype`.
  """

  name: str = "custom"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 40_960
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"ModelConfig.{f}={v!r}: expected a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta={self.rope_theta!r}: expected > 0")
    if not self.rms_norm_eps > 0:
      raise ValueError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps!r}: expected > 0")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in _DTYPES:
        raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}: expected one of {_DTYPES}")
    if isinstance(self.eos_token_ids, int):
      object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
    object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

  @property
  def group_size(self) -> int:
    """Query heads per KV head (the GQA group)."""
    return self.num_heads // self.num_kv_heads

  @property
  def kv_width(self) -> int:
    """D in the paper's cost model: kv_heads * head_dim."""
    return self.num_kv_heads * self.head_dim

  def num_params(self, include_embeddings: bool = True) -> int:
    """Exact parameter count of the decoder built from this config."""
    h, d = self.hidden_size, self.head_dim
    attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
    if self.attention_bias:
      attn += d * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * d
    mlp = 3 * h * self.intermediate_size
    layer = attn + mlp + 2 * h
    total = self.num_layers * layer + h  # final norm
    if include_embeddings:
      total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
    return total

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


# Published values of the Qwen3 dense family (config.json of each Qwen/Qwen3-* release).
_QWEN3_COMMON = dict(vocab_size=151_936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40_960, attention_bias=False, qk_norm=True,
                     head_dim=128, num_kv_heads=8, bos_token_id=151_643,
                     eos_token_ids=(151_645, 151_643), pad_token_id=151_643)

PRESETS: dict[str, ModelConfig] = {
    "qwen3_0p6b": ModelConfig(name="qwen3_0p6b", hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, tie_word_embeddings=True,
                              **_QWEN3_COMMON),
    "qwen3_1p7b": ModelConfig(name="qwen3_1p7b", hidden_size=2048, intermediate_size=6144,
                              num_layers=28, num_heads=16, tie_word_embeddings=True,
                              **_QWEN3_COMMON),
    "qwen3_4b": ModelConfig(name="qwen3_4b", hidden_size=2560, intermediate_size=9728,
                            num_layers=36, num_heads=32, tie_word_embeddings=True,
                            **_QWEN3_COMMON),
    "qwen3_8b": ModelConfig(name="qwen3_8b", hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, tie_word_embeddings=False,
                            **_QWEN3_COMMON),
    "qwen3_14b": ModelConfig(name="qwen3_14b", hidden_size=5120, intermediate_size=17408,
                             num_layers=40, num_heads=40, tie_word_embeddings=False,
                             **_QWEN3_COMMON),
    "qwen3_32b": ModelConfig(name="qwen3_32b", hidden_size=5120, intermediate_size=25600,
                             num_layers=64, num_heads=64, tie_word_embeddings=False,
                             **_QWEN3_COMMON),
    # SmolLM2-135M-Instruct (Llama architecture): no qk-norm, no bias, tied head, 8K context.
    "smollm2_135m": ModelConfig(name="smollm2_135m", vocab_size=49_152, hidden_size=576,
                                intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, rope_theta=100_000.0,
                                rms_norm_eps=1e-5, max_position_embeddings=8192,
                                tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                                bos_token_id=1, eos_token_ids=(2,), pad_token_id=2),
    # Random-weight Qwen3 for CPU tests and the embedded training default.
    "tiny": ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        rope_theta=10_000.0, max_position_embeddings=4096,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
                        pad_token_id=0),
}


def get_config(name: str, **overrides) -> ModelConfig:
  """Named preset, optionally with field overrides; unknown names list the valid ones."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
  cfg = PRESETS[name]
  if overrides:
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
      raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}")
    cfg = cfg.replace(**overrides)
  return cfg


# --- transformers config.json import -----------------------------------------------------

_SUPPORTED_ARCHS = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
                    "LlamaForCausalLM": "llama"}
_SUPPORTED_MODEL_TYPES = {"qwen3", "qwen2", "llama"}
# Fields that carry no math for the architectures above (bookkeeping, generation defaults).
_BENIGN = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "attention_dropout", "hidden_act", "max_window_layers", "use_sliding_window",
    "sliding_window", "layer_types", "rope_theta", "rope_scaling", "rope_parameters",
    "rms_norm_eps", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "pretraining_tp", "_name_or_path",
    "output_attentions", "output_hidden_states", "return_dict", "is_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "chunk_size_feed_forward", "name_or_path",
    "keys_to_ignore_at_inference", "bad_words_ids", "begin_suppress_tokens", "_attn_implementation_autoset",
    "use_return_dict", "tf_legacy_loss", "torchscript", "pruned_heads", "cross_attention_hidden_size",
    "add_cross_attention", "is_encoder_decoder", "decoder_start_token_id", "prefix",
    "sep_token_id", "task_specific_params", "finetuning_task", "use_bfloat16",
}


def _refuse(field: str, value: Any, why: str):
  raise ValueError(f"unsupported HF config field {field}={value!r}: {why}")


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], *, name: str = "hf",
                   dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
  """Build a `ModelConfig` from a transformers `config.json` (path, directory or dict).

  Accepts both the old top-level `rope_theta` and transformers 5's
  `rope_parameters: {rope_theta, rope_type}`. Refuses, naming the field, anything that changes
  the math and is not implemented: rope scaling other than 'default', sliding windows, MoE,
  unknown activations, MLP bias.
  """
  if isinstance(path_or_dict, Mapping):
    cfg = dict(path_or_dict)
  else:
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
      p = os.path.join(p, "config.json")
    if not os.path.exists(p):
      raise FileNotFoundError(f"HF config not found: {p}")
    try:
      with open(p) as f:
        cfg = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"malformed HF config {p}: {e}") from None

  mt = cfg.get("model_type")
  if mt not in _SUPPORTED_MODEL_TYPES:
    _refuse("model_type", mt, f"expected one of {sorted(_SUPPORTED_MODEL_TYPES)}")
  for arch in cfg.get("architectures") or []:
    if arch not in _SUPPORTED_ARCHS:
      _refuse("architectures", arch, f"expected one of {sorted(_SUPPORTED_ARCHS)}")

  # Rope: old form (rope_theta + rope_scaling) or new form (rope_parameters).
  rope_theta = cfg.get("rope_theta")
  rp = cfg.get("rope_parameters")
  if rp is not None:
    if not isinstance(rp, Mapping):
      _refuse("rope_parameters", rp, "expected a mapping")
    if "full_attention" in rp and isinstance(rp["full_attention"], Mapping):
      rp = rp["full_attention"]
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
      _refuse("rope_parameters.rope_type", rtype, "only 'default' RoPE is implemented")
    extra = set(rp) - {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    if extra:
      _refuse("rope_parameters", sorted(extra), "rope scaling parameters are not implemented")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
      _refuse("rope_parameters.partial_rotary_factor", rp["partial_rotary_factor"],
              "only full rotary embeddings are implemented")
    rope_theta = rp.get("rope_theta", rope_theta)
  rs = cfg.get("rope_scaling")
  if rs is not None:
    rtype = rs.get("rope_type", rs.get("type")) if isinstance(rs, Mapping) else rs
    if rtype not in (None, "default"):
      _refuse("rope_scaling", rs, "rope scaling is not implemented")
  if rope_theta is None:
    rope_theta = 10_000.0

  if cfg.get("use_sliding_window"):
    _refuse("use_sliding_window", True, "sliding-window attention is not implemented")
  sw = cfg.get("sliding_window")
  if sw is not None and mt == "llama":
    _refuse("sliding_window", sw, "sliding-window attention is not implemented")
  for lt in cfg.get("layer_types") or []:
    if lt != "full_attention":
      _refuse("layer_types", lt, "only 'full_attention' layers are implemented")
  act = cfg.get("hidden_act", "silu")
  if act != "silu":
    _refuse("hidden_act", act, "only 'silu' (SwiGLU) is implemented")
  if cfg.get("mlp_bias"):
    _refuse("mlp_bias", True, "MLP bias is not implemented")
  if cfg.get("pretraining_tp", 1) not in (1, None):
    _refuse("pretraining_tp", cfg["pretraining_tp"], "expected 1")
  for k, v in cfg.items():
    if k in _BENIGN:
      continue
    if "expert" in k or k.startswith("moe") or k in ("router_aux_loss_coef", "decoder_sparse_step"):
      if v not in (None, 0, False, [], 1) or "num_experts" in k:
        _refuse(k, v, "mixture-of-experts is not implemented")
    if k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
             "partial_rotary_factor", "rope_interleave", "mla", "kv_lora_rank"):
      if v is not None:
        _refuse(k, v, "not implemented for this architecture")

  heads = int(cfg["num_attention_heads"])
  hidden = int(cfg["hidden_size"])
  head_dim = cfg.get("head_dim") or hidden // heads
  eos = cfg.get("eos_token_id")
  eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
  attention_bias = bool(cfg.get("attention_bias", mt == "qwen2"))
  if mt == "qwen2" and "attention_bias" not in cfg:
    attention_bias = True  # Qwen2 always has q/k/v bias
  return ModelConfig(
      name=name, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
      intermediate_size=int(cfg["intermediate_size"]),
      num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(head_dim),
      rope_theta=float(rope_theta), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      attention_bias=attention_bias, qk_norm=(mt == "qwen3"), dtype=dtype,
      param_dtype=param_dtype or dtype, bos_token_id=cfg.get("bos_token_id"),
      eos_token_ids=eos_ids, pad_token_id=cfg.get("pad_token_id"))


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """transformers `config.json` dict for `cfg` (Qwen3, or Qwen2/Llama by the flags)."""
  if cfg.qk_norm:
    mt, arch = "qwen3", "Qwen3ForCausalLM"
  elif cfg.attention_bias:
    mt, arch = "qwen2", "Qwen2ForCausalLM"
  else:
    mt, arch = "llama", "LlamaForCausalLM"
  out = {
      "architectures": [arch], "model_type": mt, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
      "torch_dtype": cfg.param_dtype, "use_cache": True,
  }
  if mt == "llama":
    out["mlp_bias"] = False
  if cfg.bos_token_id is not None:
    out["bos_token_id"] = cfg.bos_token_id
  if cfg.eos_token_ids:
    out["eos_token_id"] = (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1
                           else list(cfg.eos_token_ids))
  if cfg.pad_token_id is not None:
    out["pad_token_id"] = cfg.pad_token_id
  return out
