"""Checkpoint I/O: the key table, HF/GGUF loaders' errors, presets vs published configs.

Logit parity lives in `test_parity.py`; here each bad input must fail with a message that names
what is wrong (file, tensor, field; expected and found).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import (PRESETS, Decoder, checkpoint_config, from_hf_config, get_config,
                                init_model, load_pretrained, load_tokenizer, save_pretrained)
from sparrow_jax.models.checkpoints import gguf as gguf_ckpt
from sparrow_jax.models.checkpoints import keymap, load_gguf, load_hf_dir

try:
  from . import hf_utils
except ImportError:
  import hf_utils


# --- presets vs published config.json ---------------------------------------------------

def _qwen3_json(hidden, inter, layers, heads, tie, window_layers):
  """config.json of the Qwen/Qwen3-* dense releases (transformers 4.51 format)."""
  return {
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
      "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
      "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden,
      "initializer_range": 0.02, "intermediate_size": inter,
      "max_position_embeddings": 40960, "max_window_layers": window_layers,
      "model_type": "qwen3", "num_attention_heads": heads, "num_hidden_layers": layers,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
      "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": tie,
      "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
      "use_sliding_window": False, "vocab_size": 151936}


PUBLISHED = {
    "qwen3_0p6b": _qwen3_json(1024, 3072, 28, 16, True, 28),
    "qwen3_1p7b": _qwen3_json(2048, 6144, 28, 16, True, 28),
    "qwen3_4b": _qwen3_json(2560, 9728, 36, 32, True, 36),
    "qwen3_8b": _qwen3_json(4096, 12288, 36, 32, False, 36),
    "qwen3_14b": _qwen3_json(5120, 17408, 40, 40, False, 40),
    "qwen3_32b": _qwen3_json(5120, 25600, 64, 64, False, 64),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2_135m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 576, "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False,
        "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True,
        "vocab_size": 49152},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_equal_published_configs(name):
  cfg = from_hf_config(PUBLISHED[name], name=name)
  preset = PRESETS[name]
  # Qwen3's config.json names one EOS and no pad; generation_config.json adds 151643 for both,
  # which is what the presets carry. Everything that shapes the math must be equal.
  assert cfg.eos_token_ids[0] == preset.eos_token_ids[0]
  assert cfg == preset.replace(eos_token_ids=cfg.eos_token_ids, pad_token_id=cfg.pad_token_id)


def test_qwen3_0p6b_param_count():
  # 0.6B: 596M parameters (0.44B non-embedding) as published on the model card.
  cfg = PRESETS["qwen3_0p6b"]
  assert round(cfg.num_params() / 1e6) == 596
  assert round(cfg.num_params(include_embeddings=False) / 1e8) == 4


def test_unknown_preset_lists_valid_names():
  with pytest.raises(ValueError, match="unknown model preset 'qwen3_1b'") as e:
    get_config("qwen3_1b")
  for valid in ("qwen3_0p6b", "qwen3_32b", "smollm2_135m", "tiny"):
    assert valid in str(e.value)


# --- the key table ----------------------------------------------------------------------

def test_keymap_covers_every_param_both_ways():
  for cfg in (get_config("tiny"), get_config("tiny", tie_word_embeddings=False,
                                             attention_bias=True, qk_norm=False)):
    model = init_model(cfg)
    hf = keymap.hf_from_params(model)
    assert set(hf) == set(keymap.expected_hf_shapes(cfg))
    assert ("lm_head.weight" in hf) == (not cfg.tie_word_embeddings)
    for key, x in hf.items():
      path, _ = keymap.hf_to_param(key)
      assert keymap.param_to_hf(path)[0] == key
      assert keymap.gguf_to_hf(keymap.hf_to_gguf(key)) == key
    assert hf["model.layers.1.self_attn.q_proj.weight"].shape == (
        cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    assert hf["model.layers.0.self_attn.o_proj.weight"].shape == (
        cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    # The layout change of q: row n*H + h of q_proj is column (n, h) of q_DNH.
    q = np.asarray(model.layers[1].attn.q_DNH.get_value())
    np.testing.assert_array_equal(hf["model.layers.1.self_attn.q_proj.weight"][
        1 * cfg.head_dim + 3], q[:, 1, 3])
  assert keymap.hf_to_param("model.layers.0.self_attn.rotary_emb.inv_freq") is None
  assert keymap.is_ignored("model.layers.0.self_attn.rotary_emb.inv_freq")
  assert keymap.gguf_to_hf("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"


def test_llama_qk_unpermute_matches_transformers():
  from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
  rng = np.random.default_rng(0)
  for heads, kv, h, d in ((9, 3, 64, 8), (4, 4, 16, 8), (8, 2, 32, 4)):
    proc = LlamaTensorProcessor(config={"num_attention_heads": heads,
                                        "num_key_value_heads": kv})
    for name, n in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv)):
      w = rng.standard_normal((n * h, d)).astype(np.float32)
      ours = gguf_ckpt.unpermute_llama_qk(w, n)
      np.testing.assert_array_equal(ours, proc.process(w, name).weights)
      np.testing.assert_array_equal(gguf_ckpt.permute_llama_qk(ours, n), w)
      np.testing.assert_array_equal(hf_utils.llama_cpp_permute(ours, n), w)


# --- HF directories: bad input ----------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  model = hf_utils.make_hf_model("qwen3", layers=1, tie=False)
  return hf_utils.save_hf(model, tmp_path_factory.mktemp("qwen3"))


def _copy_config(src, dst, **changes) -> dict:
  cfg = json.loads(open(os.path.join(src, "config.json")).read())
  cfg.update(changes)
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  return cfg


def test_missing_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint not found: .*nope"):
    load_pretrained(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="HF checkpoint directory not found"):
    load_hf_dir(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="empty/config.json not found"):
    load_pretrained(tmp_path / "empty")
  (tmp_path / "weights.txt").write_text("x")
  with pytest.raises(ValueError, match="expected an HF checkpoint directory .* or a .gguf"):
    load_pretrained(tmp_path / "weights.txt")
  with pytest.raises(FileNotFoundError, match="GGUF file not found"):
    load_gguf(tmp_path / "missing.gguf")
  # the config reader (the memory plan's) refuses the same paths the same way
  with pytest.raises(FileNotFoundError, match="checkpoint not found: .*nope"):
    checkpoint_config(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="empty/config.json not found"):
    checkpoint_config(tmp_path / "empty")
  with pytest.raises(ValueError, match="expected an HF checkpoint directory .* or a .gguf"):
    checkpoint_config(tmp_path / "weights.txt")


def test_missing_safetensors(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError,
                     match=r"no weights in .*model\.safetensors or model\.safetensors\.index"
                           r"\.json.*\.bin"):
    load_pretrained(tmp_path)


def test_malformed_index(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  index = tmp_path / "model.safetensors.index.json"
  index.write_text('{"weight_map": {"model.norm.weight": ')
  with pytest.raises(ValueError, match="malformed safetensors index .*index.json"):
    load_pretrained(tmp_path)
  index.write_text('{"metadata": {}}')
  with pytest.raises(ValueError, match="weight_map"):
    load_pretrained(tmp_path)
  index.write_text('{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}')
  with pytest.raises(FileNotFoundError, match="shard .*model-00001-of-00002.safetensors"):
    load_pretrained(tmp_path)


def test_index_tensor_not_in_shard(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  tensors = hf_utils.file_tensors(hf_dir)
  hf_utils.write_safetensors(tmp_path / "model-00001-of-00001.safetensors",
                             {k: v for k, v in tensors.items() if k != "model.norm.weight"})
  wm = {k: "model-00001-of-00001.safetensors" for k in tensors}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
  with pytest.raises(ValueError, match="model.norm.weight .*model-00001-of-00001"):
    load_pretrained(tmp_path)


def test_truncated_safetensors(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  data = open(os.path.join(hf_dir, "model.safetensors"), "rb").read()
  (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="cannot read safetensors file .*model.safetensors"):
    load_pretrained(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(data[:5])
  with pytest.raises(ValueError, match="cannot read safetensors file"):
    load_pretrained(tmp_path)


def test_wrong_tensor_shape_named(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  tensors = hf_utils.file_tensors(hf_dir)
  key = "model.layers.0.self_attn.k_proj.weight"
  expected = tensors[key].shape
  tensors[key] = np.zeros((expected[0] + 16, expected[1]), np.float32)
  hf_utils.write_safetensors(tmp_path / "model.safetensors", tensors)
  with pytest.raises(ValueError) as e:
    load_pretrained(tmp_path)
  msg = str(e.value)
  assert key in msg and str((expected[0] + 16, expected[1])) in msg and str(expected) in msg


def test_missing_and_unexpected_tensors_named(hf_dir, tmp_path):
  _copy_config(hf_dir, tmp_path)
  tensors = hf_utils.file_tensors(hf_dir)
  norm = tensors.pop("model.layers.0.self_attn.q_norm.weight")
  hf_utils.write_safetensors(tmp_path / "model.safetensors", tensors)
  with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.0\.self_attn\.q_norm"
                                       r"\.weight"):
    load_pretrained(tmp_path)
  tensors["model.layers.0.self_attn.q_norm.weight"] = norm
  tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
  hf_utils.write_safetensors(tmp_path / "model.safetensors", tensors)
  with pytest.raises(ValueError, match=r"unexpected tensor\(s\) model\.layers\.1\.mlp\.up_proj"):
    load_pretrained(tmp_path)
  # Derived rope buffers of older checkpoints are skipped.
  del tensors["model.layers.1.mlp.up_proj.weight"]
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  hf_utils.write_safetensors(tmp_path / "model.safetensors", tensors)
  load_pretrained(tmp_path)


def test_tied_head_present(tmp_path):
  """A tied config tolerates an lm_head.weight equal to the embeddings, and refuses another."""
  model = hf_utils.make_hf_model("qwen3", layers=1, tie=True)
  path = hf_utils.save_hf(model, tmp_path / "tied")
  tensors = hf_utils.file_tensors(path)
  assert "lm_head.weight" not in tensors
  ref = load_pretrained(path)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  hf_utils.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
  again = load_pretrained(path)
  tokens = jnp.arange(12, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(np.asarray(ref(tokens)), np.asarray(again(tokens)))
  tensors["lm_head.weight"][0, 0] += 1.0
  hf_utils.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    load_pretrained(path)


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                           "original_max_position_embeddings": 32768}),
     "rope_parameters.rope_type"),
    (dict(rope_parameters=None, rope_theta=1e6,
          rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
    (dict(num_experts=8, num_experts_per_tok=2), "num_experts"),
    (dict(model_type="qwen3_moe"), "model_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_config_field_named(hf_dir, tmp_path, changes, field):
  _copy_config(hf_dir, tmp_path, **changes)
  os.link(os.path.join(hf_dir, "model.safetensors"), tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=f"unsupported HF config field {field}="):
    load_pretrained(tmp_path)


def test_benign_transformers5_fields_accepted(hf_dir):
  cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
  assert {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers",
          "dtype"} <= set(cfg)
  assert isinstance(load_pretrained(hf_dir), Decoder)


def test_save_refuses_to_overwrite(tmp_path):
  model = init_model(get_config("tiny", num_layers=1))
  save_pretrained(model, tmp_path)
  with pytest.raises(FileExistsError, match="already holds weights .*model.safetensors"):
    save_pretrained(model, tmp_path)
  written = save_pretrained(model, tmp_path, max_shard_bytes=50_000, overwrite=True)
  assert "model.safetensors" not in os.listdir(tmp_path)
  assert sorted(os.listdir(tmp_path)) == sorted(written)
  # Weight files get the mode of config.json (safetensors alone writes them 0600).
  modes = {n: os.stat(tmp_path / n).st_mode & 0o777 for n in written}
  assert set(modes.values()) == {modes["config.json"]}, modes
  old = os.umask(0o022)
  try:
    save_pretrained(model, tmp_path / "u", overwrite=True)
  finally:
    os.umask(old)
  assert os.stat(tmp_path / "u" / "model.safetensors").st_mode & 0o777 == 0o644
  with pytest.raises(ValueError, match="max_shard_bytes=0"):
    save_pretrained(model, tmp_path / "x", max_shard_bytes=0)


def test_preset_model_saves_and_loads(tmp_path):
  """A random `tiny` preset round-trips through the HF format (bf16 storage too)."""
  for pd in ("float32", "bfloat16"):
    model = init_model(get_config("tiny", param_dtype=pd))
    save_pretrained(model, tmp_path / pd)
    again = load_pretrained(tmp_path / pd, param_dtype=pd)
    assert again.cfg == model.cfg.replace(name=again.cfg.name)
    tokens = jnp.arange(20, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(again(tokens)))


# --- GGUF -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_model():
  return hf_utils.make_hf_model("llama", heads=4, kv_heads=2, head_dim=16, hidden=64,
                                layers=1, tie=True)


def test_gguf_quantized_q8_0(llama_model, tmp_path):
  """Quantized tensors are dequantized by the gguf package (and llama Q/K un-permuted)."""
  import gguf
  path = hf_utils.write_gguf(tmp_path / "q8.gguf", llama_model, "llama",
                             quant=gguf.GGMLQuantizationType.Q8_0)
  model, meta = load_gguf(path)
  assert meta["llama.block_count"] == 1
  w = llama_model.model.layers[0].mlp.gate_proj.weight.detach().numpy()
  expect = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
  np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.gate_DF.get_value()), expect.T)
  tokens = np.arange(16, dtype=np.int32)[None]
  ref = hf_utils.torch_logits(llama_model, tokens)
  out = np.asarray(model(jnp.asarray(tokens)))
  assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()  # Q8_0 is close, not exact
  # load_pretrained dispatches .gguf files here; bf16 storage is the cast of the same values.
  bf16 = load_pretrained(path, param_dtype="bfloat16")
  assert bf16.cfg.param_dtype == "bfloat16" and bf16.cfg.dtype == "float32"
  np.testing.assert_array_equal(np.asarray(bf16.layers[0].mlp.gate_DF.get_value()),
                                expect.T.astype(jnp.bfloat16))


def test_gguf_unsupported_architecture(llama_model, tmp_path):
  path = hf_utils.write_gguf(tmp_path / "x.gguf", llama_model, "gpt2")
  with pytest.raises(ValueError, match=r"unsupported GGUF architecture "
                                       r"general.architecture='gpt2'.*llama.*qwen2.*qwen3"):
    load_gguf(path)


def test_gguf_unsupported_quant_type(llama_model, tmp_path):
  path = hf_utils.write_gguf(tmp_path / "x.gguf", llama_model, "llama",
                             drop=("model.norm.weight",),
                             tensors={"output_norm.weight": np.ones(64, np.float64)})
  with pytest.raises(ValueError, match="tensor output_norm.weight has quantization type F64"):
    load_gguf(path)


def test_gguf_refused_metadata(llama_model, tmp_path):
  for key, value in (("llama.rope.scaling.type", "yarn"), ("llama.expert_count", 8),
                     ("llama.attention.sliding_window", 4096)):
    path = hf_utils.write_gguf(tmp_path / "x.gguf", llama_model, "llama", meta={key: value})
    with pytest.raises(ValueError, match=f"unsupported GGUF metadata {key}="):
      load_gguf(path)
    os.remove(path)


def test_gguf_tensor_errors_named(llama_model, tmp_path):
  key = "model.layers.0.mlp.up_proj.weight"
  path = hf_utils.write_gguf(tmp_path / "a.gguf", llama_model, "llama", drop=(key,),
                             tensors={"blk.0.ffn_up.weight": np.zeros((96, 32), np.float32)})
  with pytest.raises(ValueError) as e:
    load_gguf(path)
  msg = str(e.value)
  assert "blk.0.ffn_up.weight" in msg and key in msg
  assert "has shape (96, 32), expected (96, 64)" in msg
  path = hf_utils.write_gguf(tmp_path / "b.gguf", llama_model, "llama", drop=(key,))
  with pytest.raises(ValueError, match=r"missing tensor\(s\) blk\.0\.ffn_up\.weight"):
    load_gguf(path)
  path = hf_utils.write_gguf(tmp_path / "c.gguf", llama_model, "llama",
                             tensors={"blk.0.ffn_gate_exps.weight": np.zeros(4, np.float32)})
  with pytest.raises(ValueError, match="unexpected tensor blk.0.ffn_gate_exps.weight"):
    load_gguf(path)
  path = hf_utils.write_gguf(tmp_path / "d.gguf", llama_model, "qwen2")  # qwen2 needs biases
  with pytest.raises(ValueError, match=r"missing tensor\(s\) blk\.0\.attn_k\.bias"):
    load_gguf(path)
  (tmp_path / "e.gguf").write_bytes(b"GGUF\x03\x00")
  with pytest.raises(ValueError, match="cannot read GGUF file .*e.gguf"):
    load_gguf(tmp_path / "e.gguf")


# --- tokenizers -------------------------------------------------------------------------

def test_tokenizer_from_hf_dir(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                          eos_token="</s>").save_pretrained(tmp_path)
  loaded = load_tokenizer(tmp_path)
  assert loaded("hello world nope")["input_ids"] == [3, 4, 0]
  (tmp_path / "sub").mkdir()
  with pytest.raises(FileNotFoundError, match="no tokenizer in .*sub"):
    load_tokenizer(tmp_path / "sub")
  with pytest.raises(FileNotFoundError, match="tokenizer source not found"):
    load_tokenizer(tmp_path / "nope")
  with pytest.raises(ValueError, match="expected an HF checkpoint directory or a .gguf"):
    load_tokenizer(tmp_path / "tokenizer.json")
