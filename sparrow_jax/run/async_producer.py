"""The asynchronous producer (`max_staleness=N` > 0): a rollout session that keeps generating
ahead of the learner, and hands it a batch of whole groups whose every token is at most N
policy versions old.

On one device the engine and the learner take turns: a step's `produce` runs engine
iterations (admission, prefill, one decode chunk each) until the batch is ready, the learner
then trains, publishes its weights into the running session (`EngineSession.update_weights`,
no drain), and the next `produce` continues the same sequences. What this buys over the
synchronous step is occupancy: the synchronous step waits for its longest rollout while the
slots of finished ones stand empty; here freed slots take new prompts at once, and the
sequences still running when a step has its groups carry over into the next step.

Bounded staleness. At most (N + 1) x `prompts_per_step` groups are outstanding (queued,
running, or finished and not yet trained on): a new draw of `prompts_per_step` prompts is
admitted whenever there is room for it. A step whose learner holds version V takes
`prompts_per_step` finished groups, oldest first by the version of their first token; it waits
(runs more engine iterations) while fewer are finished or while an unfinished group holds a
token of version <= V - N (it would be N + 1 versions old at the next step, so it must be
trained on now). The outstanding cap makes that at most `prompts_per_step` groups: the groups
drawn while the engine held version <= V - N number at most (V + 1) x P, and V x P of them
have been consumed. Tokens older than N (none, by that argument) would be masked out of the
loss (`async/over_stale_tokens` counts them).

Partial rollouts (`partial_rollouts=true`): the running sequences continue under the new
weights (`partial_rollout_kv`: keep the KV, or recompute it); false: the session drains, the
running sequences finish under the weights they started with before the new ones load.

Overlap (`async_overlap=true`, with `rollout_devices`): while the learner's stages run on
their devices, `pump` (in a thread the trainer starts after the batch is handed over and stops
before the new weights are published) keeps running engine iterations on the engine's own
devices: decoding the running sequences under the version being trained on, and drawing
prompts while the cap has room with the batch being trained on still counted in it. Their
tokens are trained at a later step, one version old or more, under the same readiness rule;
only the timing decides how many chunks run then, so such runs are not bit-reproducible.

Group advantages are computed over the whole group, whatever versions its members' tokens
come from (verl and AReaL do the same: the advantage is the group's reward baseline; the
off-policy part is corrected token by token by the importance weight pi_prox / mu of decoupled
PPO, pi_prox = the learner's policy at the step's start = the recompute's old log-probs,
mu = the engine's recorded log-prob of each token at the version that sampled it). A group is
always trained on whole, in one step.

Resume: a checkpoint stores the draw counter and, per outstanding group, the data position
of its draw and its index there; `--resume` regenerates those groups (same request seeds)
under the restored weights before drawing new prompts, so no prompt is skipped or repeated.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from sparrow_jax.engine.engine import Request
from sparrow_jax.engine.sampling import request_seed
from sparrow_jax.run import distributed
from sparrow_jax.run.batch import GenerationInfo, TrainBatch, make_batch
from sparrow_jax.run.builders import encode_prompt
from sparrow_jax.run.producer import ENGINE_METRICS, Producer


@dataclasses.dataclass(eq=False)
class _Group:
  key: int  # request_id[0] of its members: draw * prompts_per_step + index
  draw: int  # the prompt draw it came from (1-based)
  index: int  # its prompt's position in that draw
  example: Any
  data_state: dict  # the data position before that draw (resume regenerates from it)
  done: list = dataclasses.field(default_factory=list)  # finished Completions


class AsyncProducer(Producer):
  """Prompts -> a long-lived rollout session -> batches of finished groups (module doc)."""

  def __init__(self, cfg, tokenizer, dataset, rollout, **kw):
    if distributed.is_multi():
      raise ValueError(
          f"max_staleness={cfg.max_staleness}: asynchronous training runs in one process; "
          "a multi-host job gathers every step's completions in request order, which a "
          "session that carries sequences across steps does not have (use max_staleness=0)")
    super().__init__(cfg, tokenizer, dataset, rollout, **kw)
    self.groups: dict[int, _Group] = {}  # outstanding, in admission order
    self.draws = 0
    self._regenerate: list = []  # [(data_state, draw, [indices])] after a resume
    self._sync_s = 0.0  # the session's weight-load time already reported
    self.last_slot_steps = (0, 0)  # busy, idle slot-steps of the latest produce
    self._mark = None  # the session's counters where the latest produce's window ended
    self.overlap_chunks = 0  # engine iterations run by `pump` since the latest produce
    self.overlap_s = 0.0

  @property
  def cap(self) -> int:
    """Groups outstanding at most: (N + 1) x prompts_per_step."""
    return (self.cfg.max_staleness + 1) * self.cfg.prompts_per_step

  @property
  def session(self):
    on_running = (self.cfg.partial_rollout_kv if self.cfg.partial_rollouts else "drain")
    return self.rollout_engine.open_session(on_running)

  # --- prompts in -------------------------------------------------------------------------
  def _draw(self) -> None:
    state = self.dataset.state_dict()
    examples = self.dataset.next_batch()
    self.draws += 1
    self._submit(self.draws, state, examples, range(len(examples)))

  def _submit(self, draw: int, state: dict, examples, indices) -> None:
    cfg, reqs = self.cfg, []
    for i in indices:
      key = draw * cfg.prompts_per_step + i
      self.groups[key] = _Group(key, draw, i, examples[i], state)
      ids = encode_prompt(self.tokenizer, examples[i], cfg.chat_template)
      for g in range(cfg.group_size):
        seed = request_seed(cfg.seed, draw, 0, i, g)
        reqs.append(Request(ids, self.sampling(seed), (key, g), group=key))
    self.session.add(reqs)

  def _regenerate_pending(self) -> None:
    """The groups a checkpoint left outstanding, generated again (same prompts and seeds)."""
    now = self.dataset.state_dict()
    for state, draw, indices in self._regenerate:
      self.dataset.load_state_dict(state)
      self._submit(draw, state, self.dataset.next_batch(), indices)
    self.dataset.load_state_dict(now)
    self._regenerate = []

  # --- readiness --------------------------------------------------------------------------
  def _collect(self) -> None:
    for c in self.session.collect():
      self.groups[c.request_id[0]].done.append(c)

  def _first_versions(self) -> dict[int, int]:
    """Group key -> the version of its oldest token (versions only grow along a sequence,
    so a sequence's first token is its oldest); groups without tokens yet are absent."""
    out: dict[int, int] = {}
    run = self.session.run
    for s in run.seqs:
      if s is not None and s.num_tokens > 0:
        k, v = s.req.request_id[0], int(run.out.versions[s.index, 0])
        out[k] = min(out.get(k, v), v)
    for k, grp in self.groups.items():
      for c in grp.done:
        v = int(c.versions[0]) if len(c.versions) else 1 << 30
        out[k] = min(out.get(k, v), v)
    return out

  def _ready(self, version: int) -> bool:
    g, n = self.cfg.group_size, self.cfg.max_staleness
    if sum(len(grp.done) == g for grp in self.groups.values()) < self.cfg.prompts_per_step:
      return False
    first = self._first_versions()
    return not any(len(grp.done) < g and first.get(k, version) <= version - n
                   for k, grp in self.groups.items())

  def _select(self) -> list[_Group]:
    g, first = self.cfg.group_size, self._first_versions()
    done = [grp for grp in self.groups.values() if len(grp.done) == g]
    done.sort(key=lambda grp: (first[grp.key], grp.key))
    return done[:self.cfg.prompts_per_step]

  # --- one step's batch -------------------------------------------------------------------
  def produce(self, step: int, *, version: int, schedule, lora=None) -> TrainBatch:
    """The next batch for a learner at policy `version` (module docstring)."""
    cfg, sess = self.cfg, self.session
    # (with the overlap, from the end of the previous window: `pump`'s chunks count here)
    before = (self._mark if self.cfg.async_overlap and self._mark is not None
              else sess.stats())
    t0 = time.perf_counter()
    if self._regenerate:
      self._regenerate_pending()
    while True:
      while len(self.groups) + cfg.prompts_per_step <= self.cap:
        self._draw()
      self._collect()
      if self._ready(version):
        break
      if not sess.has_work():
        raise AssertionError("async producer: the engine is idle but the batch is not ready")
      sess.step()
    # The engine's turn ends with its freed slots refilled and one more chunk run, so the
    # sequences the next step continues have started (and the batch after it has tokens of
    # this version: generation runs ahead of the learner).
    if sess.has_work():
      sess.step()
      self._collect()
    t1 = time.perf_counter()
    chosen = self._select()
    for grp in chosen:
      del self.groups[grp.key]
    comps = [c for grp in chosen for c in sorted(grp.done, key=lambda c: c.request_id[1])]
    rewards, res = self.score({grp.key: grp.example for grp in chosen}, comps)
    t2 = time.perf_counter()
    after = self._mark = sess.stats()
    info = GenerationInfo(
        completions=comps, rewards=rewards, rounds=1, rollout_s=t1 - t0, reward_s=t2 - t1,
        engine=_engine_delta(before, after), pruned=[], num_errors=res.num_errors,
        num_timeouts=res.num_timeouts)
    batch = make_batch(comps, max_new_tokens=cfg.max_new_tokens, topk=cfg.monitor_topk,
                       step=step, examples=[grp.example for grp in chosen for _ in
                                            range(cfg.group_size)],
                       rewards=rewards, version=version, schedule=schedule, lora=lora,
                       info=info)
    batch.policy_version = min(int(c.versions.min()) for c in comps if len(c.versions))
    self.metrics = self._metrics(batch, version, before, after, t1 - t0)
    return batch

  def _metrics(self, batch: TrainBatch, version: int, before: dict, after: dict,
               wait_s: float) -> dict[str, float]:
    """async/* of a step's batch; masks tokens older than max_staleness out of the loss."""
    m = batch.mask > 0
    stale = version - batch.versions
    over = m & (stale > self.cfg.max_staleness)
    batch.mask[over] = 0.0  # (none, by the admission bound: counted to show it)
    s = stale[m]
    busy = after["busy_slot_steps"] - before["busy_slot_steps"]
    idle = after["idle_slot_steps"] - before["idle_slot_steps"]
    self.last_slot_steps = (busy, idle)
    sync = self.session.weight_sync_s - self._sync_s
    self._sync_s = self.session.weight_sync_s
    return {"async/staleness_mean": float(s.mean()) if s.size else 0.0,
            "async/staleness_max": float(s.max()) if s.size else 0.0,
            "async/partial_frac": float(np.mean(s > 0)) if s.size else 0.0,
            "async/occupancy": busy / (busy + idle) if busy + idle else 0.0,
            "async/queue_wait_s": wait_s, "async/weight_sync_s": sync,
            "async/over_stale_tokens": float(over.sum()),
            "async/groups_outstanding": float(len(self.groups)),
            "async/running": float(self.session.num_running)}

  # --- the engine beside the learner (async_overlap) ---------------------------------------
  def pump(self, stop: threading.Event) -> None:
    """Engine iterations until `stop` is set or the engine has nothing to do (module doc),
    finished sequences collected. Runs in the trainer's overlap thread while the learner's
    stages run; nothing else touches the session then. Prompts are drawn as if the batch the
    learner is training on were still outstanding: the engine still holds that batch's
    version, and a draw it makes now must count against that version's cap, or more than
    `prompts_per_step` groups could hold its tokens N steps later (staleness N + 1)."""
    sess, n, p = self.session, 0, self.cfg.prompts_per_step
    t0 = time.perf_counter()
    while not stop.is_set():
      while len(self.groups) + 2 * p <= self.cap:
        self._draw()
      if not sess.has_work():
        break
      sess.step()
      self._collect()
      n += 1
    self.overlap_chunks, self.overlap_s = n, time.perf_counter() - t0

  # --- checkpoints ------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """What resume needs: the draw counter and every outstanding group's draw position."""
    draws: dict[int, tuple] = {}
    for grp in self.groups.values():
      draws.setdefault(grp.draw, (grp.data_state, []))[1].append(grp.index)
    for state, draw, idx in self._regenerate:  # (a checkpoint before the first step)
      draws.setdefault(draw, (state, []))[1].extend(idx)
    return {"draws": self.draws,
            "pending": [[st, d, sorted(idx)] for d, (st, idx) in sorted(draws.items())]}

  def load_state_dict(self, state: dict | None) -> None:
    if not state:
      return
    self.draws = int(state["draws"])
    self._regenerate = [(st, int(d), [int(i) for i in idx]) for st, d, idx in state["pending"]]


class EngineOverlap:
  """The overlap thread of one step (`async_overlap`): `start` after the batch is handed to
  the learner, `stop` before the new weights are published (it waits for the engine
  iteration in progress and re-raises what the thread raised)."""

  def __init__(self, producer: AsyncProducer):
    self.producer = producer
    self._stop = threading.Event()
    self._thread = None
    self._error = None

  def start(self) -> None:
    assert self._thread is None, "overlap already running"
    self._stop.clear()
    self._error = None

    def run():
      try:
        self.producer.pump(self._stop)
      except BaseException as e:  # re-raised in the trainer's thread by `stop`
        self._error = e
    self._thread = threading.Thread(target=run, name="engine-overlap", daemon=True)
    self._thread.start()

  def stop(self) -> dict[str, float]:
    """Stop and join; the overlap's metrics ({} when it was not running)."""
    if self._thread is None:
      return {}
    self._stop.set()
    self._thread.join()
    self._thread = None
    if self._error is not None:
      raise RuntimeError("async_overlap: the engine thread failed") from self._error
    p = self.producer
    return {"async/overlap_chunks": float(p.overlap_chunks), "async/overlap_s": p.overlap_s}


def _engine_delta(before: dict, after: dict) -> dict[str, float]:
  """A step's share of the session's counters (high-water marks and fractions: as of now)."""
  return {k: after[k] if k.endswith("_frac") else after[k] - before[k] for k in ENGINE_METRICS}

