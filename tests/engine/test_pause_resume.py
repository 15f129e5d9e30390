"""A rollout session's paused sequences: a sequence stops at one of its `pause_token_ids`
holding its KV pages, `resume` appends the environment's tokens into them (no history
recompute), and it decodes on; when the pool runs short, paused sequences are preempted
first and, parked, are readmitted after their resume with the same trajectory. Bad calls
raise errors that say what was wrong."""

import numpy as np
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.engine.scheduler import Scheduler, SeqState
from sparrow_jax.engine.session import EngineSession
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from tests.agents.test_engine_parity import _check_parity, sharp_model

PAGE = 4
SPARSE = BlockSparse(max_budget=1, page_size=PAGE, dense_layers=(0,))
ENV = (7, 8, 9, 10, 11, 12)  # the environment's tokens appended at the pause


@pytest.fixture(scope="module")
def model():
  return sharp_model()


def _engine(model, attention=None, **kw):
  cfg = dict(num_slots=2, max_seq_len=64, page_size=PAGE, decode_chunk=4)
  cfg.update(kw)
  return GenerationEngine(model, EngineConfig(**cfg), attention=attention)


def _pair(model, attention):
  """Request A (pauses at its 3rd..th token: the first one not sampled before) and B (long,
  no pause), and A's index of the pause."""
  rng = np.random.default_rng(3)
  a, b = (Request(list(rng.integers(3, 259, 10)),
                  SamplingParams(temperature=1.0, max_new_tokens=n, seed=70 + i), f"r{i}")
          for i, n in enumerate((30, 40)))
  free = _engine(model, attention).generate([a])[0].token_ids
  j = next(j for j in range(2, len(free)) if free[j] not in free[:j])
  a.pause_token_ids = (int(free[j]),)
  return a, b, j


def _drain(sess, go_on: bool = False):
  """Step until nothing runs; (paused, finished) completions collected on the way. `go_on`:
  a sequence that pauses is resumed at once with no tokens (it decodes on)."""
  paused, done = [], []
  while sess.has_work():
    sess.step()
    for c in sess.collect_paused():
      if go_on:
        sess.resume(c.request_id, [])
      else:
        paused.append(c)
    done += sess.collect()
  return paused, done


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
def test_paused_sequence_is_preempted_first_and_readmitted(model, attention):
  a, b, j = _pair(model, attention)
  # Reference: a pool that holds both; A is resumed as soon as it pauses.
  sess = EngineSession(_engine(model, attention))
  sess.add([a])
  (p,), _ = _drain(sess)
  assert p.finish_reason == "paused" and len(p.token_ids) == j + 1
  sess.resume("r0", ENV)
  _, (ref,) = _drain(sess, go_on=True)
  assert sess.stats()["preemptions"] == 0 and sess.stats()["prefill_tokens"] == 10
  assert sess.stats()["append_tokens"] == len(ENV) + 1  # the pause token, then ENV
  np.testing.assert_array_equal(ref.token_ids[:j + 1 + len(ENV)],
                                list(p.token_ids) + list(ENV))
  # 15 usable pages: B grows to 13 while A, paused, holds 4: A must go, not B.
  eng = _engine(model, attention, num_pages=15)
  sess = EngineSession(eng)
  sess.add([a, b])
  paused, (done_b,) = _drain(sess)
  assert [c.request_id for c in paused] == ["r0"]
  assert done_b.request_id == "r1" and done_b.preemptions == 0
  st = sess.stats()
  assert st["preemptions"] == 1 and st["paused_preemptions"] == 1
  seq_a = next(s for s in sess.run.seqs if s is not None and s.req.request_id == "r0")
  assert seq_a.slot < 0 and not seq_a.pages and seq_a not in sess.run.sched.queue  # parked
  sess.resume("r0", ENV)
  _, (out,) = _drain(sess, go_on=True)
  assert out.preemptions == 1
  assert sess.stats()["recomputed_tokens"] == 10 + j + 1 + len(ENV)  # readmission's prefill
  np.testing.assert_array_equal(out.token_ids, ref.token_ids)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-4)
  # ... and both equal a teacher-forced recompute at the policy's positions.
  mask = np.ones(len(out.token_ids), np.float32)
  mask[j + 1:j + 1 + len(ENV)] = 0
  out.loss_mask = mask
  _check_parity(model, [a], [out], atol=2e-4, attention=attention)
  # The re-prefill path (the context as `context_ids`) samples the same tokens after it.
  k = j + 1 + len(ENV)
  (cont,) = _engine(model, attention).generate(
      [Request(a.prompt_ids, a.sampling, "c", context_ids=tuple(ref.token_ids[:k]))])
  np.testing.assert_array_equal(cont.token_ids, ref.token_ids)
  np.testing.assert_allclose(cont.logprobs[k:], ref.logprobs[k:], atol=2e-4)


