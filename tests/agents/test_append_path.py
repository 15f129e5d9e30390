"""The agent loop's default path: one engine session in which a sequence pauses at a turn
boundary holding its KV pages and the environment's tokens are appended into them. Its
trajectories equal the re-prefill reference (`Request.context_ids` rounds) token for token
and log-prob for log-prob, and a teacher-forced recompute at the policy's positions, dense and
block-sparse, with and without preemption; the engine prefills only the prompts and appends
only the environment's tokens (plus the token each pause stopped on)."""

import numpy as np
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine
from tests.agents.test_engine_parity import (PAGE, SPARSE, _check_parity, _loop, _requests,
                                             _stop_ids, model)  # noqa: F401 (fixture)


def _env_blocks(c) -> int:
  """Runs of environment tokens in a trajectory (one `resume` with tokens each)."""
  env = np.asarray(c.loss_mask) == 0
  return int(np.sum(env[1:] & ~env[:-1]) + (env.size > 0 and env[0]))


def _engine(model, attention, **kw):
  return GenerationEngine(model, EngineConfig(num_slots=6, max_seq_len=64, page_size=PAGE,
                                              decode_chunk=4, **kw), attention=attention)


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
def test_append_path_equals_reprefill_path(model, attention):
  reqs = _requests()
  eng = _engine(model, attention)
  stop = _stop_ids(eng, reqs)
  ref_loop = _loop(stop)
  prefill_ref = []

  def generate(rs):
    out = eng.generate(rs)
    prefill_ref.append(eng.last_stats["prefill_tokens"])
    return out
  ref = ref_loop.run(reqs, generate)
  loop = _loop(stop)
  out = loop.run(reqs, engine=eng)
  stats = eng.last_stats
  assert max(r.turns for r in loop.last_records) >= 2
  assert sum(r.env_tokens > 0 for r in loop.last_records) >= 3
  for a, b in zip(ref, out):
    assert b.finish_reason == a.finish_reason
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-4)
  _check_parity(model, reqs, out, atol=2e-4, attention=attention)
  # Only the prompts were prefilled; the appends wrote each environment block and the token
  # its pause stopped on, nothing of the history.
  assert stats["preemptions"] == 0
  assert stats["prefill_tokens"] == sum(len(r.prompt_ids) for r in reqs)
  env = sum(r.env_tokens for r in loop.last_records)
  assert stats["append_tokens"] == env + sum(_env_blocks(c) for c in out)
  assert sum(prefill_ref) > stats["prefill_tokens"] + env  # the reference re-prefilled


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
def test_append_path_with_preemption(model, attention):
  """A pool too small for every trajectory: sequences are preempted mid-turn, while paused
  and after a resume, and readmitted with their context prefilled: the same trajectories."""
  reqs = _requests()
  big = _engine(model, attention)
  stop = _stop_ids(big, reqs)
  ref = _loop(stop).run(reqs, engine=big)
  small = _engine(model, attention, num_pages=16 + 1)
  out = _loop(stop).run(reqs, engine=small)
  assert small.last_stats["preemptions"] > 0
  assert small.last_stats["recomputed_tokens"] > 0
  for a, b in zip(ref, out):
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-4)
  _check_parity(model, reqs, out, atol=2e-4, attention=attention)
