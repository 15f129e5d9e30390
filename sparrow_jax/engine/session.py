"""A long-lived rollout session over a `GenerationEngine`: requests are added while others
run, the engine advances one scheduling + decode-chunk iteration at a time, finished
completions are collected as they finish, and new policy weights (and LoRA) are loaded
between chunks without draining the engine.

    session = EngineSession(engine)
    session.add(requests)                 # queued; admitted as slots and pages free up
    while ...:
      session.step()                      # grow / admit + prefill / one decode chunk
      for c in session.collect(): ...     # completions finished since the last collect
      session.update_weights(params, lora=lora, version=v)   # between two chunks

`GenerationEngine.generate` is a thin loop over a session (every request added at once, step
until done), so both share one code path: the same tokens, log-probs and stats.

**Each token records the policy version that sampled it** (`Completion.versions` [n]): a
prefill or a decode chunk writes the version of the weights it ran with (the engine's
`version`, set by `set_state` / `update_weights`). A chunk dispatched before an update and
read after it keeps its own version: an update first reads back the chunk in flight.

**What happens to the KV of running sequences when the weights change** (`on_running`):

    "keep"       (default; TRL's `pause(mode="keep")`) the sequences continue at once under the
                 new weights over the KV the old weights wrote. Costs nothing. The tokens
                 after the update are sampled by the new weights attending to the old KV; the
                 engine records the log-prob it sampled each token with, which is exactly the
                 behaviour probability mu(y_t) the decoupled-PPO correction needs, so the
                 importance weight pi_prox / mu stays exact. The actor of those tokens is not
                 the pure new-version policy (its context KV is older): the mismatch this adds
                 is bounded by one version step and shows in the correction's ratios.
    "recompute"  (AReaL) every running sequence is preempted and readmitted: its prompt +
                 generated tokens are prefilled again under the new weights, so every token
                 after the update is scored by the pure new-version policy. Costs one prefill
                 of every running context per update (on a long-tailed workload: the longest
                 sequences, again and again). Sampling is keyed by (request seed, position),
                 so the recompute itself changes no token; only the new weights do.
    "drain"      (no partial rollouts) nothing new is admitted until the running sequences
                 finish under the old weights; then the new ones load. Every sequence has one
                 version.

The default is "keep": on the long-tailed workloads async training is for, "recompute"
repeats the prefill of the longest contexts at every step, and the correction needs the
behaviour log-probs, not a pure-version actor. The trainer's `partial_rollouts=true` keeps;
`partial_rollouts=false` drains.

**Pausing at a tool call** (multi-turn rollouts, `agents/loop.py`). A request's
`pause_token_ids` (the tool format's stop ids) pause the sequence instead of finishing it:
it keeps its slot and its KV pages, decodes nothing, and is reported once by
`collect_paused()` (a `Completion` with finish_reason "paused": everything so far). Then

    session.resume(request_id, env_token_ids)   # the environment's tokens; it decodes on
    session.finish(request_id)                  # or: it ends here (collected as "stop")

`resume` appends the tokens to the sequence: the next `step` writes them (after the token it
paused on) into the sequence's own pages at their true positions, every resumed sequence
at once, as decode steps teacher-forced on the given tokens (`GenerationEngine._append`):
each position attends as decode does (dense layers all its pages, block-sparse layers its
budget at that position, landmarks written as pages fill, the reserved bos/recent pages at
the sequence's true end), and the history is never recomputed. Sampling stays keyed by
(seed, position), so the trajectory is the one a re-prefill of the whole context
(`Request.context_ids`) gives, token for token. A paused sequence keeps its slot as well as
its pages because its page-table row is its slot's: resuming writes into that row with no
remapping, and the agent loop resumes every paused sequence right after the step it paused
in (its tools run on the host in between), so a slot is held only across one tool call.
When a shard runs out of pages, the scheduler preempts paused sequences first (they lose no
decode work); a preempted paused sequence is parked and readmitted after its `resume` with
its whole context prefilled, as any preempted sequence is: the same trajectory again.

Rows: a request takes a row of the session's tables and output buffers; `collect()` copies a
finished completion out of them and frees its row for a later `add`, so a session that runs
for a whole training run holds only its live requests.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

_ON_RUNNING = ("keep", "recompute", "drain")


def _own_arrays(c) -> None:
  """A completion leaving the session gets copies (`np.array`) of its per-token arrays."""
  for f in ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "versions"):
    v = getattr(c, f)
    if v is not None:
      setattr(c, f, np.array(v))


class EngineSession:
  """A long-lived rollout over `engine` (see the module docstring)."""

  def __init__(self, engine, requests: Sequence = (), *, lora=None, prune=None):
    """`requests`: added at once (a prune hook needs every request up front: `add` is then
    refused); `lora`: the sparse actor's adapter; `prune`: an online pruning hook."""
    self.engine = engine
    self.run = engine._begin(list(requests), lora, prune)
    self.pending = None  # a dispatched decode chunk not read back yet
    self._free_rows: list[int] = []
    self._next_row = len(self.run.seqs)
    self._weights = None  # (params, lora, version) waiting for a drain
    self.collected_tokens = 0  # generated tokens of collected completions
    self.collected = 0
    self.weight_updates = 0
    self.weight_sync_s = 0.0  # time spent loading new weights
    self.update_recomputes = 0  # sequences recomputed by on_running="recompute"
    self._compiles0 = engine.num_compilations
    self._t0 = time.perf_counter()

  # --- requests ---------------------------------------------------------------------------
  def add(self, requests: Sequence) -> list[int]:
    """Queue `requests` (each checked before any is queued); they run as slots and pages
    free up. Returns their row indices (`Completion`s carry the request ids)."""
    if self.run.prune is not None:
      raise ValueError("EngineSession.add: a session with a prune hook takes every request "
                       "when it is created (groups are decided together)")
    rows = []
    for _ in requests:
      rows.append(self._free_rows.pop() if self._free_rows else self._next_row)
      self._next_row = max(self._next_row, rows[-1] + 1)
    try:
      self.engine._add(self.run, list(requests), rows)
    except Exception:
      self._free_rows.extend(rows)
      raise
    return rows

  def has_work(self) -> bool:
    """Something is queued, running or in flight (a paused sequence waits for `resume`)."""
    return self.pending is not None or self.run.sched.has_work()

  @property
  def num_running(self) -> int:
    return len(self.run.sched.running())

  @property
  def num_queued(self) -> int:
    return len(self.run.sched.queue)

  @property
  def version(self) -> int:
    return self.engine.version

  # --- one iteration ----------------------------------------------------------------------
  def step(self) -> bool:
    """One iteration: pages for the running sequences, admissions and their prefill, one
    decode chunk dispatched and read back (with nothing queued, the next chunk is dispatched
    first from this one's device outputs: it stays in flight for the next `step`). Returns
    whether a chunk was read back."""
    eng, run = self.engine, self.run
    sched, chunk = run.sched, eng.config.decode_chunk
    if self.pending is None:
      # (admissions stop while new weights wait for the running sequences to drain)
      running = (eng._schedule(run) if self._weights is None
                 else eng._schedule(run, admit=False))
      if not running:
        self._maybe_load()
        return False
      self.pending = eng._dispatch(run, running)
    nxt = None
    # Overlap: with nothing queued, freed slots and pages have no taker, so the next chunk
    # can start from this one's device outputs if some sequence may outlive this chunk and
    # the pool holds two chunks more of every sequence (never preempting for it).
    if (eng.config.overlap_chunks and not sched.queue
        and any(s.remaining > chunk for s in self.pending.rows if s is not None)
        and sched.reserve(2 * chunk)):
      running = sched.running()
      if running:
        nxt = eng._dispatch(run, running, prev=self.pending)
        run.counts["overlapped_chunks"] += 1
    eng._absorb(run, self.pending)
    if run.tracker is not None:
      eng._prune(run)
    self.pending = nxt
    self._maybe_load()
    return True

  def _maybe_load(self) -> None:
    """Load drained-for weights once nothing runs under the old ones."""
    if self._weights is not None and self.pending is None and not self.run.sched.running():
      params, lora, version = self._weights
      self._weights = None
      self._load(params, lora, version)

  # --- weights ----------------------------------------------------------------------------
  def update_weights(self, params, *, lora: Any = ..., version: int,
                     on_running: str = "keep") -> None:
    """New policy weights (and the sparse actor's LoRA; left out: unchanged) for every token
    sampled from now on, recorded as `version`. `on_running`: what the running sequences do
    ("keep" | "recompute" | "drain", module docstring)."""
    if on_running not in _ON_RUNNING:
      raise ValueError(f"on_running={on_running!r}: expected one of {_ON_RUNNING}")
    if on_running == "drain":
      self._weights = (params, lora, version)
      self._maybe_load()
      return
    if self.pending is not None:  # the chunk in flight ran the old weights: book it first
      self.engine._absorb(self.run, self.pending)
      if self.run.tracker is not None:
        self.engine._prune(self.run)
      self.pending = None
    self._load(params, lora, version)
    if on_running == "recompute":
      sched = self.run.sched
      for seq in reversed(sched.running()):  # newest first: the oldest ends at the front
        sched.preempt(seq)
        self.update_recomputes += 1

  def _load(self, params, lora, version: int) -> None:
    t0 = time.perf_counter()
    self.engine.set_state(params, version=version)
    if lora is not ...:
      self.run.lora = self.engine._replicate(lora)
    self.weight_sync_s += time.perf_counter() - t0
    self.weight_updates += 1

  # --- results ----------------------------------------------------------------------------
  def collect_paused(self) -> list:
    """Completions ("paused") of sequences that paused since the last call, copies, in row
    order; their sequences wait for `resume` or `finish`."""
    paused = self.run.paused
    out = []
    for i in sorted(paused):
      c = paused.pop(i)
      _own_arrays(c)
      out.append(c)
    return out

  def _paused_seq(self, request_id, what: str):
    """The live paused sequence of `request_id` (errors name what was wrong)."""
    found = [s for s in self.run.seqs if s is not None and s.req.request_id == request_id]
    if not found:
      raise ValueError(f"{what}: no live sequence has request id {request_id!r} (unknown, "
                       "or finished and collected)")
    if len(found) > 1:
      raise ValueError(f"{what}: {len(found)} live sequences have request id "
                       f"{request_id!r}; request ids of paused sequences must be unique")
    seq = found[0]
    if seq.index in self.run.done:
      raise ValueError(f"{what}: request {request_id!r} has finished "
                       f"({self.run.done[seq.index].finish_reason!r}); only a paused "
                       "sequence takes environment tokens")
    if not seq.paused:
      state = "queued" if seq.slot < 0 else "running"
      raise ValueError(f"{what}: request {request_id!r} is {state}, not paused")
    if seq.index in self.run.paused:
      raise ValueError(f"{what}: request {request_id!r} paused but was not collected yet "
                       "(call collect_paused first)")
    return seq

  def resume(self, request_id, token_ids: Sequence[int]) -> None:
    """Append `token_ids` (the environment's tokens; may be empty) to the paused sequence of
    `request_id` and let it decode on (module docstring). The tokens count against its
    max_new_tokens and lead nothing: they follow the token it paused on, with log-prob 0."""
    seq = self._paused_seq(request_id, "resume")
    eng, run = self.engine, self.run
    ids = np.asarray([int(t) for t in token_ids], np.int32)
    vocab = eng.model_config.vocab_size
    bad = [int(t) for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"resume: request {request_id!r}: environment token ids {bad[:5]} "
                       f"outside the vocabulary [0, {vocab})")
    if len(ids) >= seq.remaining:
      raise ValueError(
          f"resume: request {request_id!r}: {len(ids)} environment tokens leave no token to "
          f"generate ({seq.remaining} left of max_new_tokens="
          f"{seq.req.sampling.max_new_tokens} / max_seq_len={eng.config.max_seq_len})")
    if self.pending is not None:  # book the chunk in flight before the sequence changes
      eng._absorb(run, self.pending)
      self.pending = None
    n, k = seq.num_tokens, len(ids)
    out = run.out
    out.tokens[seq.index, n:n + k] = ids
    out.logprobs[seq.index, n:n + k] = 0.0
    out.versions[seq.index, n:n + k] = eng.version
    if out.topk:
      out.topk_ids[seq.index, n:n + k] = 0
      out.topk_lps[seq.index, n:n + k] = 0.0
    seq.num_tokens += k
    run.sched.unpark(seq)

  def finish(self, request_id) -> None:
    """End the paused sequence of `request_id` now (its slot and pages are freed); `collect`
    returns its completion, finish_reason "stop"."""
    seq = self._paused_seq(request_id, "finish")
    seq.paused = False
    self.run.done[seq.index] = self.engine._complete(self.run, seq, "stop")
    self.run.sched.release(seq)

  def collect(self) -> list:
    """Completions finished since the last `collect` (in row order), copied out of the
    session's buffers; their rows are free for later requests."""
    done = self.run.done
    out = []
    for i in sorted(done):
      c = done.pop(i)
      _own_arrays(c)
      self.collected_tokens += len(c.token_ids)
      self.collected += 1
      self.run.seqs[i] = None
      self._free_rows.append(i)
      out.append(c)
    return out

  def stats(self) -> dict[str, float]:
    """Counters since the session started (the keys of `GenerationEngine.last_stats`)."""
    run = self.run
    counts = dict(run.counts)
    pad = counts.pop("prefill_padded_tokens", 0)
    processed = counts.pop("prefill_slot_tokens", 0)
    gen = self.collected_tokens + sum(len(c.token_ids) for c in run.done.values())
    return dict(counts, **run.sched.stats.as_dict(), generated_tokens=gen,
                finished=self.collected + len(run.done),
                wall_s=time.perf_counter() - self._t0,
                prefill_padding_frac=pad / processed if processed else 0.0,
                compilations=self.engine.num_compilations - self._compiles0)

  @property
  def occupancy(self) -> float:
    """Busy share of the slot-steps decoded so far (1: every slot ran every step)."""
    c = self.run.counts
    total = c["busy_slot_steps"] + c["idle_slot_steps"]
    return c["busy_slot_steps"] / total if total else 0.0