def test_bad_resume_calls_raise_clear_errors():
  cfg = get_config("tiny", eos_token_ids=())
  eng = GenerationEngine(init_model(cfg, seed=1),
                         EngineConfig(num_slots=1, max_seq_len=64, decode_chunk=4))
  sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
  free = eng.generate([Request([3, 4, 5], sp, "x")])[0].token_ids
  pause = (int(free[0]),)  # pauses at its first token
  with pytest.raises(ValueError, match="pause_token_ids; a paused sequence needs a rollout"):
    eng.generate([Request([3, 4, 5], sp, "p", pause_token_ids=pause)])
  with pytest.raises(ValueError, match=r"pause token ids \[999999\] outside the vocabulary"):
    EngineSession(eng).add([Request([3, 4, 5], sp, "v", pause_token_ids=(999999,))])
  sess = EngineSession(eng)
  sess.add([Request([3, 4, 5], sp, "p", pause_token_ids=pause),
            Request([6, 7, 8], sp, "q")])
  with pytest.raises(ValueError, match="no live sequence has request id 'nope'"):
    sess.resume("nope", [1])
  with pytest.raises(ValueError, match="request 'p' is queued, not paused"):
    sess.resume("p", [1])
  sess.step()
  assert sess.collect() == []
  with pytest.raises(ValueError, match="request 'p' paused but was not collected yet"):
    sess.resume("p", [1])
  (c,) = sess.collect_paused()
  assert c.finish_reason == "paused" and list(c.token_ids) == [pause[0]]
  with pytest.raises(ValueError, match=r"environment token ids \[-1, 99999\] outside the "
                                       r"vocabulary"):
    sess.resume("p", [1, -1, 99999])
  with pytest.raises(ValueError, match="11 environment tokens leave no token to generate"):
    sess.resume("p", [1] * 11)
  sess.resume("p", [1, 2])
  with pytest.raises(ValueError, match="request 'p' is running, not paused"):
    sess.resume("p", [1])
  while sess.has_work() and not sess.run.done:
    sess.step()
  with pytest.raises(ValueError, match=r"request 'p' has finished \('length'\)"):
    sess.finish("p")
  (done,) = sess.collect()
  assert done.request_id == "p" and len(done.token_ids) == 12
  np.testing.assert_array_equal(done.token_ids[1:3], [1, 2])
  with pytest.raises(ValueError, match="no live sequence has request id 'p'"):
    sess.resume("p", [1])
  # `finish` ends a paused sequence: its slot and pages are free at once
  sess.add([Request([3, 4, 5], sp, "f", pause_token_ids=pause)])
  while not sess.run.paused:
    sess.step()
  sess.collect_paused()
  sess.finish("f")
  ended = [c for c in sess.collect() if c.request_id == "f"]
  assert ended[0].finish_reason == "stop" and len(ended[0].token_ids) == 1
  assert all(s is None or s.slot < 0 or s.req.request_id != "f" for s in sess.run.seqs)


def _seq(i, n, new):
  class _Req:
    prompt_ids, request_id = [3] * n, i
    sampling = SamplingParams(max_new_tokens=new)
  return SeqState(req=_Req(), index=i, stop_ids=frozenset(), max_len=n + new)


def test_scheduler_preempts_paused_sequences_first_and_parks_them():
  sched = Scheduler(num_shards=1, num_slots=3, num_pages=11, page_size=4, max_pages_per_seq=16,
                    chunk=4)
  a, b, c = _seq(0, 7, 30), _seq(1, 7, 30), _seq(2, 7, 30)
  sched.submit([a, b, c])
  assert sched.admit() == [a, b, c]  # 3 pages each (7 + 4 tokens) of 10
  for s in (a, b, c):
    s.num_tokens, s.length = 1, 7
  b.paused = True  # b waits for its environment, holding its pages
  assert sched.running() == [a, c] and sched.paused() == [b]
  a.num_tokens, a.length = 9, 15  # a needs 2 more pages, 1 is free: b goes, not c (newer)
  assert sched.grow() == [a, c]
  assert b.slot < 0 and b.pages == [] and b.preemptions == 1 and c.preemptions == 0
  assert list(sched.queue) == [] and sched.stats.paused_preemptions == 1  # parked
  sched.unpark(b)  # its environment's tokens arrived: readmitted next (prompt + history)
  assert list(sched.queue) == [b] and not b.paused


def test_admission_parks_paused_sequences_only_where_nothing_runs():
  sched = Scheduler(num_shards=1, num_slots=2, num_pages=7, page_size=4, max_pages_per_seq=16,
                    chunk=4)
  a, b = _seq(0, 15, 8), _seq(1, 15, 8)
  sched.submit([a])
  assert sched.admit() == [a]  # 5 pages (15 + 4 tokens) of 6
  a.num_tokens, a.length, a.paused = 1, 15, True
  sched.submit([b])
  assert sched.has_work() and sched.running() == []  # b is queued; a alone is paused
  assert sched.admit() == [b]  # only a paused sequence held the pages: it is parked
  assert a.slot < 0 and a.preemptions == 1 and list(sched.queue) == []
