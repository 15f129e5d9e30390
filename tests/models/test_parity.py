"""Logit parity with transformers (torch, CPU, float32) on tiny random checkpoints.

Each case writes a random transformers model with `save_pretrained`, loads it with
`load_pretrained` and compares logits on random tokens (max abs difference <= 1e-4, aim 1e-5).
The same weights written as GGUF files (llama's Q/K rows permuted as llama.cpp does) must load
to the same logits. Save-back is checked bit-exact, and transformers must read what we save.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import from_hf_config, load_pretrained, save_pretrained
from sparrow_jax.models.checkpoints import load_gguf, load_hf_dir
from flax import nnx

try:
  from . import hf_utils
except ImportError:
  import hf_utils

TOL = 1e-4
# name: (arch, model kwargs). Covers GQA 1:1 / 2:1 / 4:1, head_dim != hidden/heads, tied and
# untied heads, rope theta 1e4 and 1e6, Qwen2 (bias, no qk-norm) and Llama.
CASES = {
    "qwen3_gqa1_tied_hd16": ("qwen3", dict(heads=4, kv_heads=4, head_dim=16, hidden=32,
                                           tie=True, theta=1e6)),
    "qwen3_gqa2_untied": ("qwen3", dict(heads=4, kv_heads=2, head_dim=16, hidden=64, tie=False,
                                        theta=1e4)),
    "qwen3_gqa4_untied_hd32": ("qwen3", dict(heads=8, kv_heads=2, head_dim=32, hidden=64,
                                             tie=False, theta=1e6)),
    "qwen2_bias_gqa2": ("qwen2", dict(heads=4, kv_heads=2, head_dim=16, hidden=64, tie=False,
                                      theta=1e6)),
    "llama_gqa3_tied": ("llama", dict(heads=6, kv_heads=2, head_dim=16, hidden=96, tie=True,
                                      theta=1e5, eps=1e-5)),
}


def _tokens(vocab: int, seed: int = 0, shape=(2, 40)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
  """(name, arch, torch model, checkpoint dir, random tokens, torch logits)."""
  arch, kw = CASES[request.param]
  model = hf_utils.make_hf_model(arch, seed=len(request.param), **kw)
  path = hf_utils.save_hf(model, tmp_path_factory.mktemp(request.param))
  tokens = _tokens(model.config.vocab_size)
  return request.param, arch, model, path, tokens, hf_utils.torch_logits(model, tokens)


def _max_diff(model, tokens, ref) -> float:
  out = np.asarray(model(jnp.asarray(tokens)))
  assert out.dtype == np.float32 and out.shape == ref.shape
  return float(np.abs(out - ref).max())


def test_logits_match_transformers(case):
  name, arch, hf_model, path, tokens, ref = case
  model = load_pretrained(path)
  assert model.cfg.qk_norm == (arch == "qwen3")
  assert model.cfg.attention_bias == (arch == "qwen2")
  assert model.cfg.tie_word_embeddings == CASES[name][1]["tie"]
  diff = _max_diff(model, tokens, ref)
  print(f"\n{name}: max |logit diff| = {diff:.2e} (logits up to {np.abs(ref).max():.1f})")
  assert diff <= TOL, f"{name}: max abs logit diff {diff:.3e} > {TOL}"


def test_gguf_logits_match_transformers(case, tmp_path):
  """The same weights as a float32 GGUF (llama Q/K permuted) give the same logits."""
  name, arch, hf_model, path, tokens, ref = case
  model, meta = load_gguf(hf_utils.write_gguf(tmp_path / f"{name}.gguf", hf_model, arch))
  assert meta["general.architecture"] == arch
  expect = load_hf_dir(path).cfg
  assert model.cfg.replace(name=expect.name) == expect
  diff = _max_diff(model, tokens, ref)
  print(f"\n{name} (gguf): max |logit diff| = {diff:.2e}")
  assert diff <= TOL, f"{name} gguf: max abs logit diff {diff:.3e} > {TOL}"


def _leaves(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bit_equal(a: dict, b: dict, what: str):
  assert sorted(a, key=str) == sorted(b, key=str), f"{what}: different keys"
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
    assert a[k].tobytes() == b[k].tobytes(), f"{what}: {k} differs"


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_round_trip_bit_exact(case, tmp_path, max_shard_bytes):
  name, arch, hf_model, path, tokens, ref = case
  model = load_hf_dir(path)
  out = tmp_path / "saved"
  written = save_pretrained(model, out, max_shard_bytes=max_shard_bytes)
  sharded = max_shard_bytes is not None
  assert ("model.safetensors.index.json" in written) == sharded
  if sharded:
    assert len([w for w in written if w.endswith(".safetensors")]) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_utils.file_tensors(out))
  # File tensors: what transformers wrote == what we wrote, bit for bit.
  _assert_bit_equal(hf_utils.file_tensors(path), hf_utils.file_tensors(out), f"{name} files")
  again = load_hf_dir(out)
  assert again.cfg == model.cfg.replace(name=again.cfg.name)
  _assert_bit_equal(_leaves(model), _leaves(again), f"{name} leaves")
  # transformers reads our directory and computes the same logits as the original model.
  from transformers import AutoModelForCausalLM
  reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_utils.torch_logits(reloaded, tokens), ref)


def test_bfloat16_round_trip(tmp_path):
  """bf16 checkpoints load into bf16 params bit-exact and save back unchanged."""
  import torch
  hf_model = hf_utils.make_hf_model("qwen3", tie=False)
  with torch.no_grad():  # weights on the bf16 grid; float32 reference computed on them
    for p in hf_model.parameters():
      p.copy_(p.bfloat16().float())
  tokens = _tokens(256, shape=(1, 16))
  ref = hf_utils.torch_logits(hf_model, tokens)
  # Only the parameters go to bf16 (`.to` would also round the rope inv_freq buffer).
  with torch.no_grad():
    for p in hf_model.parameters():
      p.data = p.data.bfloat16()
  path = hf_utils.save_hf(hf_model, tmp_path / "bf16")
  model = load_hf_dir(path, dtype="float32", param_dtype="bfloat16")
  assert model.cfg.param_dtype == "bfloat16"
  q = np.asarray(model.layers[0].attn.q_DNH.get_value())
  assert q.dtype == jnp.bfloat16
  hf_q = hf_model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(q.astype(np.float32),
                                hf_q.reshape(q.shape[1], q.shape[2], q.shape[0])
                                .transpose(2, 0, 1))
  save_pretrained(model, tmp_path / "out")
  _assert_bit_equal(hf_utils.file_tensors(path), hf_utils.file_tensors(tmp_path / "out"),
                    "bf16 files")
  # float32 compute on bf16-stored weights matches transformers' float32 on the same values.
  assert _max_diff(model, tokens, ref) <= TOL


def test_rope_config_forms(tmp_path):
  """transformers 5's `rope_parameters` and the old top-level `rope_theta` load alike."""
  hf_model = hf_utils.make_hf_model("qwen3", theta=1e6)
  new = hf_utils.save_hf(hf_model, tmp_path / "new")
  cfg_new = json.loads(open(os.path.join(new, "config.json")).read())
  assert cfg_new["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
  old = tmp_path / "old"
  old.mkdir()
  cfg_old = dict(cfg_new)
  del cfg_old["rope_parameters"]
  cfg_old.update(rope_theta=1_000_000, rope_scaling=None, torch_dtype="float32")
  cfg_old.pop("dtype")
  (old / "config.json").write_text(json.dumps(cfg_old))
  os.link(os.path.join(new, "model.safetensors"), old / "model.safetensors")
  a, b = load_pretrained(new), load_pretrained(old)
  assert a.cfg.rope_theta == b.cfg.rope_theta == 1e6
  assert a.cfg == b.cfg.replace(name=a.cfg.name)
  tokens = _tokens(256, shape=(1, 24))
  np.testing.assert_array_equal(np.asarray(a(jnp.asarray(tokens))),
                                np.asarray(b(jnp.asarray(tokens))))
  assert from_hf_config(cfg_old).rope_theta == 1e6

