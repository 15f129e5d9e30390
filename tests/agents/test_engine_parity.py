"""Multi-turn trajectories through the real engine: the log-probs the engine recorded for the
policy's tokens equal a teacher-forced recompute of the whole sequence (prompt, policy turns
and environment tokens) at the policy's positions, with and without preemption in the middle
of a turn."""

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
from sparrow_jax.models.decoder import init_model
from sparrow_jax.rl.tokenizers import ByteTokenizer
from tests.rl.sparse_setup import sharp_tiny

PAGE, NEW, T_PAD = 4, 40, 80


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


@pytest.fixture(scope="module")
def model():
  cfg, _, state = sharp_tiny(num_layers=3)
  m = init_model(cfg.replace(eos_token_ids=()))
  nnx.update(m, state)
  return m


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


@jax.jit
def _dense_logp(graphdef, state, toks):
  logits = nnx.merge(graphdef, state)(toks)  # [B, T, V]
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return jnp.take_along_axis(lp[:, :-1], toks[:, 1:, None], -1)[..., 0]  # [B, T-1]


def _check_parity(model, reqs, comps, atol):
  graphdef, state = nnx.split(model)
  toks = np.zeros((len(comps), T_PAD), np.int32)
  for j, (r, c) in enumerate(zip(reqs, comps)):
    seq = list(r.prompt_ids) + list(c.token_ids)
    toks[j, :len(seq)] = seq
  ref = np.asarray(_dense_logp(graphdef, state, jnp.asarray(toks)))
  for j, (r, c) in enumerate(zip(reqs, comps)):
    p, n = len(r.prompt_ids), len(c.token_ids)
    pol = np.asarray(c.loss_mask) > 0
    np.testing.assert_allclose(c.logprobs[pol], ref[j, p - 1:p - 1 + n][pol], atol=atol,
                               err_msg=f"request {r.request_id}")
    assert np.all(c.logprobs[~pol] == 0)


@pytest.mark.parametrize("preempt", [False, True], ids=["fits", "preempted"])
def test_dense_multi_turn_logprobs_match_teacher_forced_recompute(model, preempt):
  reqs = _requests()
  big = GenerationEngine(model, EngineConfig(num_slots=6, max_seq_len=64, page_size=PAGE,
                                             decode_chunk=4))
  stop = _stop_ids(big, reqs)
  ref_loop = _loop(stop)
  ref = ref_loop.run(reqs, big.generate)
  assert sum(r.env_tokens > 0 for r in ref_loop.last_records) >= 3  # real multi-turn rows
  assert max(r.turns for r in ref_loop.last_records) >= 2
  _check_parity(model, reqs, ref, atol=1e-4)
  if not preempt:
    return
  small = GenerationEngine(model, EngineConfig(num_slots=6, max_seq_len=64, page_size=PAGE,
                                               decode_chunk=4, num_pages=16 + 1))
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
  _check_parity(model, reqs, out, atol=2e-4)
