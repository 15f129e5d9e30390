"""Memory-sized pools, admission and recompute preemption: a preempted request's output is the
one it would have had in a pool large enough for everyone (dense and block-sparse, greedy and
temperature 1), plus the scheduler's bookkeeping and its errors."""

import jax
import numpy as np
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.engine.scheduler import Scheduler, SeqState
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.kv_cache import kv_bytes_per_page
from flax import nnx
from tests.rl.sparse_setup import sharp_tiny

PAGE = 4
NEW = 40


@pytest.fixture(scope="module")
def sharp_model():
  cfg, graphdef, state = sharp_tiny(num_layers=3)
  cfg = cfg.replace(eos_token_ids=())
  model = init_model(cfg)
  nnx.update(model, state)
  return model


def _requests(temperature):
  rng = np.random.default_rng(0)
  return [Request(list(rng.integers(3, 500, int(n))),
                  SamplingParams(temperature=temperature, max_new_tokens=NEW, seed=100 + i), i)
          for i, n in enumerate(rng.integers(8, 20, 8))]


SPARSE = BlockSparse(max_budget=1, page_size=PAGE, dense_layers=(0,))


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
def test_preempted_requests_match_a_pool_that_fits_everyone(sharp_model, attention):
  temperature = 1.0
  # (temperature 1: sampling keyed by seed and position must survive the recompute; greedy
  # is the special case of it; test_pruning checks greedy detection under preemption)
  reqs = _requests(temperature)
  per_req = -(-(19 + NEW) // PAGE)  # pages of the longest request
  big = GenerationEngine(sharp_model, EngineConfig(num_slots=8, max_seq_len=64,
                                                   page_size=PAGE, decode_chunk=4),
                         attention=attention)
  small = GenerationEngine(sharp_model, EngineConfig(num_slots=8, max_seq_len=64,
                                                     page_size=PAGE, decode_chunk=4,
                                                     num_pages=3 * per_req + 1),
                           attention=attention)
  ref = big.generate(reqs)
  out = small.generate(reqs)
  st = small.last_stats
  assert big.last_stats["preemptions"] == 0
  assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0, st
  assert st["pool_high_water_pages"] <= 3 * per_req
  for r, a, b in zip(reqs, ref, out):
    assert len(b.token_ids) == NEW
    np.testing.assert_array_equal(b.token_ids, a.token_ids, err_msg=f"request {r.request_id}")
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-4)
  assert sum(c.preemptions for c in out) == st["preemptions"]
  assert all(a.num_used == 0 for a in small.last_scheduler.allocators)
  if attention is not None:
    # The sparse actor's outputs differ from dense ones here, so a readmission that
    # recomputed the generated tokens with dense attention would not match.
    dense = GenerationEngine(sharp_model, EngineConfig(num_slots=8, max_seq_len=64,
                                                       page_size=PAGE, decode_chunk=4))
    assert any(list(a.token_ids) != list(d.token_ids)
               for a, d in zip(ref, dense.generate(reqs)))


def test_prefill_token_limit_splits_calls_and_changes_no_output(sharp_model, monkeypatch):
  """`max_prefill_tokens` (vLLM's max_num_batched_tokens): admitted prompts are prefilled in
  calls of at most that many tokens (rows x padded length); the completions are the same."""
  reqs = _requests(1.0)
  make = lambda **kw: GenerationEngine(sharp_model, EngineConfig(
      num_slots=8, max_seq_len=64, page_size=PAGE, decode_chunk=4, **kw), attention=SPARSE)
  whole, split = make(), make(max_prefill_tokens=64)
  shapes = []
  orig = split._prefill
  monkeypatch.setattr(split, "_prefill", lambda run, seqs: (
      shapes.append(split._prefill_shape(seqs)), orig(run, seqs))[1])
  ref, out = whole.generate(reqs), split.generate(reqs)
  assert whole.last_stats["prefills"] == 1
  assert len(shapes) == split.last_stats["prefills"] > 1
  assert all(n * t <= 64 for n, t in shapes) and sum(n for n, _ in shapes) >= len(reqs)
  for a, b in zip(ref, out):
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-4)
  with pytest.raises(ValueError, match="max_prefill_tokens=-1"):
    EngineConfig(max_prefill_tokens=-1)


