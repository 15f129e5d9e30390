"""The agent loop: multi-turn, tool-using rollouts over an engine session (or any
`generate(requests)`).

One trajectory is the prompt, then turns: the policy generates until the end of its turn (its
EOS, or a stop string of the tool format), the format parses the turn's tool calls, the
registry runs them, and the tool responses (the environment's tokens) are appended; the policy
then goes on from the whole context. A trajectory ends at a turn without a call, at
`max_turns` policy turns, or when its response budget (`max_new_tokens`: policy and
environment tokens together) is spent. tunix's trajectory collector and verl's agent loop
play the same part.

Two ways to run the turns, with the same trajectories token for token:

  `run(requests, engine=engine)` (the default of training, eval and generate): one rollout
    session (`engine/session.py`). Every request carries the ids that end a turn (the
    format's stop ids, its own stop ids, EOS) as `pause_token_ids`: at a turn's end the
    sequence *pauses* holding its KV pages (`finish` ends it when the turn was the last),
    the loop runs the turn's tools as soon as the step it paused in returns, and
    `session.resume` appends the tool responses; the engine writes only those tokens into the
    sequence's own pages at their true positions (one chunked prefill at the sequence's end,
    every query attending as decode would there) and it decodes on. The history is never
    prefilled again: the engine's `prefill_tokens` are the prompts (plus readmissions after
    a preemption) and its `append_tokens` the environment's tokens (plus the token each
    pause stopped on).
  `run(requests, generate)` (the reference): rounds; each sends every live trajectory to
    `generate` as one request, the trajectory so far as its context (`Request.context_ids`),
    which the engine prefills as it readmits a preempted sequence (block-sparse beyond the
    prompt, as decode attended): the whole history is prefilled again every round.

Either way the engine samples the token at position p from `fold_in(key(seed), p)`, so a
trajectory's tokens do not depend on how its turns were split or where its KV came from, and
every policy token's log-prob is the one a teacher-forced sparse forward of the whole
trajectory gives at its position (the recompute's convention: the prompt dense, everything
after it as decode attends).

The result is one `Completion` per request, in request order: `token_ids` every response token
(policy and environment), `logprobs` the policy's (0 on environment tokens), `loss_mask` 1 on
the policy's tokens and 0 on the environment's, and per-trajectory `AgentRecord`s (turns, tool
calls, errors, timeouts, environment tokens) for the metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from sparrow_jax.agents.tools import ToolRegistry, truncate_tokens
from sparrow_jax.engine.config import Completion, Request
from sparrow_jax.models.checkpoints.byte_tokenizer import ByteTokenizer


@dataclasses.dataclass
class AgentRecord:
  """What one trajectory did."""

  turns: int = 0  # policy turns
  tool_calls: int = 0  # calls executed or answered with an error (malformed ones included)
  tool_errors: int = 0  # malformed calls, unknown tools, failing tools, timeouts
  tool_timeouts: int = 0
  env_tokens: int = 0
  policy_tokens: int = 0
  tool_seconds: float = 0.0


class TextCodec:
  """encode(text) -> ids (no BOS, special tokens in the text mapped to their ids) and
  decode(ids) -> text (special tokens kept) for a byte tokenizer or a transformers one."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._byte = isinstance(tokenizer, ByteTokenizer)

  def encode(self, text: str) -> list[int]:
    if self._byte:
      return list(self.tokenizer.encode(text, add_bos=False))
    return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def stop_ids(self, strings: Sequence[str]) -> tuple[int, ...]:
    """Token ids of stop strings that are one token each (a longer one cannot stop the
    engine, which stops on ids)."""
    out = []
    for s in strings:
      ids = self.encode(s)
      if len(ids) != 1:
        raise ValueError(f"tool format stop string {s!r} is {len(ids)} tokens for this "
                         "tokenizer; the engine stops on single token ids")
      out.append(ids[0])
    return tuple(out)


@dataclasses.dataclass
class _Traj:
  req: Request
  ids: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  mask: list = dataclasses.field(default_factory=list)
  topk_ids: list = dataclasses.field(default_factory=list)
  topk_lp: list = dataclasses.field(default_factory=list)
  turn_start: int = 0  # index in ids where the current policy turn began
  finish: str = ""
  preemptions: int = 0
  record: AgentRecord = dataclasses.field(default_factory=AgentRecord)


