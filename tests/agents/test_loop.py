"""The agent loop over a scripted `generate`: turns, environment tokens with loss mask 0,
malformed calls and failing tools as error turns, max_turns, the response budget, metrics."""

import numpy as np
import pytest

from sparrow_jax.agents import AgentLoop, agent_metrics, build_registry, final_answer_ids
from sparrow_jax.agents.formats import make_format
from sparrow_jax.engine.config import Completion, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.rl.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
EOS = 2


def scripted(turns_by_request):
  """A `generate` whose request r answers its k-th call with turns_by_request[r][k] (text;
  ending at EOS unless it ends with the plain format's '>'), stopping at the first stop id
  and leading with the request's context like the engine; records what it was given."""
  calls = {}
  seen = []

  def generate(reqs):
    out = []
    for r in reqs:
      seen.append((r.request_id, list(r.prompt_ids), r.sampling, list(r.context_ids)))
      ctx = list(r.context_ids)
      budget = r.sampling.max_new_tokens - len(ctx)
      k = calls.get(r.request_id, 0)
      calls[r.request_id] = k + 1
      text = turns_by_request[r.request_id][k]
      ids = TOK.encode(text, add_bos=False) + ([] if text.endswith(">") else [EOS])
      stop = set(r.sampling.stop_token_ids) | {EOS}
      cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
      reason = "stop" if cut <= budget and ids[cut - 1] in stop else "length"
      ids = ctx + ids[:min(cut, budget)]
      n = len(ids)
      out.append(Completion(request_id=r.request_id, prompt_ids=np.asarray(r.prompt_ids),
                            token_ids=np.asarray(ids, np.int32),
                            logprobs=-np.arange(1, n + 1, dtype=np.float32) / 10,
                            finish_reason=reason,
                            topk_ids=np.ones((n, 2), np.int32),
                            topk_logprobs=np.zeros((n, 2), np.float32)))
    return out
  return generate, seen


def _loop(max_turns=3, tools="calculator,python"):
  reg = build_registry(tools, python_timeout_s=1.0)
  return AgentLoop(make_format("plain", reg), reg, TOK, max_turns=max_turns,
                   max_tool_response_tokens=40, topk=2)


def _req(rid, max_new=200, prompt="12*34="):
  return Request(TOK.encode(prompt), SamplingParams(max_new_tokens=max_new, seed=7), rid, rid)


def test_two_turn_trajectory_masks_environment_tokens():
  gen, seen = scripted({0: ["<tool calculator 12*34>", "408"], 1: ["408"]})
  loop = _loop()
  comps = loop.run([_req(0), _req(1)], gen)
  c = comps[0]
  text = TOK.decode(c.token_ids)
  assert text == "<tool calculator 12*34><result 408>408"
  env = TOK.encode("<result 408>", add_bos=False)
  call = TOK.encode("<tool calculator 12*34>", add_bos=False)
  want_mask = [1] * len(call) + [0] * len(env) + [1] * 4  # "408" + EOS
  assert c.loss_mask.tolist() == want_mask
  assert np.all(c.logprobs[np.asarray(want_mask) == 0] == 0)
  assert c.topk_ids.shape == (len(want_mask), 2) and c.finish_reason == "stop"
  assert TOK.decode(final_answer_ids(c)) == "408"
  # round 2 of request 0: the original prompt, the trajectory so far as its context, the
  # same seed and budget, the format's stop id added
  rid, prompt, sp, ctx = seen[2]
  assert rid == 0 and prompt == TOK.encode("12*34=") and ctx == call + env
  assert sp.seed == 7 and sp.max_new_tokens == 200
  assert TOK.encode(">", add_bos=False)[0] in sp.stop_token_ids
  r0, r1 = loop.last_records
  assert (r0.turns, r0.tool_calls, r0.tool_errors, r0.env_tokens) == (2, 1, 0, len(env))
  assert (r1.turns, r1.tool_calls, comps[1].loss_mask.tolist()) == (1, 0, [1] * 4)
  m = agent_metrics(loop.last_records, np.asarray([1.0, 0.0]))
  assert m["agent/tool_calls_mean"] == 0.5 and m["agent/turns_mean"] == 1.5
  assert m["agent/reward_with_tool"] == 1.0 and m["agent/reward_without_tool"] == 0.0
  assert m["agent/env_token_frac"] == pytest.approx(
      len(env) / (len(c.token_ids) + len(comps[1].token_ids)))


def test_malformed_and_failing_calls_become_error_turns():
  gen, _ = scripted({0: ["<tool calculator 1/0>", "<tool abacus 1>", "<tool >", "0"]})
  loop = _loop(max_turns=5)
  c, = loop.run([_req(0)], gen)
  text = TOK.decode(c.token_ids)
  assert "<result Error: division by zero>" in text
  assert "<result Error: unknown tool 'abacu...[truncated]>" in text  # 40-token budget
  assert "<result Error: the tool call names no tool>" in text
  r, = loop.last_records
  assert (r.turns, r.tool_calls, r.tool_errors, r.tool_timeouts) == (4, 3, 3, 0)


def test_hanging_tool_costs_its_timeout_and_is_counted():
  gen, _ = scripted({0: ["<tool python while True: pass>", "done"]})
  loop = _loop()
  c, = loop.run([_req(0)], gen)
  r, = loop.last_records
  assert r.tool_timeouts == 1 and r.tool_errors == 1 and 1.0 <= r.tool_seconds < 6
  assert "<result Error: python timed out after 1 s>" in TOK.decode(c.token_ids)


def test_stop_character_inside_a_turn_continues_the_turn():
  gen, seen = scripted({0: ["3>", "2 so <tool calculator 3-2>", "1"]})
  loop = _loop()
  c, = loop.run([_req(0)], gen)
  assert TOK.decode(c.token_ids) == "3>2 so <tool calculator 3-2><result 1>1"
  assert loop.last_records[0].turns == 2 and loop.rounds == 3


def test_max_turns_and_budget_end_a_trajectory():
  gen, _ = scripted({0: ["<tool calculator 1+1>", "<tool calculator 2+2>", "x"]})
  loop = _loop(max_turns=2)
  c, = loop.run([_req(0)], gen)
  assert c.finish_reason == "turns" and loop.last_records[0].turns == 2
  assert TOK.decode(c.token_ids).endswith("<tool calculator 2+2>")  # not executed
  # a response budget with no room for the tool response
  gen, _ = scripted({0: ["<tool calculator 1+1>", "2"]})
  c, = _loop().run([_req(0, max_new=25)], gen)
  assert c.finish_reason == "length" and c.loss_mask.tolist() == [1] * 21
  # the budget counts environment tokens: the answer turn gets what is left
  gen, seen = scripted({0: ["<tool calculator 1+1>", "22222222"]})
  c, = _loop().run([_req(0, max_new=36)], gen)
  assert len(c.token_ids) == 36 and c.finish_reason == "length"


def test_tool_response_cut_to_token_budget():
  gen, _ = scripted({0: ["<tool python print('w' * 500)>", "ok"]})
  c, = _loop().run([_req(0, max_new=400)], gen)
  text = TOK.decode(c.token_ids)
  resp = text.split("<result ", 1)[1].split(">", 1)[0]
  assert len(resp) <= 40 and resp.endswith("...[truncated]")
