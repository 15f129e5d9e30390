"""Generation engine: greedy parity, batching invariance, continuous batching, stops, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams

CFG = get_config("tiny", eos_token_ids=())  # no EOS: lengths are deterministic


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, seed=11)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, CFG.vocab_size, n)) for n in lengths]


_PAD_LEN = 64  # references run at one padded length: one compile (causal: padding after a
# position does not change it)


@jax.jit  # (graphdef: a static pytree node; state: the weights)
def _padded_forward(graphdef, state, toks):
  from flax import nnx
  return nnx.merge(graphdef, state)(toks)


def _full_logits(model, toks):
  """Logits [len(toks), V] of one sequence (a full forward, no cache)."""
  from flax import nnx
  assert len(toks) <= _PAD_LEN
  padded = np.zeros((1, _PAD_LEN), np.int32)
  padded[0, :len(toks)] = toks
  # (sliced on the host: an eager slice per length would compile once per length)
  return np.asarray(_padded_forward(*nnx.split(model), jnp.asarray(padded)))[0, :len(toks)]


def _greedy_reference(model, prompt, n):
  toks = list(prompt)
  for _ in range(n):
    toks.append(int(np.argmax(_full_logits(model, toks)[-1])))
  return toks[len(prompt):]


def test_greedy_matches_full_recompute_and_batching(model):
  prompts = _prompts([3, 16, 21, 40])
  sp = SamplingParams(temperature=0.0, max_new_tokens=12)
  eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=96, decode_chunk=8))
  batched = eng.generate([Request(p, sp, i) for i, p in enumerate(prompts)])
  for p, out in zip(prompts, batched):
    assert out.finish_reason == "length"
    assert list(out.token_ids) == _greedy_reference(model, p, 12)
    # log-prob of greedy tokens = log-softmax of the full forward at that position
    full = _full_logits(model, p + list(out.token_ids))
    rows = full[len(p) - 1:-1].astype(np.float64)
    ref_lp = rows - np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - rows.max(-1, keepdims=True)
    ref_lp = np.take_along_axis(ref_lp, out.token_ids[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=1e-4)


def test_continuous_batching_reuses_pages_and_matches_alone(model):
  prompts = _prompts([5, 30, 12, 7, 50, 3, 18], seed=1)
  news = [9, 25, 4, 30, 6, 17, 11]
  reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=n), i)
          for i, (p, n) in enumerate(zip(prompts, news))]
  cfg = EngineConfig(num_slots=2, max_seq_len=96, decode_chunk=4, num_pages=16)
  eng = GenerationEngine(model, cfg)
  outs = eng.generate(reqs)
  alone = GenerationEngine(model, EngineConfig(num_slots=1, max_seq_len=96, decode_chunk=4))
  for r, o in zip(reqs, outs):
    assert len(o.token_ids) == r.sampling.max_new_tokens
    assert list(o.token_ids) == list(alone.generate([r])[0].token_ids)
  a = eng.last_scheduler.allocators[0]
  assert a.num_used == 0 and a.num_free == cfg.num_pages - 1  # everything returned
  assert a.total_allocated > cfg.num_pages - 1  # more pages handed out than exist: reuse
  assert a.high_water <= cfg.num_pages - 1


def test_sampling_is_per_request_deterministic(model):
  prompts = _prompts([6, 9, 14], seed=2)
  mk = lambda seed, i, p: Request(p, SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                    max_new_tokens=10, seed=seed), i)
  eng = GenerationEngine(model, EngineConfig(num_slots=3, max_seq_len=64, decode_chunk=4))
  together = eng.generate([mk(7, i, p) for i, p in enumerate(prompts)])
  for i, p in enumerate(prompts):
    alone = eng.generate([mk(7, i, p)])[0]
    np.testing.assert_array_equal(alone.token_ids, together[i].token_ids)
    np.testing.assert_allclose(alone.logprobs, together[i].logprobs, atol=1e-5)
  other = eng.generate([mk(8, 0, prompts[0])])[0]
  assert list(other.token_ids) != list(together[0].token_ids)
  assert np.all(together[0].logprobs <= 0)


def test_stop_ids_and_finish_reasons(model):
  p = _prompts([10], seed=3)[0]
  eng = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=32, decode_chunk=4))
  free = eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=8))])[0]
  stop_tok = int(free.token_ids[4])
  first = list(free.token_ids).index(stop_tok)
  stopped = eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=8,
                                                    stop_token_ids=(stop_tok,)))])[0]
  assert stopped.finish_reason == "stop"
  assert list(stopped.token_ids) == list(free.token_ids[:first + 1])
  ctx = eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=100))])[0]
  assert ctx.finish_reason == "context" and len(ctx.token_ids) == 32 - len(p)
  eos_model_eng = GenerationEngine(init_model(get_config("tiny", eos_token_ids=(stop_tok,)),
                                              seed=11),
                                   EngineConfig(num_slots=1, max_seq_len=32, decode_chunk=4))
  eos = eos_model_eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=8))])
  assert eos[0].finish_reason == "stop" and eos[0].token_ids[-1] == stop_tok
  ign = eos_model_eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=8,
                                                          ignore_eos=True))])
  assert ign[0].finish_reason == "length" and len(ign[0].token_ids) == 8


def test_no_recompilation_across_calls(model):
  eng = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=64, decode_chunk=4))
  sp = SamplingParams(temperature=0.0, max_new_tokens=9)
  eng.generate([Request(p, sp) for p in _prompts([5, 9], seed=4)])
  n = eng.num_compilations
  eng.generate([Request(p, sp) for p in _prompts([7, 12], seed=5)])
  eng.generate([Request(p, SamplingParams(temperature=0.7, top_p=0.5, max_new_tokens=20))
                for p in _prompts([3, 14], seed=6)])
  assert eng.num_compilations == n


def test_bad_requests_are_clear_errors(model):
  eng = GenerationEngine(model, EngineConfig(num_slots=1, max_seq_len=32))
  with pytest.raises(ValueError, match="does not fit the context"):
    eng.generate([Request(list(range(3, 40)))])
  with pytest.raises(ValueError, match="empty prompt"):
    eng.generate([Request([])])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    eng.generate([Request([5, CFG.vocab_size + 3])])
  with pytest.raises(ValueError, match="max_seq_len"):
    GenerationEngine(model, EngineConfig(max_seq_len=CFG.max_position_embeddings + 1))
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)


def test_greedy_equals_transformers_generate(tmp_path):
  import torch
  from sparrow_jax.models import load_pretrained
  from tests.models.hf_utils import make_hf_model, save_hf

  hf = make_hf_model("qwen3", seed=4, vocab=256)
  path = save_hf(hf, tmp_path / "qwen3")
  model = load_pretrained(path)
  prompts = _prompts([5, 11], seed=9)
  prompts = [[t % 256 for t in p] for p in prompts]
  eng = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=64, decode_chunk=4))
  sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
  outs = eng.generate([Request(p, sp, i) for i, p in enumerate(prompts)])
  for p, o in zip(prompts, outs):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    assert list(o.token_ids) == ref[0, len(p):].tolist()
