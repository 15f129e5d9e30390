"""Multi-turn trajectories through the real engine: the log-probs the engine recorded for the
policy's tokens equal a teacher-forced recompute of the whole sequence (prompt, policy turns
and environment tokens) at the policy's positions, dense and block-sparse (the prompt dense,
everything after it as decode attends: the trainer's convention), with and without preemption
in the middle of a turn."""

import functools


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.agents import AgentLoop, ToolCall, ToolRegistry
from sparrow_jax.agents.formats import ParsedTurn
from sparrow_jax.agents.tools import Tool
from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.decoder import init_model
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets
from tests.rl.sparse_setup import sharp_tiny

PAGE, NEW, T_PAD = 4, 40, 80
SPARSE = BlockSparse(max_budget=1, page_size=PAGE, dense_layers=(0,))


class EveryTurnCalls:
  """A format whose every turn calls `echo` (the turn ends at the loop's stop id)."""

  name = "echo"
  stop_strings = ()

  def turn_complete(self, text):
    return True

  def parse(self, text):
    return ParsedTurn((ToolCall("echo", {"input": text[-3:]}),))

  def render_responses(self, turn_text, responses):
    return "".join(f"[{r}]" for r in responses)


def sharp_model():
  """The 3-layer sharp tiny model without EOS (a trajectory ends only where the test says)."""
  cfg, _, state = sharp_tiny(num_layers=3)
  m = init_model(cfg.replace(eos_token_ids=()))
  nnx.update(m, state)
  return m


@pytest.fixture(scope="module")
def model():
  return sharp_model()


def _requests():
  rng = np.random.default_rng(0)
  return [Request(list(rng.integers(3, 259, int(n))),
                  SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=50 + i), i)
          for i, n in enumerate(rng.integers(6, 14, 6))]


def _loop(stop_ids):
  reg = ToolRegistry([Tool("echo", "echo", {"type": "object"}, lambda a: "env" + a["input"])])
  loop = AgentLoop(EveryTurnCalls(), reg, ByteTokenizer(), max_turns=3)
  loop.stop_ids = stop_ids
  return loop


def _stop_ids(engine, reqs):
  """Tokens the rollouts sample often: turns end there (the sharp model repeats a few)."""
  outs = engine.generate(reqs)
  counts = np.bincount(np.concatenate([o.token_ids[2:] for o in outs]), minlength=512)
  return tuple(int(t) for t in np.argsort(-counts)[:6])


@functools.partial(jax.jit, static_argnums=(3,))
def _teacher_forced_logp(graphdef, state, toks, attention, prompt_lens):
  kw = {}
  if attention is not None:  # as the trainer's sparse forward: the prompt dense, then decode
    kw = dict(attention=attention, prompt_lengths=prompt_lens,
              budgets=teacher_forced_budgets(as_schedule(attention.max_budget, page_size=PAGE),
                                             toks.shape[1], toks.shape[0]))
  logits = nnx.merge(graphdef, state)(toks, **kw)  # [B, T, V]
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return jnp.take_along_axis(lp[:, :-1], toks[:, 1:, None], -1)[..., 0]  # [B, T-1]


def _check_parity(model, reqs, comps, atol, attention=None):
  graphdef, state = nnx.split(model)
  toks = np.zeros((len(comps), T_PAD), np.int32)
  for j, (r, c) in enumerate(zip(reqs, comps)):
    seq = list(r.prompt_ids) + list(c.token_ids)
    toks[j, :len(seq)] = seq
  plens = jnp.asarray([len(r.prompt_ids) for r in reqs], jnp.int32)
  ref = np.asarray(_teacher_forced_logp(graphdef, state, jnp.asarray(toks), attention, plens))
  for j, (r, c) in enumerate(zip(reqs, comps)):
    p, n = len(r.prompt_ids), len(c.token_ids)
    pol = np.asarray(c.loss_mask) > 0
    np.testing.assert_allclose(c.logprobs[pol], ref[j, p - 1:p - 1 + n][pol], atol=atol,
                               err_msg=f"request {r.request_id}")
    assert np.all(c.logprobs[~pol] == 0)


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
@pytest.mark.parametrize("preempt", [False, True], ids=["fits", "preempted"])
def test_multi_turn_logprobs_match_teacher_forced_recompute(model, preempt, attention):
  reqs = _requests()
  big = GenerationEngine(model, EngineConfig(num_slots=6, max_seq_len=64, page_size=PAGE,
                                             decode_chunk=4), attention=attention)
  stop = _stop_ids(big, reqs)
  ref_loop = _loop(stop)
  ref = ref_loop.run(reqs, big.generate)
  assert sum(r.env_tokens > 0 for r in ref_loop.last_records) >= 3  # real multi-turn rows
  assert max(r.turns for r in ref_loop.last_records) >= 2
  _check_parity(model, reqs, ref, atol=2e-4, attention=attention)
  if attention is not None:  # the sparse actor is not the dense policy here: a real check
    with pytest.raises(AssertionError):
      _check_parity(model, reqs, ref, atol=1e-2, attention=None)
  if not preempt:
    return
  small = GenerationEngine(model, EngineConfig(num_slots=6, max_seq_len=64, page_size=PAGE,
                                               decode_chunk=4, num_pages=16 + 1),
                           attention=attention)
  preemptions = []

  def generate(rs):
    out = small.generate(rs)
    preemptions.append(small.last_stats["preemptions"])
    return out
  loop = _loop(stop)
  out = loop.run(reqs, generate)
  assert sum(preemptions) > 0, preemptions
  for a, b in zip(ref, out):  # the same trajectories, token for token
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
  _check_parity(model, reqs, out, atol=2e-4, attention=attention)


@pytest.mark.parametrize("attention", [None, SPARSE], ids=["dense", "sparse"])
def test_continuation_reproduces_an_uninterrupted_generation(model, attention):
  """A request given the first k generated tokens as its context (`Request.context_ids`)
  generates the same remaining tokens with the same log-probs as the uninterrupted run."""
  reqs = _requests()[:3]
  eng = GenerationEngine(model, EngineConfig(num_slots=3, max_seq_len=64, page_size=PAGE,
                                             decode_chunk=4), attention=attention)
  ref = eng.generate(reqs)
  k = 13  # not a page multiple: the context ends inside a page
  cont = eng.generate([Request(r.prompt_ids, r.sampling, r.request_id,
                               context_ids=tuple(int(t) for t in c.token_ids[:k]))
                       for r, c in zip(reqs, ref)])
  for a, b in zip(ref, cont):
    np.testing.assert_array_equal(b.token_ids, a.token_ids)
    np.testing.assert_allclose(b.logprobs[k:], a.logprobs[k:], atol=2e-4)
    assert np.all(b.logprobs[:k] == 0) and b.preemptions == 0
  with pytest.raises(ValueError, match="40 context tokens leave no token to generate"):
    eng.generate([Request(reqs[0].prompt_ids, reqs[0].sampling, "x", context_ids=(5,) * 40)])
  with pytest.raises(ValueError, match=r"context token ids \[9999\] outside the vocabulary"):
    eng.generate([Request(reqs[0].prompt_ids, reqs[0].sampling, "y", context_ids=(9999,))])