class AgentLoop:
  """Runs trajectories of `requests` through `generate` with `registry`'s tools.

  `max_turns`: policy turns per trajectory (a call in the last one is not executed).
  `max_tool_response_tokens`: each tool response is cut to this many tokens before it is
  rendered."""

  def __init__(self, fmt, registry: ToolRegistry, tokenizer, *, max_turns: int,
               max_tool_response_tokens: int = 256, topk: int = 0):
    if max_turns < 1:
      raise ValueError(f"max_turns={max_turns}: expected >= 1")
    self.fmt, self.registry, self.max_turns = fmt, registry, max_turns
    self.max_tool_response_tokens = max_tool_response_tokens
    self.codec = TextCodec(tokenizer)
    self.stop_ids = self.codec.stop_ids(fmt.stop_strings)
    self.topk = topk
    self.last_records: list[AgentRecord] = []
    self.rounds = 0  # engine calls of the last run

  def run(self, requests: Sequence[Request],
          generate: Callable[[list[Request]], list[Completion]] | None = None, *,
          engine=None, lora=None) -> list[Completion]:
    """Trajectories of `requests`: through a rollout session of `engine` (a
    `GenerationEngine`; `lora` the sparse actor's adapter; the engine's `last_stats` hold the
    session's counters afterwards) or, given `generate`, in re-prefill rounds."""
    if (generate is None) == (engine is None):
      raise ValueError("AgentLoop.run: pass exactly one of generate (re-prefill rounds) and "
                       "engine (a session that pauses and appends)")
    if engine is not None:
      return self._run_session(requests, engine, lora)
    trajs = [_Traj(r) for r in requests]
    live = list(range(len(trajs)))
    self.rounds = 0
    while live:
      reqs = [self._turn_request(trajs[i]) for i in live]
      outs = generate(reqs)
      self.rounds += 1
      nxt = []
      for i, c in zip(live, outs):
        if self._absorb(trajs[i], c):
          nxt.append(i)
      live = nxt
    self.last_records = [t.record for t in trajs]
    return [self._completion(t) for t in trajs]

  def _run_session(self, requests, engine, lora) -> list[Completion]:
    from sparrow_jax.engine.session import EngineSession  # (agents sit above the engine)
    trajs = [_Traj(r) for r in requests]
    session = EngineSession(engine, lora=lora)
    # Every id that ends a turn pauses (the format's stop ids, the request's, EOS): the loop
    # decides, as after a round of the reference path, whether the trajectory goes on. The
    # request id is the trajectory's index: unique, whatever the callers' ids are.
    eos = tuple(engine.model_config.eos_token_ids)
    session.add([Request(t.req.prompt_ids, t.req.sampling, j, t.req.group,
                         pause_token_ids=tuple(sorted(
                             set(self.stop_ids) | set(t.req.sampling.stop_token_ids)
                             | set(() if t.req.sampling.ignore_eos else eos))))
                 for j, t in enumerate(trajs)])
    self.rounds = 0
    while session.has_work():
      session.step()
      paused = session.collect_paused()
      self.rounds += bool(paused)
      for c in paused:
        t = trajs[c.request_id]
        k = len(c.token_ids)
        if self._absorb(t, dataclasses.replace(c, finish_reason="stop")):
          session.resume(c.request_id, t.ids[k:])
        else:
          session.finish(c.request_id)
      for c in session.collect():
        t = trajs[c.request_id]
        if not t.finish:  # (one `finish`ed above is complete already)
          if self._absorb(t, c):
            raise AssertionError(f"request {t.req.request_id!r} finished with "
                                 f"{c.finish_reason!r} but its turn goes on")
    engine.record_stats(session)
    self.last_records = [t.record for t in trajs]
    return [self._completion(t) for t in trajs]

  def _turn_request(self, t: _Traj) -> Request:
    s = t.req.sampling
    sampling = dataclasses.replace(
        s, stop_token_ids=tuple(sorted(set(s.stop_token_ids) | set(self.stop_ids))))
    return Request(t.req.prompt_ids, sampling, t.req.request_id, t.req.group,
                   context_ids=tuple(t.ids))

  def _absorb(self, t: _Traj, c: Completion) -> bool:
    """Adds a round's tokens to `t`; runs the turn's tools. True: the trajectory goes on."""
    k = len(t.ids)  # the completion leads with the context it was given
    if [int(x) for x in c.token_ids[:k]] != t.ids:
      raise RuntimeError(f"request {t.req.request_id!r}: the completion does not start with "
                         "its context tokens")
    new = slice(k, None)
    n = len(c.token_ids) - k
    t.ids += [int(x) for x in c.token_ids[new]]
    t.logp += [float(x) for x in c.logprobs[new]]
    t.mask += [1] * n
    t.preemptions += c.preemptions
    if self.topk:
      t.topk_ids.append(np.asarray(c.topk_ids, np.int32)[new].reshape(n, self.topk))
      t.topk_lp.append(np.asarray(c.topk_logprobs, np.float32)[new].reshape(n, self.topk))
    t.record.policy_tokens += n
    budget = t.req.sampling.max_new_tokens - len(t.ids)
    text = self.codec.decode(t.ids[t.turn_start:])
    stopped_on_format = (c.finish_reason == "stop" and n > 0
                         and int(c.token_ids[-1]) in self.stop_ids)
    if stopped_on_format and not self.fmt.turn_complete(text) and budget > 0:
      return True  # a stop character inside the turn: the same turn goes on
    t.record.turns += 1
    if c.finish_reason != "stop":
      t.finish = c.finish_reason
      return False
    turn = self.fmt.parse(text)
    if turn.final:
      t.finish = "stop"
      return False
    if t.record.turns >= self.max_turns:
      t.finish = "turns"
      return False
    responses = [self._respond(t.record, x) for x in turn.items]
    env = self.codec.encode(self.fmt.render_responses(text, responses))
    if len(env) >= budget:  # no room for the responses and one more policy token
      t.finish = "length"
      return False
    t.ids += env
    t.logp += [0.0] * len(env)
    t.mask += [0] * len(env)
    if self.topk:
      t.topk_ids.append(np.zeros((len(env), self.topk), np.int32))
      t.topk_lp.append(np.full((len(env), self.topk), -1e9, np.float32))
    t.record.env_tokens += len(env)
    t.turn_start = len(t.ids)
    return True

  def _respond(self, rec: AgentRecord, item) -> str:
    rec.tool_calls += 1
    if isinstance(item, str):  # a malformed call: its error is the response
      rec.tool_errors += 1
      return item
    res = self.registry.call(item.name, item.arguments)
    rec.tool_errors += int(res.error)
    rec.tool_timeouts += int(res.timeout)
    rec.tool_seconds += res.seconds
    return truncate_tokens(res.text, self.codec.encode, self.codec.decode,
                           self.max_tool_response_tokens)

  def _completion(self, t: _Traj) -> Completion:
    k = self.topk
    return Completion(
        request_id=t.req.request_id, prompt_ids=np.asarray(t.req.prompt_ids, np.int32),
        token_ids=np.asarray(t.ids, np.int32), logprobs=np.asarray(t.logp, np.float32),
        finish_reason=t.finish,
        topk_ids=np.concatenate(t.topk_ids) if k and t.topk_ids else None,
        topk_logprobs=np.concatenate(t.topk_lp) if k and t.topk_lp else None,
        preemptions=t.preemptions, loss_mask=np.asarray(t.mask, np.float32))


