"""Host-side scheduling of the generation engine: page allocation, admission, growth and
recompute preemption (vLLM's policy and order), per device shard.

The engine owns one `Scheduler`. Requests wait in one FIFO queue shared by all shards; every
shard (one device of the rollout mesh) has `num_slots` sequence slots and its own pool of KV
pages with its own `PageAllocator`. One loop iteration of the engine calls, in vLLM's order,

  1. `grow()`       every running sequence gets pages for its next chunk; when a shard runs
                    out, its most recently admitted sequence is *preempted*: its pages are
                    freed and it goes back to the front of the queue, to be readmitted later
                    with its prompt + generated tokens recomputed by a prefill;
  2. `admit()`      queued sequences take free slots while their shard keeps more than
                    `watermark_pages` free pages after giving them pages for the sequence so far
                    plus the next decode chunk (first come, first served: the head of the queue
                    waits for pages rather than being overtaken). A shard that preempted in this
                    iteration's `grow()` admits nothing (vLLM V1 does the same), and a shard
                    with nothing running ignores the watermark (its first sequence always fits);
  3. `finish()` / `release()` when a sequence ends (or is pruned) its slot and pages are free
                    for the next admission.

Running sequences are served before queued ones, so a sequence admitted in an iteration
always decodes in it: the old order (admit, then grow) preempted the sequence it had just
prefilled whenever the running ones needed its pages (`wasted_prefill_tokens` counts tokens
prefilled and then preempted before one decode step). `reserve()` gives running sequences pages
further ahead without preempting anyone, so the engine can dispatch the next decode chunk
before it has read the previous one.

Sampling is a pure function of (request seed, position), so where and when a sequence runs,
and how often it is preempted, does not change its tokens.

Paused sequences (a rollout session's tool-call boundary, `SeqState.paused`) keep their slot
and pages but are not running: no decode chunk takes them and `grow()` gives them nothing.
When a shard runs out of pages, its paused sequences are preempted first (newest first), before
any running one: a paused sequence waits for its environment, a running one would lose decode
work. A preempted paused sequence is *parked*: it leaves its slot and pages but not the queue's
back door; it waits outside the queue until its environment tokens arrive (`unpark`), then is
queued at the front and readmitted like any preempted sequence (prompt + history prefilled).
Admission parks paused sequences only where nothing else runs on the shard and the head of
the queue does not fit (otherwise the queue would wait for a resume that may never come).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

import numpy as np

from sparrow_jax.models.kv_cache import NULL_PAGE, pages_for


class PageAllocator:
  """Free list of physical pages of one pool (page 0, the null page, is never handed out)."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
    self.num_pages = num_pages
    # Pop from the end: low page ids are handed out first, freed pages are reused first.
    self._free = list(range(num_pages - 1, 0, -1))
    self.total_allocated = 0
    self.total_freed = 0
    self.high_water = 0

  @property
  def capacity(self) -> int:
    """Pages that can be handed out (the pool minus the null page)."""
    return self.num_pages - 1

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.capacity - len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(
          f"KV cache out of pages: asked for {n}, {len(self._free)} free of "
          f"{self.capacity}; raise the pool size or lower the number of slots")
    pages = [self._free.pop() for _ in range(n)]
    self.total_allocated += n
    self.high_water = max(self.high_water, self.num_used)
    return pages

  def free(self, pages) -> None:
    for p in pages:
      if not NULL_PAGE < p < self.num_pages:
        raise ValueError(f"free of invalid page id {p}")
    self._free.extend(reversed(list(pages)))
    self.total_freed += len(pages)


@dataclasses.dataclass(eq=False)
class SeqState:
  """One request's progress: what it generated so far and where it runs (if it runs)."""

  req: Any  # engine.Request
  index: int  # position of the request in the generate() call
  stop_ids: frozenset
  max_len: int  # prompt + max_new_tokens, capped at the engine's max_seq_len
  # [max_new] int32: the request's row of the engine's token buffer (`outputs.OutputBuffers`)
  tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
  num_tokens: int = 0  # generated so far: tokens[:num_tokens]
  shard: int = -1
  slot: int = -1  # slot index within the shard; -1 while queued
  pages: list = dataclasses.field(default_factory=list)
  length: int = 0  # tokens held in the cache (host mirror of cache.lengths)
  admitted_at: int = -1  # admission counter (preemption takes the largest)
  preemptions: int = 0
  continued: bool = False  # starts from context tokens (`Request.context_ids`)
  pause_ids: frozenset = frozenset()  # stop ids that pause it (`Request.pause_token_ids`)
  paused: bool = False  # stopped at a pause id, waiting for its environment's tokens
  prefilled: int = 0  # tokens the last admission prefills
  decoded: bool = False  # a decode step ran since the last admission
  extra: dict = dataclasses.field(default_factory=dict)  # hooks' per-sequence state

  @property
  def prompt_len(self) -> int:
    return len(self.req.prompt_ids)

  @property
  def recomputes(self) -> bool:
    """Its admission prefills tokens after the prompt (a readmission, a continuation): they
    are recomputed as decode attended to them."""
    return self.preemptions > 0 or self.continued

  @property
  def context_len(self) -> int:
    return self.prompt_len + self.num_tokens

  @property
  def context(self) -> np.ndarray:
    """Prompt + generated tokens `[context_len]` int32: what a (re)admission prefills."""
    return np.concatenate([np.asarray(self.req.prompt_ids, np.int32),
                           self.tokens[:self.num_tokens]])

  @property
  def unwritten(self) -> int:
    """Context tokens a running sequence holds but its cache does not yet (the sampled token
    a decode step writes next, plus environment tokens appended since it paused)."""
    return self.context_len - self.length

  @property
  def pending(self) -> int:
    """The last sampled token, not yet written into the cache."""
    return int(self.tokens[self.num_tokens - 1])

  @property
  def remaining(self) -> int:
    """Tokens this sequence may still generate (max_new_tokens and context limits)."""
    return self.max_len - self.prompt_len - self.num_tokens