def test_request_that_can_never_fit_is_refused_before_any_work(sharp_model):
  eng = GenerationEngine(sharp_model, EngineConfig(num_slots=2, max_seq_len=64, page_size=PAGE,
                                                   num_pages=8))
  ok = Request([5] * 8, SamplingParams(max_new_tokens=4), "ok")
  big = Request([5] * 10, SamplingParams(max_new_tokens=30), "big")
  with pytest.raises(ValueError, match=r"request 'big': prompt 10 \+ max_new_tokens 30 tokens "
                     r"need up to 10 pages of 4 tokens, but the KV pool holds 7 pages"):
    eng.generate([ok, big])
  assert eng.num_compilations == 0  # nothing ran
  assert len(eng.generate([ok])[0].token_ids) == 4  # the engine is still usable


def test_pool_sized_by_bytes_and_by_device_memory(sharp_model):
  cfg = sharp_model.cfg
  per_page = kv_bytes_per_page(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, page_size=PAGE, dtype="float32",
                               landmark="mean")
  eng = GenerationEngine(sharp_model, EngineConfig(num_slots=2, max_seq_len=64, page_size=PAGE,
                                                   kv_cache_bytes=37 * per_page + 5),
                         attention=SPARSE)
  assert eng.pool_pages == 37
  arrays = eng._kv.k + eng._kv.v + tuple(x for lm in eng._kv.landmarks for x in lm)
  assert sum(a.nbytes for a in arrays) == 37 * per_page  # the formula is what is allocated
  with pytest.raises(ValueError, match="does not report its memory"):
    GenerationEngine(sharp_model, EngineConfig(kv_cache_memory_fraction=0.5))
  with pytest.raises(ValueError, match="both size the KV pool"):
    EngineConfig(num_pages=10, kv_cache_bytes=1000)


def test_finished_sequences_stop_inside_a_chunk(sharp_model):
  eng = GenerationEngine(sharp_model, EngineConfig(num_slots=2, max_seq_len=64, page_size=PAGE,
                                                   decode_chunk=8))
  p = [7] * 9
  eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=3))])
  # The prefill samples token 1; decode steps 0 and 1 give tokens 2 and 3: the loop ends
  # after 2 of its 8 steps because no slot is left running.
  assert eng.last_stats["decode_steps"] == 2
  assert eng.last_stats["wasted_decode_steps"] == 0
  eng.generate([Request(p, SamplingParams(temperature=0.0, max_new_tokens=3)),
                Request(p, SamplingParams(temperature=0.0, max_new_tokens=20))])
  # The short one finishes at step 1 of the first chunk, which runs on for the long one.
  assert eng.last_stats["wasted_decode_steps"] == 8 - 2


class _Req:
  def __init__(self, n, new):
    self.prompt_ids, self.request_id = [3] * n, None
    self.sampling = SamplingParams(max_new_tokens=new)


def _seq(i, n, new):
  return SeqState(req=_Req(n, new), index=i, stop_ids=frozenset(), max_len=n + new)