def final_answer_ids(c: Completion) -> np.ndarray:
  """The response tokens after the last environment token: the trajectory's answer turn."""
  if c.loss_mask is None:
    return np.asarray(c.token_ids)
  env = np.flatnonzero(np.asarray(c.loss_mask) == 0)
  return np.asarray(c.token_ids)[env[-1] + 1:] if env.size else np.asarray(c.token_ids)


def agent_metrics(records: Sequence[AgentRecord], rewards: np.ndarray,
                  prefix: str = "agent/") -> dict[str, float]:
  """Per-step metrics of trajectories and their rewards (aligned)."""
  if not records:
    return {}
  rewards = np.asarray(rewards, np.float64)
  calls = np.asarray([r.tool_calls for r in records])
  env = sum(r.env_tokens for r in records)
  total = env + sum(r.policy_tokens for r in records)
  used = calls > 0
  out = {
      f"{prefix}turns_mean": float(np.mean([r.turns for r in records])),
      f"{prefix}tool_calls_mean": float(calls.mean()),
      f"{prefix}frac_with_tool_call": float(used.mean()),
      f"{prefix}tool_errors": int(sum(r.tool_errors for r in records)),
      f"{prefix}tool_timeouts": int(sum(r.tool_timeouts for r in records)),
      f"{prefix}env_token_frac": env / total if total else 0.0,
      f"{prefix}tool_s": float(sum(r.tool_seconds for r in records)),
      # NaN when no trajectory of the step falls on that side
      f"{prefix}reward_with_tool": float(rewards[used].mean()) if used.any() else float("nan"),
      f"{prefix}reward_without_tool": (float(rewards[~used].mean()) if (~used).any()
                                       else float("nan")),
  }
  return out