@dataclasses.dataclass
class SchedulerStats:
  preemptions: int = 0
  paused_preemptions: int = 0  # of those, sequences preempted while paused (parked)
  recomputed_tokens: int = 0  # prompt + generated tokens prefilled again after a preemption
  wasted_prefill_tokens: int = 0  # prefilled, then preempted before one decode step
  admissions: int = 0
  pool_high_water: int = 0  # pages, max over shards
  pool_capacity: int = 0  # pages per shard
  shard_admissions: list = dataclasses.field(default_factory=list)  # admissions per shard

  def as_dict(self) -> dict[str, float]:
    return {"preemptions": self.preemptions, "paused_preemptions": self.paused_preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            "admissions": self.admissions, "pool_high_water_pages": self.pool_high_water,
            "pool_capacity_pages": self.pool_capacity,
            "pool_high_water_frac": self.pool_high_water / max(self.pool_capacity, 1)}


class Scheduler:
  """Queue, slots and page pools of all shards (see the module docstring)."""

  def __init__(self, *, num_shards: int, num_slots: int, num_pages: int, page_size: int,
               max_pages_per_seq: int, chunk: int, watermark_pages: int = 0):
    if watermark_pages < 0:
      raise ValueError(f"Scheduler watermark_pages={watermark_pages}: expected >= 0")
    self.num_shards, self.num_slots = num_shards, num_slots
    self.page_size, self.max_pages_per_seq, self.chunk = page_size, max_pages_per_seq, chunk
    self.watermark_pages = watermark_pages
    self.allocators = [PageAllocator(num_pages) for _ in range(num_shards)]
    self.slots: list[list[SeqState | None]] = [[None] * num_slots for _ in range(num_shards)]
    self.queue: collections.deque[SeqState] = collections.deque()
    self._counter = itertools.count()
    self.preempted_shards: set[int] = set()  # shards that preempted in the last grow()
    # The page table of every slot, kept as pages are handed out and freed (local page ids;
    # free slots and unused columns -> the null page): a chunk's table is a slice of it.
    self._table = np.zeros((num_shards * num_slots, max_pages_per_seq), np.int32)
    self.stats = SchedulerStats(pool_capacity=self.allocators[0].capacity,
                                shard_admissions=[0] * num_shards)

  # --- sizes ------------------------------------------------------------------------------
  def pages_needed(self, seq: SeqState, upto_tokens: int) -> int:
    """Pages for `upto_tokens` tokens, never more than the sequence can ever hold."""
    cap = min(seq.max_len, self.max_pages_per_seq * self.page_size)
    return pages_for(min(upto_tokens, cap), self.page_size)

  def max_pages_of(self, seq: SeqState) -> int:
    return self.pages_needed(seq, seq.max_len)

  # --- queue ------------------------------------------------------------------------------
  def submit(self, seqs) -> None:
    self.queue.extend(seqs)

  def running(self) -> list[SeqState]:
    """Running sequences (slotted, not paused), oldest admission first."""
    out = [s for shard in self.slots for s in shard if s is not None and not s.paused]
    return sorted(out, key=lambda s: s.admitted_at)

  def paused(self) -> list[SeqState]:
    """Paused sequences that hold a slot, oldest admission first."""
    out = [s for shard in self.slots for s in shard if s is not None and s.paused]
    return sorted(out, key=lambda s: s.admitted_at)

  def has_work(self) -> bool:
    """Something is queued or running (a paused sequence waits for its environment)."""
    return bool(self.queue) or any(s is not None and not s.paused
                                   for shard in self.slots for s in shard)

  def _free_slot_shards(self):
    """(shard, slot) pairs that are free, spread over shards (round robin by slot index) so
    that a small batch uses every device."""
    for j in range(self.num_slots):
      for d in range(self.num_shards):
        if self.slots[d][j] is None:
          yield d, j

  def admit(self) -> list[SeqState]:
    """Move queued sequences into free slots while pages allow (FCFS), keeping more than
    `watermark_pages` pages free in every shard that runs something; shards that preempted
    in the last `grow()` take nothing."""
    admitted = []
    busy = [any(s is not None for s in shard) for shard in self.slots]
    for d, j in self._free_slot_shards():
      if not self.queue:
        break
      if d in self.preempted_shards:
        continue
      seq = self.queue[0]
      length = seq.context_len
      need = self.pages_needed(seq, length + self.chunk)
      alloc = self.allocators[d]
      reserve = self.watermark_pages if busy[d] else 0
      if need > alloc.num_free and not any(
          s is not None and not s.paused for s in self.slots[d]):
        # Only paused sequences hold this shard's pages: nothing here runs that could free
        # them, so they are parked (newest first) rather than the queue waiting forever.
        for victim in sorted((s for s in self.slots[d] if s is not None),
                             key=lambda s: -s.admitted_at):
          if need <= alloc.num_free:
            break
          self.preempt(victim)
        self.preempted_shards.discard(d)
        reserve = 0
      if need > alloc.num_free - reserve:
        # Another shard may have room; the queue head is tried there next (same order).
        continue
      self.queue.popleft()
      seq.pages = []
      seq.shard, seq.slot = d, j
      self._give(seq, need)
      seq.admitted_at = next(self._counter)
      seq.length = 0  # set by the prefill
      seq.prefilled, seq.decoded = length, False
      if seq.preemptions:
        self.stats.recomputed_tokens += length
      self.stats.admissions += 1
      self.stats.shard_admissions[d] += 1
      self.slots[d][j] = seq
      busy[d] = True
      admitted.append(seq)
    self._update_high_water()
    return admitted

  def grow(self) -> list[SeqState]:
    """Pages for every running sequence's next chunk (and the environment tokens it has not
    written yet); preempts when a shard runs out: its paused sequences first, then the most
    recent admission. Returns the sequences that keep running, oldest first."""
    self.preempted_shards = set()
    for seq in self.running():
      if seq.slot < 0:  # preempted earlier in this loop
        continue
      # A decode chunk writes `chunk` tokens after `length`; a resumed sequence first writes
      # its unwritten ones (the token it paused on and the appended ones).
      ahead = seq.unwritten if seq.unwritten > 1 else 0
      need = self.pages_needed(seq, seq.length + ahead + self.chunk) - len(seq.pages)
      alloc = self.allocators[seq.shard]
      while need > alloc.num_free:
        # paused ones first, newest admission first within each kind
        victim = max((s for s in self.slots[seq.shard] if s is not None),
                     key=lambda s: (s.paused, s.admitted_at))
        self.preempt(victim)
        if victim is seq:
          break
      if seq.slot >= 0 and need > 0:
        self._give(seq, need)
    self._update_high_water()
    return self.running()

  def reserve(self, tokens_ahead: int) -> bool:
    """Pages for `tokens_ahead` more tokens of every running sequence, if every shard has
    them (then True); otherwise nothing changes (False). Never preempts."""
    needs = [(s, self.pages_needed(s, s.length + tokens_ahead) - len(s.pages))
             for s in self.running()]
    per_shard = collections.Counter()
    for s, n in needs:
      per_shard[s.shard] += max(n, 0)
    if any(n > self.allocators[d].num_free for d, n in per_shard.items()):
      return False
    for s, n in needs:
      if n > 0:
        self._give(s, n)
    self._update_high_water()
    return True

  def preempt(self, seq: SeqState) -> None:
    """Free a running sequence's slot and pages and put it at the front of the queue (a
    paused one is parked instead: it is queued when `unpark` gives it its tokens)."""
    if not seq.decoded:
      self.stats.wasted_prefill_tokens += seq.prefilled
    self.preempted_shards.add(seq.shard)
    self.release(seq)
    seq.preemptions += 1
    self.stats.preemptions += 1
    if seq.paused:
      self.stats.paused_preemptions += 1
    else:
      self.queue.appendleft(seq)

  def unpark(self, seq: SeqState) -> None:
    """A paused sequence goes on: in its slot if it holds one, else (parked) queued at the
    front for a readmission that prefills its whole context."""
    seq.paused = False
    if seq.slot < 0:
      self.queue.appendleft(seq)

  def release(self, seq: SeqState) -> None:
    """Free the slot and pages of a sequence that leaves (finished, pruned or preempted)."""
    if seq.slot < 0:
      return
    self.allocators[seq.shard].free(seq.pages)
    self.slots[seq.shard][seq.slot] = None
    self._table[seq.shard * self.num_slots + seq.slot] = NULL_PAGE
    seq.pages, seq.slot, seq.length = [], -1, 0

  def _give(self, seq: SeqState, n: int) -> None:
    """`n` more pages of its shard's pool for a running sequence (and its page-table row)."""
    pages = self.allocators[seq.shard].alloc(n)
    row = seq.shard * self.num_slots + seq.slot
    self._table[row, len(seq.pages):len(seq.pages) + n] = pages
    seq.pages.extend(pages)

  # --- device views -------------------------------------------------------------------------
  def page_table(self, width: int) -> np.ndarray:
    """`[shards * slots, width]` int32 page table (local page ids; free slots -> null page)."""
    return self._table[:, :width].copy()

  def _update_high_water(self) -> None:
    self.stats.pool_high_water = max(self.stats.pool_high_water,
                                     max(a.num_used for a in self.allocators))
