"""`Decoder.extend`: a chunk of tokens appended at several sequences' ends in one forward
(the engine's append of environment tokens) equals the decode step fed the same tokens one at
a time: the same keys, values and landmarks in the same pages, the same logits of each row's
last token, and decode continuing after it gives the same logits. Dense and block-sparse (mean
and quest landmarks, and with a LoRA adapter), with chunks that cross page boundaries, a row
that writes nothing and a padding row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.kv_cache import PagedKVCache, page_table_row
from sparrow_jax.models.lora import LoRAConfig, init_lora
from sparrow_jax.schedule.schedule import SparsitySchedule, budget_pages

PAGE = 4
SLOTS = 3
MP = 16  # pages per slot


def _setup(spec):
  cfg = get_config("tiny", num_layers=3)
  model = init_model(cfg, seed=3)
  landmark = "none" if isinstance(spec, attn_lib.Dense) else spec.landmark
  cache = PagedKVCache.create(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, num_slots=SLOTS,
                              num_pages=SLOTS * MP + 1, max_pages_per_seq=MP, page_size=PAGE,
                              landmark=landmark)
  # Slot b owns pages 1 + b, 1 + b + SLOTS, ... (interleaved: a wrong row reads a neighbour's).
  rows = np.stack([page_table_row([1 + b + SLOTS * i for i in range(MP)], MP)
                   for b in range(SLOTS)])
  return cfg, model, cache, jnp.asarray(rows)


def _lora(cfg):
  """An adapter with non-zero B (a fresh one adds exactly 0)."""
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 64))
  return {"layers": [
      {t: dict(p, b=0.05 * jax.random.normal(next(keys), p["b"].shape)) for t, p in e.items()}
      for e in lora["layers"]]}


def _fns(model, spec, table, lora=None):
  graphdef, state = nnx.split(model)
  tab = None if table is None else jnp.asarray(table.budgets, jnp.int32)

  @jax.jit
  def prefill(cache, tokens, lengths, slots, rows):
    return nnx.merge(graphdef, state).prefill(cache, tokens, lengths, slots, rows, lora=lora)

  @jax.jit
  def decode(cache, tok, active):
    budgets = None if table is None else budget_pages(table, cache.lengths + 1, tab)
    return nnx.merge(graphdef, state).decode(cache, tok, active, attention=spec,
                                             budgets=budgets, lora=lora)

  @jax.jit
  def extend(cache, tokens, n_in, slots):
    budgets = None
    if table is not None:
      start = cache.lengths[jnp.clip(slots, 0, SLOTS - 1)]
      pos = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
      budgets = budget_pages(table, pos + 1, tab)
    return nnx.merge(graphdef, state).extend(cache, tokens, n_in, slots, attention=spec,
                                             budgets=budgets, lora=lora)
  return prefill, decode, extend


def _stepwise(decode, cache, chunk, n_in):
  """The reference: decode steps over `chunk [SLOTS, F]`, slot b active for n_in[b] steps;
  each slot's logits after its last token."""
  last = np.zeros((SLOTS, 0))
  for j in range(int(max(n_in))):
    active = jnp.asarray(j < np.asarray(n_in))
    cache, logits = decode(cache, jnp.asarray(chunk[:, j]), active)
    logits = np.asarray(logits)
    if last.shape[1] == 0:
      last = np.zeros_like(logits)
    for b in range(SLOTS):
      if j == n_in[b] - 1:
        last[b] = logits[b]
  return cache, last


def _assert_same_cache(a, b, atol=1e-5):
  for la, lb in zip(a.k + a.v, b.k + b.v):
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=atol, rtol=atol)
  for la, lb in zip(a.landmarks, b.landmarks):
    for x, y in zip(la, lb):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=atol)
  np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


SPECS = {
    "dense": (attn_lib.Dense(), None),
    "sparse_mean": (attn_lib.BlockSparse(max_budget=3, page_size=PAGE, dense_layers=(0,)),
                    SparsitySchedule(name="t", budgets=(1, 1, 2), bin_size=16)),
    "sparse_quest": (attn_lib.BlockSparse(max_budget=2, page_size=PAGE, landmark="quest",
                                          dense_layers=(0,)),
                     SparsitySchedule(name="t", budgets=(1, 1, 2), bin_size=16)),
}


