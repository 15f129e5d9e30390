"""Helpers for checkpoint tests: tiny random transformers models, their files, and GGUF copies.

Everything is built locally by the test (random init, `save_pretrained` to a temp dir); nothing
downloads. GGUF files are written with the `gguf` package's own tensor-name constants and the
Q/K row permutation of llama.cpp's converter, independently of the code under test.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch
from safetensors import safe_open

ARCHS = ("qwen3", "qwen2", "llama")


def hf_classes(arch: str):
  import transformers as tf
  return {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
          "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[arch]


def make_hf_model(arch: str, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                  hidden: int = 64, intermediate: int = 96, layers: int = 2, vocab: int = 256,
                  theta: float = 10_000.0, tie: bool = False, eps: float = 1e-6,
                  seed: int = 0, dtype=torch.float32):
  """A random transformers model; every tensor (norms and biases too) is perturbed."""
  config_cls, model_cls = hf_classes(arch)
  kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta},
            rms_norm_eps=eps, tie_word_embeddings=tie, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
  if arch == "llama":
    kw["attention_bias"] = False
  cfg = config_cls(**kw)
  torch.manual_seed(seed)
  model = model_cls(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      elif "embed" in name or "lm_head" in name:
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(p.shape[-1] ** -0.5 * torch.randn_like(p))
  return model.to(dtype).eval()


def save_hf(model, path) -> str:
  path = os.fspath(path)
  model.save_pretrained(path)
  return path


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def file_tensors(path) -> dict[str, np.ndarray]:
  """Every tensor in the safetensors files of a checkpoint directory."""
  out = {}
  for f in sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors"))):
    with safe_open(f, "numpy") as h:
      for k in h.keys():
        assert k not in out, f"tensor {k} in two files"
        out[k] = h.get_tensor(k)
  return out


def write_safetensors(path, tensors: dict[str, np.ndarray]):
  from safetensors.numpy import save_file
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(path),
            metadata={"format": "pt"})


# --- GGUF -------------------------------------------------------------------------------

def _gguf_names():
  import gguf
  t, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
  per_layer = {
      "input_layernorm.weight": names[t.ATTN_NORM] + ".weight",
      "self_attn.q_proj.weight": names[t.ATTN_Q] + ".weight",
      "self_attn.k_proj.weight": names[t.ATTN_K] + ".weight",
      "self_attn.v_proj.weight": names[t.ATTN_V] + ".weight",
      "self_attn.o_proj.weight": names[t.ATTN_OUT] + ".weight",
      "self_attn.q_proj.bias": names[t.ATTN_Q] + ".bias",
      "self_attn.k_proj.bias": names[t.ATTN_K] + ".bias",
      "self_attn.v_proj.bias": names[t.ATTN_V] + ".bias",
      "self_attn.q_norm.weight": names[t.ATTN_Q_NORM] + ".weight",
      "self_attn.k_norm.weight": names[t.ATTN_K_NORM] + ".weight",
      "post_attention_layernorm.weight": names[t.FFN_NORM] + ".weight",
      "mlp.gate_proj.weight": names[t.FFN_GATE] + ".weight",
      "mlp.up_proj.weight": names[t.FFN_UP] + ".weight",
      "mlp.down_proj.weight": names[t.FFN_DOWN] + ".weight",
  }
  top = {"model.embed_tokens.weight": names[t.TOKEN_EMBD] + ".weight",
         "model.norm.weight": names[t.OUTPUT_NORM] + ".weight",
         "lm_head.weight": names[t.OUTPUT] + ".weight"}
  return per_layer, top


def gguf_name(hf_key: str) -> str:
  per_layer, top = _gguf_names()
  if hf_key in top:
    return top[hf_key]
  _, _, i, rest = hf_key.split(".", 3)
  return per_layer[rest].format(bid=int(i))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """Row order llama.cpp's converter gives llama Q/K: pairs interleaved within each head."""
  h = w.shape[0] // heads
  idx = np.arange(h).reshape(2, h // 2).T.reshape(-1)  # new row 2j+c takes old row c*h/2+j
  return w.reshape(heads, h, *w.shape[1:])[:, idx].reshape(w.shape)


def write_gguf(path, model, arch: str, *, quant=None, meta: dict | None = None,
               drop: tuple[str, ...] = (), tensors: dict | None = None) -> str:
  """Write `model` (a transformers model) as a GGUF file the way llama.cpp lays it out.

  quant: a `gguf.GGMLQuantizationType` for the 2-D weights (default float32 everywhere).
  meta: extra/overriding metadata {key: value} (value types: int, float, str, bool).
  drop: HF keys to leave out; tensors: extra {gguf name: array} to add.
  """
  import gguf
  cfg = model.config
  path = os.fspath(path)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_bos_token_id(cfg.bos_token_id)
  w.add_eos_token_id(cfg.eos_token_id)
  w.add_pad_token_id(cfg.pad_token_id)
  for key, value in (meta or {}).items():
    if isinstance(value, bool):
      w.add_bool(key, value)
    elif isinstance(value, int):
      w.add_uint32(key, value)
    elif isinstance(value, float):
      w.add_float32(key, value)
    else:
      w.add_string(key, value)
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  if cfg.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
  for key, x in sd.items():
    if key in drop:
      continue
    if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
      heads = cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads
      x = llama_cpp_permute(x, heads)
    if quant is not None and x.ndim == 2:
      w.add_tensor(gguf_name(key), gguf.quants.quantize(x, quant), raw_dtype=quant)
    else:
      w.add_tensor(gguf_name(key), np.ascontiguousarray(x, dtype=np.float32))
  for name, x in (tensors or {}).items():
    w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