def test_scheduler_admits_fcfs_and_preempts_the_latest_admission():
  sched = Scheduler(num_shards=1, num_slots=4, num_pages=9, page_size=4, max_pages_per_seq=16,
                    chunk=4)
  seqs = [_seq(0, 7, 20), _seq(1, 7, 20), _seq(2, 7, 20), _seq(3, 2, 2)]
  sched.submit(seqs)
  admitted = sched.admit()  # 3 pages each (7 + 4 tokens): 2 fit in 8 pages, then FCFS stops
  assert [s.index for s in admitted] == [0, 1]
  assert [s.index for s in sched.queue] == [2, 3]  # seq 3 would fit but does not overtake
  for s in admitted:
    s.num_tokens, s.length = 1, 7
  seqs[0].length = 20  # seq 0 needs 3 more pages, 2 are free: seq 1 (latest admission) yields
  running = sched.grow()
  assert [s.index for s in running] == [0]
  assert [s.index for s in sched.queue] == [1, 2, 3]  # the preempted one goes first
  assert seqs[1].preemptions == 1 and seqs[1].pages == [] and seqs[1].slot == -1
  assert len(seqs[0].pages) == 6 and sched.allocators[0].num_free == 2
  assert sched.stats.preemptions == 1
  assert sched.admit() == []  # the shard preempted in this iteration: it admits nothing
  sched.release(seqs[0])  # seq 0 finishes
  assert sched.grow() == []  # the next iteration: nothing left to grow
  readmitted = sched.admit()
  assert [s.index for s in readmitted] == [1, 2, 3]
  assert sched.stats.recomputed_tokens == 8


def test_scheduler_spreads_a_small_batch_over_shards():
  sched = Scheduler(num_shards=4, num_slots=2, num_pages=20, page_size=4, max_pages_per_seq=8,
                    chunk=4)
  sched.submit([_seq(i, 5, 5) for i in range(5)])
  admitted = sched.admit()
  assert [(s.shard, s.slot) for s in admitted] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
  table = sched.page_table(4)
  assert table.shape == (8, 4) and (table[2 * 0 + 1] != 0).any() and (table[2 * 1 + 1] == 0).all()


def test_grow_before_admit_wastes_no_prefill_and_keeps_a_watermark():
  # Seq A runs (15 tokens in 4 pages) and needs 2 more pages for its next chunk; seq B waits
  # and needs 4. Capacity 8, 4 free: admitting first (the old order) hands B the last 4
  # pages, and the growth of A then preempts B right after its prefill.
  def setup():
    sched = Scheduler(num_shards=1, num_slots=4, num_pages=9, page_size=4,
                      max_pages_per_seq=16, chunk=8)
    a, b = _seq(0, 7, 40), _seq(1, 7, 40)
    sched.submit([a])
    sched.admit()
    a.num_tokens, a.length, a.decoded = 9, 15, True
    sched.submit([b])
    return sched, a, b

  sched, a, b = setup()
  assert sched.admit() == [b]  # old order: admit, prefill, then grow
  b.num_tokens, b.length = 1, 7
  assert sched.grow() == [a] and b.preemptions == 1
  assert sched.stats.wasted_prefill_tokens == 7
  sched, a, b = setup()
  assert sched.grow() == [a]  # engine order: running sequences first
  assert sched.admit() == [] and len(a.pages) == 6  # B waits for pages, nothing is wasted
  assert sched.stats.wasted_prefill_tokens == 0 and sched.stats.preemptions == 0

  # The watermark: a shard that runs something admits only while >= watermark pages stay
  # free; an idle shard takes a sequence that fits, however few pages that leaves.
  def with_watermark(w, *seqs):
    sched = Scheduler(num_shards=1, num_slots=4, num_pages=13, page_size=4,
                      max_pages_per_seq=16, chunk=4, watermark_pages=w)
    sched.submit(seqs)
    return [s.index for s in sched.admit()]

  assert with_watermark(3, _seq(0, 40, 4), _seq(1, 1, 4)) == [0]  # 11 of 12 pages, idle
  assert with_watermark(3, _seq(0, 30, 10), _seq(1, 3, 10)) == [0]  # 2 more would leave 1
  assert with_watermark(1, _seq(0, 30, 10), _seq(1, 3, 10)) == [0, 1]
  with pytest.raises(ValueError, match="watermark_pages=-1"):
    Scheduler(num_shards=1, num_slots=1, num_pages=4, page_size=4, max_pages_per_seq=1,
              chunk=1, watermark_pages=-1)