@pytest.mark.parametrize("name", list(SPECS) + ["sparse_mean_lora"])
def test_extend_equals_decode_steps(name):
  spec, table = SPECS[name.removesuffix("_lora")]
  cfg, model, cache0, rows = _setup(spec)
  lora = _lora(cfg) if name.endswith("_lora") else None
  prefill, decode, extend = _fns(model, spec, table, lora)
  rng = np.random.default_rng(11)
  plen = np.array([9, 22, 5], np.int32)
  ptoks = np.zeros((SLOTS, 32), np.int32)
  for b in range(SLOTS):
    ptoks[b, :plen[b]] = rng.integers(1, cfg.vocab_size, plen[b])
  cache0, _ = prefill(cache0, jnp.asarray(ptoks), jnp.asarray(plen),
                      jnp.arange(SLOTS, dtype=jnp.int32), rows)
  # Grow the sequences by decode first so that the sparse layers have candidates to choose.
  cache_ref = cache_ext = cache0
  for n_in in ([13, 0, 7], [16, 11, 16], [3, 16, 1]):
    f = 16
    chunk = rng.integers(1, cfg.vocab_size, (SLOTS, f)).astype(np.int32)
    n_in = np.asarray(n_in, np.int32)
    cache_ref, want = _stepwise(decode, cache_ref, chunk, n_in)
    # Rows in another order, plus a padding row (slot out of range) that must write nothing.
    order = [2, 0, 1]
    tokens = np.concatenate([chunk[order], rng.integers(1, cfg.vocab_size, (1, f))], 0)
    slots = np.asarray(order + [SLOTS], np.int32)
    counts = np.concatenate([n_in[order], [5]]).astype(np.int32)
    cache_ext, got = extend(cache_ext, jnp.asarray(tokens), jnp.asarray(counts),
                            jnp.asarray(slots))
    got = np.asarray(got)
    _assert_same_cache(cache_ref, cache_ext)
    for r, b in enumerate(order):
      if n_in[b]:
        np.testing.assert_allclose(got[r], want[b], atol=2e-5, rtol=2e-5)
  # Decode continues identically from the extended cache.
  tok = jnp.asarray(rng.integers(1, cfg.vocab_size, SLOTS).astype(np.int32))
  _, a = decode(cache_ref, tok, jnp.ones((SLOTS,), bool))
  _, b = decode(cache_ext, tok, jnp.ones((SLOTS,), bool))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
  # Long enough for the budgets to bite: more pages than bos + recent + the largest budget.
  assert int(cache_ext.lengths.min()) > (1 + 2 + 3) * PAGE


def test_sparse_extend_is_sparse():
  """The block-sparse extend's logits differ from the dense extend's at long positions (the
  selection is real), while the dense layers' caches agree."""
  spec, table = SPECS["sparse_mean"]
  cfg, model, cache0, rows = _setup(spec)
  dense = attn_lib.Dense()
  _, _, ext_sparse = _fns(model, spec, table)
  prefill, _, ext_dense = _fns(model, dense, None)
  rng = np.random.default_rng(5)
  toks = rng.integers(1, cfg.vocab_size, (SLOTS, 48)).astype(np.int32)
  lens = np.full((SLOTS,), 48, np.int32)
  cache0, _ = prefill(cache0, jnp.asarray(toks), jnp.asarray(lens),
                      jnp.arange(SLOTS, dtype=jnp.int32), rows)
  chunk = jnp.asarray(rng.integers(1, cfg.vocab_size, (SLOTS, 16)).astype(np.int32))
  n_in = jnp.full((SLOTS,), 16, jnp.int32)
  slots = jnp.arange(SLOTS, dtype=jnp.int32)
  _, a = ext_sparse(cache0, chunk, n_in, slots)
  _, b = ext_dense(cache0, chunk, n_in, slots)
  assert np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-3
