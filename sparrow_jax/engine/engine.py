"""Generation engine: paged KV cache, batched prefill, chunked jitted decode, continuous batching.

A fixed number of sequence *slots* share one pool of KV pages. Each loop iteration

1. admits queued requests into free slots (pages for the prompt and the next decode chunk
   are taken from the allocator) and prefills them together in one padded batch;
2. tops up every active slot's pages for the next chunk;
3. runs `decode_chunk` steps of decoding for all slots in one jitted `lax.scan`;
4. reads the sampled tokens back, finishes sequences (EOS / stop ids / max new tokens /
   context), frees their pages and slots, so the next queued requests take them.

The decode function is compiled once per (attention strategy, LoRA-or-not) and the prefill
once per (batch bucket, length bucket): shapes are bucketed to powers of two and multiples of
the page size. `GenerationEngine.num_compilations` counts traces.

Attention is a strategy (`Dense()` or `BlockSparse(...)`); for block-sparse decoding a
`SparsitySchedule`-like object (anything with `budgets` and `bin_size`) or a constant budget
gives the per-slot page budget of each step as a traced lookup, so changing budgets or
swapping schedules with the same number of bins never recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.decoder import Decoder
from sparrow_jax.models.kv_cache import PageAllocator, PagedKVCache, page_table_row, pages_for
from sparrow_jax.engine.sampling import SamplingParams, sample_tokens, topk_logprobs
from sparrow_jax.schedule.schedule import SparsitySchedule, as_schedule, budget_pages


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static shape of the engine: slots, context, cache pool and chunking."""

  num_slots: int = 8
  max_seq_len: int = 2048  # prompt + generated tokens of one sequence
  page_size: int = 16
  num_pages: int | None = None  # pool size incl. the null page; default: every slot full
  decode_chunk: int = 16  # decode steps per jitted call
  cache_dtype: str | None = None  # default: the model's compute dtype
  logprobs_topk: int = 0  # keep the top-k log-probs of every generated token (monitor)

  def __post_init__(self):
    for f in ("num_slots", "max_seq_len", "page_size", "decode_chunk"):
      if getattr(self, f) < 1:
        raise ValueError(f"EngineConfig.{f}={getattr(self, f)}: expected >= 1")
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"EngineConfig.page_size={self.page_size}: expected a power of two")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages={self.num_pages}: expected >= 2")
    if self.logprobs_topk < 0:
      raise ValueError(f"EngineConfig.logprobs_topk={self.logprobs_topk}: expected >= 0")

  @property
  def max_pages_per_seq(self) -> int:
    return pages_for(self.max_seq_len, self.page_size)

  @property
  def pool_pages(self) -> int:
    if self.num_pages is not None:
      return self.num_pages
    return self.num_slots * self.max_pages_per_seq + 1


@dataclasses.dataclass
class Request:
  prompt_ids: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  request_id: Any = None


@dataclasses.dataclass
class Completion:
  """One finished sequence. `finish_reason` is 'stop' (EOS/stop id, included in
  `token_ids`), 'length' (max_new_tokens) or 'context' (max_seq_len reached)."""

  request_id: Any
  prompt_ids: np.ndarray  # [P] int32
  token_ids: np.ndarray  # [n] int32
  logprobs: np.ndarray  # [n] float32, under the sampling distribution
  finish_reason: str
  topk_ids: np.ndarray | None = None  # [n, k] int32
  topk_logprobs: np.ndarray | None = None  # [n, k] float32


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass
class _Slot:
  req: Request
  index: int
  pages: list
  tokens: list
  logprobs: list
  topk_ids: list
  topk_lps: list
  length: int  # tokens held in the cache (host mirror of cache.lengths)
  pending: int  # last sampled token, not yet in the cache
  stop_ids: frozenset = frozenset()  # stop ids + EOS (unless ignore_eos), fixed per request