class _AdmitFirst(GenerationEngine):
  """The loop order before issue 19: admit into whatever is free (one mixed prefill batch),
  then grow the running sequences (preempting the newest), no watermark."""

  def _schedule(self, run):
    sched = run.sched
    sched.preempted_shards, sched.watermark_pages = set(), 0
    admitted = sched.admit()
    if admitted:
      self._prefill(run, admitted)
    sched.grow()
    return sched.running()


def test_pressure_scenario_wastes_no_prefill_and_matches_a_large_pool(sharp_model):
  # Short and long requests mixed: pages freed by a short one go to a queued request, and in
  # the old order the long ones' growth then preempted it right after its prefill.
  rng = np.random.default_rng(0)
  news = [40, 6, 40, 10, 40, 6, 40, 14, 8, 40, 6, 12]
  reqs = [Request(list(rng.integers(3, 500, int(rng.integers(8, 20)))),
                  SamplingParams(temperature=1.0, max_new_tokens=n, seed=100 + i), i)
          for i, n in enumerate(news)]
  cfg = dict(num_slots=6, max_seq_len=64, page_size=PAGE, decode_chunk=4)
  tight = dict(cfg, num_pages=30)
  ref = GenerationEngine(sharp_model, EngineConfig(**cfg)).generate(reqs)
  old = _AdmitFirst(sharp_model, EngineConfig(**tight))
  old_out = old.generate(reqs)
  assert old.last_stats["wasted_prefill_tokens"] > 0, old.last_stats  # the scenario bites
  eng = GenerationEngine(sharp_model, EngineConfig(**tight))
  batches = []
  prefill = eng._prefill
  eng._prefill = lambda run, admitted: (batches.append([s.preemptions for s in admitted]),
                                        prefill(run, admitted))[1]
  out = eng.generate(reqs)
  st = eng.last_stats
  assert st["preemptions"] > 0 and st["wasted_prefill_tokens"] == 0, st
  # Readmissions are prefilled in their own batches, never padded together with prompts.
  assert any(b[0] for b in batches) and all(bool(min(b)) == bool(max(b)) for b in batches)
  assert 0 < st["prefill_padding_frac"] < 1
  for a, b, c in zip(ref, out, old_out):
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_array_equal(c.token_ids, a.token_ids)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-4)


@pytest.mark.parametrize("slots,context,max_len,chunk,page,w", [
    (16, 8192, 8280, 8, 16, 0.01),    # the GPU suite's engine section (failed on the H200)
    (16, 32768, 32856, 8, 16, 0.01),
    (64, 2000, 2048, 16, 16, 0.05),
    (3, 60, 64, 4, 4, 0.3),
    (8, 120, 128, 4, 4, 0.0)])
def test_default_pool_admits_every_slot_at_long_contexts(slots, context, max_len, chunk, page, w):
  # Without num_pages / bytes / a memory fraction the pool "holds every slot at max_seq_len":
  # that must stay true with the admission watermark, which keeps pages free while anything
  # runs (the engine builds its scheduler with the same numbers).
  cfg = EngineConfig(num_slots=slots, max_seq_len=max_len, page_size=page, decode_chunk=chunk,
                     admission_watermark=w)
  pool = cfg.worst_case_pages
  sched = Scheduler(num_shards=1, num_slots=slots, num_pages=pool, page_size=page,
                    max_pages_per_seq=cfg.max_pages_per_seq, chunk=chunk,
                    watermark_pages=int(w * (pool - 1)))
  sched.submit([_seq(i, context, max_len - context) for i in range(slots)])
  assert len(sched.admit()) == slots
  # ... and the extra is what the watermark needs, not more than a page beyond it.
  need = slots * cfg.max_pages_per_seq
  assert pool - 1 - need <= int(w * (pool - 1)) + 1
