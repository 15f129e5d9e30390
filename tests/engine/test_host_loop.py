"""The engine's host loop: overlapped chunks give the outputs of the synchronous loop, the LoRA
is placed on the rollout devices once per generate (not resent with every chunk), and the KV
pool can be released between rollouts and rebuilt with identical rollouts."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.lora import LoRAConfig, init_lora
from sparrow_jax.models.quality_head import init_quality_head

CFG = get_config("tiny", eos_token_ids=(), num_layers=2)
STOPS = frozenset(range(3, 60))
SPARSE = BlockSparse(max_budget=1, page_size=4, dense_layers=(0,))


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, seed=7)


def _requests(temperature, n=6, seed=0, stop=True):
  rng = np.random.default_rng(seed)
  return [Request(list(rng.integers(3, 500, int(rng.integers(4, 14)))),
                  SamplingParams(temperature=temperature, max_new_tokens=int(m), seed=50 + i,
                                 top_k=40 if i % 2 else 0,
                                 stop_token_ids=tuple(range(3, 30)) if stop else ()), i,
                  group=i // 3)
          for i, m in enumerate(rng.integers(5, 30, n))]


class PruneSecond:
  detect_len, stop_ids = 3, STOPS

  def __init__(self):
    self.head_params = init_quality_head(jax.random.PRNGKey(1), CFG.hidden_size)

  def decide(self, group, cands):
    return [j != 1 for j in range(len(cands))]


def _assert_same(a, b):
  for x, y in zip(a, b):
    assert x.finish_reason == y.finish_reason and x.pruned == y.pruned
    np.testing.assert_array_equal(x.token_ids, y.token_ids)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert (x.topk_ids is None) == (y.topk_ids is None)
    if x.topk_ids is not None:
      np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
      np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=1e-5)
    assert x.detect_index == y.detect_index


def test_overlapped_chunks_give_the_synchronous_outputs(model):
  lora = init_lora(CFG, LoRAConfig(rank=2, alpha=4.0), jax.random.PRNGKey(2))
  lora = jax.tree.map(lambda x: x + 0.03 if x.ndim == 2 else x, lora)
  base = dict(num_slots=6, max_seq_len=48, page_size=4, decode_chunk=4, logprobs_topk=5)
  outs, stats = {}, {}
  for overlap in (True, False):
    eng = GenerationEngine(model, EngineConfig(**base, overlap_chunks=overlap),
                           attention=SPARSE)
    # Stops and pruning end rows while the next chunk is already running.
    outs[overlap] = eng.generate(_requests(1.0), lora=lora, prune=PruneSecond())
    stats[overlap] = eng.last_stats
    assert all(a.num_used == 0 for a in eng.last_scheduler.allocators)
  assert stats[True]["overlapped_chunks"] > 0 and stats[False]["overlapped_chunks"] == 0
  # A chunk fed from the previous one's outputs runs the program a host-fed chunk compiled.
  assert stats[True]["compilations"] == stats[False]["compilations"]
  assert stats[True]["pruned_running"] > 0
  assert any(c.finish_reason == "stop" for c in outs[True])
  _assert_same(outs[True], outs[False])


def test_lora_is_placed_once_per_generate(model):
  lora = init_lora(CFG, LoRAConfig(rank=2, alpha=4.0), jax.random.PRNGKey(2))
  host_lora = jax.tree.map(np.asarray, lora)  # e.g. a tree in some other layout
  eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=48, page_size=4,
                                             decode_chunk=2), attention=SPARSE)
  seen = []
  get = eng._get_decode

  def spy(*a, **k):
    fn = get(*a, **k)
    def call(*args):
      seen.append(args[11])  # the lora argument of the decode step
      return fn(*args)
    return call

  eng._get_decode = spy
  eng.generate(_requests(1.0, n=4, stop=False), lora=host_lora)
  assert len(seen) > 3
  first = jax.tree.leaves(seen[0])
  want = NamedSharding(eng.mesh, P())
  for tree in seen:
    leaves = jax.tree.leaves(tree)
    assert all(x is y for x, y in zip(leaves, first))  # the same device arrays every chunk
    assert all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(want, x.ndim)
               for x in leaves)


def test_released_pool_is_rebuilt_with_identical_rollouts(model):
  temperature = 1.0
  # (temperature 1: what training samples; the trainer-level test, test_micro_phases, runs
  # the same check through train_step)
  cfg = EngineConfig(num_slots=4, max_seq_len=48, page_size=4, decode_chunk=4, num_pages=16)
  kept = GenerationEngine(model, cfg, attention=SPARSE)
  freed = GenerationEngine(model, cfg, attention=SPARSE)
  full = freed.pool_pages * freed.bytes_per_page
  assert freed.kv_pool_bytes == full
  for step in range(2):
    reqs = _requests(temperature, seed=step, stop=False)
    a, b = kept.generate(reqs), freed.generate(reqs)
    _assert_same(a, b)
    assert freed.last_stats["preemptions"] > 0  # the pool is used to its end
    arrays = jax.tree.leaves(freed._kv)
    freed.release_kv_pool()
    assert freed.kv_pool_bytes == 0 and all(x.is_deleted() for x in arrays)
    freed.release_kv_pool()  # twice is fine
  assert kept.num_compilations == freed.num_compilations  # the rebuild compiles nothing new
  freed.generate(_requests(temperature, n=1))
  assert freed.kv_pool_bytes == full == kept.kv_pool_bytes
