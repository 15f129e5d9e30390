"""The rollout side of a step: a rollout interface over the engine, and the producer that turns
prompts into a scored, typed batch for the learner.

    RolloutEngine  what the producer needs of an inference engine: `generate` a set of requests
                   (completions with per-token actor log-probs and top-k), `update_weights`
                   (new policy weights and LoRA, with their version), `set_schedule`,
                   `release` (free the KV pool while the learner runs).
    EngineRollout  the project's `GenerationEngine` behind that interface, over every process
                   of a multi-host job: each process generates its share of the prompt groups
                   on its own devices and the completions are gathered in request order.
    Producer       prompts -> rollouts -> rewards (verifier pool) -> DAPO refill rounds ->
                   ARRoL's survivors -> `TrainBatch` (row j = completion j) with each token's
                   policy version and the per-token loss mask.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import numpy as np

from sparrow_jax.agents import AgentLoop, agent_metrics, build_registry, final_answer_ids
from sparrow_jax.agents import make_format
from sparrow_jax.engine.config import Completion
from sparrow_jax.engine.engine import GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams, request_seed
from sparrow_jax.engine.session import EngineSession
from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl import grpo
from sparrow_jax.rl import rewards as rewards_lib
from sparrow_jax.rl.verifier_pool import RewardScorer
from sparrow_jax.run import distributed
from sparrow_jax.run.batch import GenerationInfo, TrainBatch, make_batch
from sparrow_jax.run.builders import encode_prompt

# Engine stats of each rollout the step logs (see `engine.GenerationEngine`).
ENGINE_METRICS = ("preemptions", "recomputed_tokens", "pool_high_water_frac",
                  "wasted_decode_steps", "idle_slot_steps", "decode_steps",
                  "wasted_prefill_tokens", "prefill_padding_frac", "prefill_tokens",
                  "append_tokens")


class RolloutEngine(Protocol):
  """What the producer needs of an inference engine."""

  stats: dict[str, float]  # counters of the last `generate`
  version: int  # the policy version of the weights it holds

  def generate(self, requests: Sequence[Request], *, lora=..., prune=None
               ) -> list[Completion]: ...

  def update_weights(self, params, *, lora=None, version: int) -> None: ...

  def set_schedule(self, attention, schedule) -> None: ...

  def release(self) -> None: ...


class EngineRollout:
  """`GenerationEngine` behind `RolloutEngine`, over every process of the job."""

  def __init__(self, engine, *, topk: int, release_kv_cache: bool = True):
    self.engine = engine
    self.topk = topk
    self.release_kv_cache = release_kv_cache
    self.stats: dict[str, float] = {}
    self.version = 0
    self.lora = None  # the sparse actor's LoRA of `update_weights`
    self.session: EngineSession | None = None  # asynchronous training's long-lived rollout
    self.on_running = "keep"  # what the session's running sequences do at an update

  @property
  def num_compilations(self) -> int:
    return self.engine.num_compilations

  def generate(self, requests, *, lora=..., prune=None) -> list[Completion]:
    """`engine.generate` of `requests` over every process: each generates the requests of its
    `distributed.prompt_range` of the prompts on its own devices, then the completions are
    gathered so every process returns all of them in request order (one process: the
    engine's result). `lora`: the sparse actor's LoRA (None: none; left out: the one of
    `update_weights`). `stats` holds the engine counters of the call, summed over
    processes."""
    lora = self.lora if lora is ... else lora
    if not distributed.is_multi():
      out = self.engine.generate(requests, lora=lora, prune=prune)
      self.stats = dict(self.engine.last_stats)
      return out
    mine = distributed.local_request_index(requests)
    local = (self.engine.generate([requests[j] for j in mine], lora=lora, prune=prune)
             if len(mine) else [])
    stats = self.engine.last_stats if len(mine) else {}
    self.stats = distributed.merge_stats(stats, ENGINE_METRICS)
    return distributed.gather_completions(local, mine, requests, topk=self.topk,
                                          make=Completion)

  def open_session(self, on_running: str = "keep") -> EngineSession:
    """The long-lived rollout session of asynchronous training (created on first use, with
    the LoRA of `update_weights`); from now on `update_weights` loads into it between chunks
    (`on_running`: keep | recompute | drain, `engine/session.py`) and `release` keeps the
    pool (the running sequences hold pages across steps)."""
    if self.session is None:
      self.session = EngineSession(self.engine, lora=self.lora)
    self.on_running = on_running
    return self.session

  def update_weights(self, params, *, lora=None, version: int) -> None:
    """New policy weights (and the sparse actor's LoRA) for the next rollouts; every token
    sampled from now on records `version`."""
    if self.session is not None:
      self.session.update_weights(params, lora=lora, version=version,
                                  on_running=self.on_running)
    else:
      self.engine.set_state(params, version=version)
    self.lora = lora
    self.version = version

  def set_schedule(self, attention, schedule) -> None:
    self.engine.set_attention(attention, None if schedule is None or schedule.is_dense
                              else schedule)

  def release(self) -> None:
    """Free the KV pool while the learner runs (`release_kv_cache`; the next rollout rebuilds
    it at the same size)."""
    if self.release_kv_cache and self.session is None:
      self.engine.release_kv_pool()


class Producer:
  """Prompts -> scored groups -> `TrainBatch`."""

  def __init__(self, cfg, tokenizer, dataset, rollout: EngineRollout, *, arrol=None,
               arrol_stop_ids=None):
    self.cfg = cfg
    self.tokenizer = tokenizer
    self.dataset = dataset
    self.rollout_engine = rollout
    self.arrol = arrol
    self.arrol_stop_ids = arrol_stop_ids
    self.prune_hook = None  # ARRoL's engine hook of the latest rollout
    self._scorer: RewardScorer | None = None  # started on first use
    self.agent = make_agent_loop(cfg, tokenizer)  # multi-turn tool use (`tools`), or None
    self.metrics: dict[str, float] = {}  # the latest batch's producer metrics (async/*)

  # --- verifiers ------------------------------------------------------------------------
  @property
  def scorer(self) -> RewardScorer:
    """The run's verifier pool: processes started on first use, reused until `close()`."""
    if self._scorer is None:
      # By name: a custom verifier's spec goes to the workers, each of which loads it itself.
      self._scorer = RewardScorer(self.cfg.reward, timeout_s=self.cfg.reward_timeout_s,
                                  num_workers=self.cfg.reward_workers, backend="process")
    return self._scorer

  def close(self) -> None:
    """Stops the verifier processes (a later `score` starts new ones)."""
    if self._scorer is not None:
      self._scorer.close()
      self._scorer = None

  def score(self, examples, completions):
    """Rewards [n] of `completions` against their prompts' answers, and the verifier result."""
    cfg = self.cfg
    # A multi-turn trajectory is scored on its answer: the tokens after the last tool response.
    texts = [self.tokenizer.decode(final_answer_ids(c), skip_special_tokens=True)
             for c in completions]
    answers = [examples[c.request_id[0]].answer for c in completions]
    res = self.scorer(texts, answers)
    r = np.asarray(res.rewards, np.float32)
    if cfg.overlong_buffer:
      r = r + rewards_lib.overlong_penalty([len(c.token_ids) for c in completions],
                                           max_len=cfg.max_new_tokens,
                                           buffer_len=cfg.overlong_buffer)
    return r, res

  # --- rollouts -------------------------------------------------------------------------
  def response_budget(self, seed: int) -> int:
    """max_new_tokens of the request with sampling `seed`: the config's (a benchmark draws a
    length law here, with ignore_eos=true)."""
    return self.cfg.max_new_tokens

  def requests(self, examples, step: int, round_: int = 0) -> list[Request]:
    """G samples of every prompt; `round_` > 0 are dynamic-sampling refills (other seeds)."""
    cfg = self.cfg
    reqs = []
    for i, e in enumerate(examples):
      ids = encode_prompt(self.tokenizer, e, cfg.chat_template)
      for g in range(cfg.group_size):
        seed = request_seed(cfg.seed, step, round_, i, g)
        reqs.append(Request(ids, self.sampling(seed), (i, g), group=(round_, i)))
    return reqs

  def sampling(self, seed: int) -> SamplingParams:
    """The sampling parameters of the rollout request with sampling `seed`."""
    cfg = self.cfg
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=self.response_budget(seed), seed=seed,
                          ignore_eos=cfg.ignore_eos)

  def rollout(self, examples, step: int, round_: int = 0, *, lora=None) -> list[Completion]:
    """The completions of `examples`' groups (`lora`: the sparse actor's, or None)."""
    self.prune_hook = None
    if self.arrol is not None:
      self.prune_hook = arrol_lib.ArrolHook(self.arrol, self.arrol_stop_ids,
                                            seed=self.cfg.seed, step=step)
    reqs = self.requests(examples, step, round_)
    if self.agent is not None:
      return run_agent(self.agent, self.rollout_engine, reqs, lora)
    return self.rollout_engine.generate(reqs, lora=lora, prune=self.prune_hook)

  def generate_groups(self, step: int, *, lora=None
                      ) -> tuple[list, np.ndarray, list, GenerationInfo]:
    """Rollouts and rewards of one step -> (completions, rewards [B], their examples, info).

    Without dynamic sampling: one round of `prompts_per_step` groups. With it (DAPO), groups
    whose rewards are all equal carry no signal; while fewer than `prompts_per_step`
    informative groups are at hand, up to `max_refill_rounds` more rounds of new prompts are
    generated (the data position advances, so it is checkpointed). The batch is the first
    informative groups, then, if rounds ran out, zero-variance groups that the loss masks out,
    so its shape never changes. `info` carries every generated completion and reward.
    """
    cfg = self.cfg
    g, n_prompts = cfg.group_size, cfg.prompts_per_step
    pool = grpo.GroupPool(g, keep_dropped=True)
    comps, rewards, results, pruned_comps, comp_examples = [], [], [], [], []
    records = []  # the agent loop's record of each completion (multi-turn)
    engine_stats = {k: 0 for k in ENGINE_METRICS}
    t_roll = t_score = 0.0
    while True:
      examples = self.dataset.next_batch()
      t0 = time.perf_counter()
      new = self.rollout(examples, step, len(results), lora=lora)
      if self.arrol is not None:  # pruned rollouts have no answer to score: they leave here
        pruned_comps += [c for c in new if c.pruned]
        new = [c for c in new if not c.pruned]
      t1 = time.perf_counter()
      if self.agent is not None:
        records += self.agent.last_records
      comp_examples += [examples[c.request_id[0]] for c in new]
      _add_engine_stats(engine_stats, self.rollout_engine.stats)
      r, res = self.score(examples, new)
      t_roll, t_score = t_roll + t1 - t0, t_score + time.perf_counter() - t1
      if cfg.dynamic_sampling:  # (ARRoL's groups are ragged; it excludes dynamic sampling)
        pool.add(r, index=np.arange(len(comps), len(comps) + len(new)))
      comps += new
      rewards.append(r)
      results.append(res)
      if (not cfg.dynamic_sampling or pool.num_groups >= n_prompts
          or len(results) > cfg.max_refill_rounds):
        break
    rewards = np.concatenate(rewards)  # [rounds * B]
    # One round: the batch in generation order; more: informative groups first.
    index = (np.arange(len(comps)) if len(results) == 1
             else pool.take(n_prompts)[0]["index"])
    info = GenerationInfo(
        completions=comps, rewards=rewards, rounds=len(results), rollout_s=t_roll,
        reward_s=t_score, engine=engine_stats, pruned=pruned_comps,
        num_errors=sum(x.num_errors for x in results),
        num_timeouts=sum(x.num_timeouts for x in results), prune_hook=self.prune_hook,
        agent=agent_metrics(records, rewards) if self.agent is not None else {})
    return ([comps[i] for i in index], rewards[index], [comp_examples[i] for i in index],
            info)

  def produce(self, step: int, *, version: int, schedule, lora=None) -> TrainBatch:
    """One step's scored batch, generated by the engine's current weights (policy `version`)
    under `schedule` with `lora`."""
    comps, rewards, examples, info = self.generate_groups(step, lora=lora)
    return make_batch(comps, max_new_tokens=self.cfg.max_new_tokens,
                      topk=self.cfg.monitor_topk, step=step, examples=examples,
                      rewards=rewards, version=version, schedule=schedule, lora=lora,
                      info=info)


  def state_dict(self) -> dict | None:
    """What a checkpoint keeps of the producer (synchronous: nothing beyond the data
    position)."""
    return None

  def load_state_dict(self, state: dict | None) -> None:
    pass


def run_agent(agent: AgentLoop, rollout_engine, reqs, lora) -> list[Completion]:
  """The agent loop's trajectories of `reqs` on `rollout_engine`, whose `stats` then hold
  the engine's counters of all their turns. On one process with a `GenerationEngine`: one
  rollout session in which sequences pause at tool calls and the environment's tokens are
  appended to their KV (`agents/loop.py`); otherwise (several processes, another engine)
  rounds of `generate` calls that prefill each trajectory's context again."""
  engine = getattr(rollout_engine, "engine", None)
  if isinstance(engine, GenerationEngine) and not distributed.is_multi():
    comps = agent.run(reqs, engine=engine, lora=lora)
    rollout_engine.stats = dict(engine.last_stats)
    return comps
  total = {k: 0 for k in ENGINE_METRICS}

  def generate(turn_reqs):
    out = rollout_engine.generate(turn_reqs, lora=lora, prune=None)
    _add_engine_stats(total, rollout_engine.stats)
    return out
  comps = agent.run(reqs, generate)
  rollout_engine.stats = total
  return comps


def make_agent_loop(cfg, tokenizer) -> AgentLoop | None:
  """The agent loop of a config with `tools` (None without)."""
  if not cfg.tools:
    return None
  reg = build_registry(cfg.tools, max_output_chars=8 * cfg.max_tool_response_tokens,
                       python_timeout_s=cfg.tool_timeout_s)
  fmt = make_format(cfg.tool_format, reg, pad_to=cfg.max_tool_response_tokens)
  return AgentLoop(fmt, reg, tokenizer, max_turns=cfg.max_turns,
                   max_tool_response_tokens=cfg.max_tool_response_tokens,
                   topk=cfg.monitor_topk)


def _add_engine_stats(total: dict, new: dict) -> None:
  """Sum a round's engine counters into `total` (a high-water mark `*_frac`: the max)."""
  for k in ENGINE_METRICS:
    v = new[k]
    total[k] = max(total[k], v) if k.endswith("_frac") else total[k] + v