class GenerationEngine:
  """Batched generation with a paged KV cache and continuous batching."""

  def __init__(self, model: Decoder, config: EngineConfig | None = None, *,
               attention: attn_lib.AttentionSpec | None = None, schedule=None):
    self.config = config or EngineConfig()
    self.attention = attention if attention is not None else attn_lib.Dense()
    self.schedule = self._as_schedule(schedule)
    self.model_config = model.cfg
    cfg = self.config
    if cfg.max_seq_len > model.cfg.max_position_embeddings:
      raise ValueError(f"EngineConfig.max_seq_len={cfg.max_seq_len} exceeds the model's "
                       f"max_position_embeddings={model.cfg.max_position_embeddings}")
    self.graphdef, self.state = nnx.split(model)
    self.allocator = PageAllocator(cfg.pool_pages)
    landmark = (self.attention.landmark if isinstance(self.attention, attn_lib.BlockSparse)
                else "none")
    self.cache = PagedKVCache.create(
        num_layers=model.cfg.num_layers, num_kv_heads=model.cfg.num_kv_heads,
        head_dim=model.cfg.head_dim, num_slots=cfg.num_slots, num_pages=cfg.pool_pages,
        max_pages_per_seq=cfg.max_pages_per_seq, page_size=cfg.page_size,
        dtype=jnp.dtype(cfg.cache_dtype or model.cfg.dtype), landmark=landmark)
    self.num_compilations = 0
    self.stats = collections.Counter()
    self._prefill_fn = jax.jit(self._prefill_impl, donate_argnums=(1,))
    self._decode_fn = jax.jit(self._decode_impl, donate_argnums=(1,))

  # --- jitted bodies --------------------------------------------------------------------
  def _prefill_impl(self, state, cache, tokens, lengths, slots, page_rows, seeds, temps, top_ps,
                    top_ks, lora):
    self.num_compilations += 1  # runs at trace time only
    model = nnx.merge(self.graphdef, state)
    cache, logits = model.prefill(cache, tokens, lengths, slots, page_rows, lora=lora)
    tok, lp = sample_tokens(logits, seeds, lengths, temps, top_ps, top_ks)
    k = self.config.logprobs_topk
    tk = topk_logprobs(logits, k) if k else (jnp.zeros((tok.shape[0], 0), jnp.int32),
                                             jnp.zeros((tok.shape[0], 0), jnp.float32))
    return cache, tok, lp, tk

  def _decode_impl(self, state, cache, tokens, active, seeds, temps, top_ps, top_ks, table,
                   lora):
    self.num_compilations += 1
    model = nnx.merge(self.graphdef, state)
    k = self.config.logprobs_topk

    def step(carry, _):
      cache, tok = carry
      budgets = None
      if self.schedule is not None:
        budgets = budget_pages(self.schedule, cache.lengths + 1, table)
      cache, logits = model.decode(cache, tok, active, attention=self.attention,
                                   budgets=budgets, lora=lora)
      new_tok, lp = sample_tokens(logits, seeds, cache.lengths, temps, top_ps, top_ks)
      new_tok = jnp.where(active, new_tok, tok)
      if k:
        tk = topk_logprobs(logits, k)
      else:
        tk = (jnp.zeros((tok.shape[0], 0), jnp.int32), jnp.zeros((tok.shape[0], 0)))
      return (cache, new_tok), (new_tok, lp, tk)

    (cache, _), outs = jax.lax.scan(step, (cache, tokens), None,
                                    length=self.config.decode_chunk)
    return cache, outs

  # --- host side ------------------------------------------------------------------------
  def set_attention(self, attention: attn_lib.AttentionSpec, schedule=None) -> None:
    """Switch schedule/strategy. Budgets are traced, so a new table alone never recompiles;
    a new static spec (e.g. a larger max_budget) retraces the decode step once."""
    if (isinstance(attention, attn_lib.BlockSparse)
        and attention.landmark != self.cache.landmark_kind):
      raise ValueError(f"cannot switch to {attention.landmark!r} landmarks: the cache keeps "
                       f"{self.cache.landmark_kind!r}")
    old_attention, old_schedule = self.attention, self.schedule
    self.attention = attention
    try:
      self.schedule = self._as_schedule(schedule)
    except ValueError:
      self.attention = old_attention
      raise
    # The bin width and the number of bins are static in the lookup; the budgets are traced.
    key = lambda sch: None if sch is None else (sch.bin_size, sch.num_bins)
    if attention != old_attention or key(self.schedule) != key(old_schedule):
      self._decode_fn = jax.jit(self._decode_impl, donate_argnums=(1,))

  def _as_schedule(self, schedule) -> SparsitySchedule | None:
    """The budget schedule of block-sparse decoding (None for dense attention)."""
    if not isinstance(self.attention, attn_lib.BlockSparse):
      return None
    if schedule is None:
      schedule = self.attention.max_budget
    schedule = as_schedule(schedule, page_size=self.attention.page_size)
    if schedule.is_dense:
      raise ValueError(f"schedule {schedule.name!r} is dense but the attention is BlockSparse")
    if max(schedule.budgets) > self.attention.max_budget:
      raise ValueError(
          f"schedule budget {max(schedule.budgets)} exceeds the attention spec's "
          f"max_budget={self.attention.max_budget}")
    return schedule

  def set_state(self, state) -> None:
    """Swap in new policy parameters (same structure): no recompilation."""
    self.state = state

  def _validate(self, requests):
    cfg = self.config
    for r in requests:
      n = len(r.prompt_ids)
      if n < 1:
        raise ValueError(f"request {r.request_id!r}: empty prompt")
      if n >= cfg.max_seq_len:
        raise ValueError(
            f"request {r.request_id!r}: prompt of {n} tokens does not fit the context "
            f"max_seq_len={cfg.max_seq_len} (needs at least one generated token)")
      bad = [t for t in r.prompt_ids if not 0 <= int(t) < self.model_config.vocab_size]
      if bad:
        raise ValueError(f"request {r.request_id!r}: token ids {bad[:5]} outside the "
                         f"vocabulary [0, {self.model_config.vocab_size})")

  def _row_params(self, reqs: Sequence[Request | None], n: int):
    seeds = np.zeros((n,), np.int32)
    temps = np.zeros((n,), np.float32)
    top_ps = np.ones((n,), np.float32)
    top_ks = np.zeros((n,), np.int32)
    for i, r in enumerate(reqs):
      if r is None:
        continue
      sp = r.sampling
      seeds[i] = sp.seed & 0x7FFFFFFF
      temps[i], top_ps[i], top_ks[i] = sp.temperature, sp.top_p, sp.top_k
    return (jnp.asarray(seeds), jnp.asarray(temps), jnp.asarray(top_ps), jnp.asarray(top_ks))

  def _record(self, slot: _Slot, tok: int, lp: float, tk_ids, tk_lps) -> str | None:
    """Append a sampled token; return a finish reason or None."""
    slot.tokens.append(int(tok))
    slot.logprobs.append(float(lp))
    if self.config.logprobs_topk:
      slot.topk_ids.append(np.asarray(tk_ids))
      slot.topk_lps.append(np.asarray(tk_lps))
    sp = slot.req.sampling
    if int(tok) in slot.stop_ids:
      return "stop"
    if len(slot.tokens) >= sp.max_new_tokens:
      return "length"
    if len(slot.req.prompt_ids) + len(slot.tokens) >= self.config.max_seq_len:
      return "context"
    return None

  def _finish(self, slot: _Slot, reason: str, done: dict) -> None:
    k = self.config.logprobs_topk
    done[id(slot.req)] = Completion(
        request_id=slot.req.request_id,
        prompt_ids=np.asarray(slot.req.prompt_ids, np.int32),
        token_ids=np.asarray(slot.tokens, np.int32),
        logprobs=np.asarray(slot.logprobs, np.float32), finish_reason=reason,
        topk_ids=np.stack(slot.topk_ids).astype(np.int32) if k else None,
        topk_logprobs=np.stack(slot.topk_lps).astype(np.float32) if k else None)
    self.allocator.free(slot.pages)
    self.stats["finished"] += 1

  def _ensure_pages(self, slot: _Slot, upto_tokens: int) -> bool:
    need = min(pages_for(upto_tokens, self.config.page_size), self.config.max_pages_per_seq)
    extra = need - len(slot.pages)
    if extra <= 0:
      return True
    if extra > self.allocator.num_free:
      return False
    slot.pages.extend(self.allocator.alloc(extra))
    return True

  def generate(self, requests: Sequence[Request], *, lora=None,
               progress: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Generate a completion for every request (returned in request order)."""
    cfg = self.config
    requests = list(requests)
    self._validate(requests)
    queue = collections.deque(requests)
    slots: list[_Slot | None] = [None] * cfg.num_slots
    done: dict[int, Completion] = {}
    table = (jnp.asarray(self.schedule.budgets, jnp.int32)
             if self.schedule is not None else jnp.zeros((1,), jnp.int32))
    page_table = np.zeros((cfg.num_slots, cfg.max_pages_per_seq), np.int32)
    t0 = time.perf_counter()
    while queue or any(s is not None for s in slots):
      # 1. admit queued requests into free slots and prefill them together.
      admitted: list[_Slot] = []
      for i in range(cfg.num_slots):
        if slots[i] is not None or not queue:
          continue
        req = queue[0]
        stop = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
          stop.update(self.model_config.eos_token_ids)
        slot = _Slot(req, i, [], [], [], [], [], len(req.prompt_ids), -1, frozenset(stop))
        if not self._ensure_pages(slot, len(req.prompt_ids) + cfg.decode_chunk):
          break
        queue.popleft()
        slots[i] = slot
        admitted.append(slot)
      if not admitted and not any(s is not None for s in slots):
        raise RuntimeError(
            f"KV cache pool of {cfg.pool_pages} pages cannot hold even one request; "
            "raise EngineConfig.num_pages")
      if admitted:
        self._prefill(admitted, lora, done, slots)
      active_slots = [s for s in slots if s is not None]
      if not active_slots:
        continue
      # 2. pages for the next chunk (a slot that cannot get them waits this chunk out).
      active = np.zeros((cfg.num_slots,), bool)
      for s in active_slots:
        if self._ensure_pages(s, s.length + cfg.decode_chunk):
          active[s.index] = True
        page_table[s.index] = page_table_row(s.pages, cfg.max_pages_per_seq)
      if not active.any():
        raise RuntimeError("KV cache pool exhausted: no active slot can grow; raise "
                           "EngineConfig.num_pages or lower num_slots")
      for i in range(cfg.num_slots):
        if slots[i] is None:
          page_table[i] = 0
      # 3. one jitted chunk of decode steps for all slots.
      tokens = np.zeros((cfg.num_slots,), np.int32)
      for s in active_slots:
        tokens[s.index] = s.pending
      self.cache = self.cache.replace(page_table=jnp.asarray(page_table))
      params = self._row_params([s.req if s is not None else None for s in slots],
                                cfg.num_slots)
      self.cache, outs = self._decode_fn(self.state, self.cache, jnp.asarray(tokens),
                                         jnp.asarray(active), *params, table, lora)
      toks, lps, (tk_ids, tk_lps) = jax.device_get(outs)  # [C, B], [C, B], [C, B, k]
      self.stats["decode_chunks"] += 1
      # 4. read back, finish sequences, free their pages and slots.
      for s in active_slots:
        if not active[s.index]:
          continue
        s.length += cfg.decode_chunk
        for c in range(cfg.decode_chunk):
          reason = self._record(s, toks[c, s.index], lps[c, s.index], tk_ids[c, s.index],
                                tk_lps[c, s.index])
          if reason is not None:
            self._finish(s, reason, done)
            slots[s.index] = None
            break
        else:
          s.pending = int(toks[-1, s.index])
      if progress is not None:
        progress(len(done), len(requests))
    self.stats["generated_tokens"] += sum(len(c.token_ids) for c in done.values())
    self.stats["wall_s"] += time.perf_counter() - t0
    return [done[id(r)] for r in requests]

  def _prefill(self, admitted: list[_Slot], lora, done: dict, slots: list) -> None:
    cfg = self.config
    n = _next_pow2(len(admitted))
    longest = max(len(s.req.prompt_ids) for s in admitted)
    t = max(cfg.page_size, _next_pow2(longest))
    t = min(t, pages_for(cfg.max_seq_len, cfg.page_size) * cfg.page_size)
    tokens = np.zeros((n, t), np.int32)
    lengths = np.ones((n,), np.int32)
    slot_ids = np.full((n,), cfg.num_slots, np.int32)  # out of range: dropped
    rows = np.zeros((n, cfg.max_pages_per_seq), np.int32)
    reqs: list[Request | None] = [None] * n
    for j, s in enumerate(admitted):
      p = np.asarray(s.req.prompt_ids, np.int32)
      tokens[j, :len(p)] = p
      lengths[j] = len(p)
      slot_ids[j] = s.index
      rows[j] = page_table_row(s.pages, cfg.max_pages_per_seq)
      reqs[j] = s.req
    params = self._row_params(reqs, n)
    self.cache, tok, lp, (tk_ids, tk_lps) = self._prefill_fn(
        self.state, self.cache, jnp.asarray(tokens), jnp.asarray(lengths),
        jnp.asarray(slot_ids), jnp.asarray(rows), *params, lora)
    tok, lp, tk_ids, tk_lps = jax.device_get((tok, lp, tk_ids, tk_lps))
    self.stats["prefills"] += 1
    for j, s in enumerate(admitted):
      reason = self._record(s, tok[j], lp[j], tk_ids[j], tk_lps[j])
      if reason is not None:
        self._finish(s, reason, done)
        slots[s.index] = None
      else:
        s.pending = int(tok[j])
