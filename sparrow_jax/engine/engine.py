"""Generation engine: memory-sized paged KV pool, continuous batching with recompute
preemption, chunked jitted decode, rollouts sharded over devices.

Each device of the rollout mesh (a *shard*) runs `num_slots` sequence slots over its own pool
of KV pages; requests wait in one queue and go to whichever shard has a free slot and pages
(`scheduler.py`). One loop iteration

1. admits queued requests into free slots and prefills them (prompt, or prompt + generated
   tokens for a sequence readmitted after preemption) in one padded batch per shard;
2. gives every running sequence pages for its next chunk, preempting the most recently
   admitted sequence of a shard that runs out;
3. runs up to `decode_chunk` decode steps for all slots in one jitted `lax.while_loop`
   (under `shard_map`: every device decodes its own slots against its own pool). A sequence
   that samples a stop id or reaches its length limit stops writing at once, and the loop
   ends early when every slot has stopped;
4. reads the tokens back, finishes sequences, frees their slots and pages.

Cost of a decode step. The cache is one buffer per layer (see `models/kv_cache.py`), written in
place; attention reads only what it needs: dense layers the sequence's own pages, block-sparse
layers the landmarks of the sequence's pages plus the selected pages. The page table passed to
a chunk is cut to the longest running sequence, rounded up by less than a quarter
(`page_buckets_per_octave` widths per doubling; at least `min_page_bucket` pages), so neither
the pool size nor `max_seq_len` enters a step's cost.
One decode program is compiled per page-table width bucket (and attention strategy), one
prefill per (rows, length) bucket; `num_compilations` counts traces.

Pool size. `EngineConfig` takes the pool as pages (`num_pages`), as bytes (`kv_cache_bytes`:
K, V and landmarks, per device) or as a fraction of the device's free memory
(`kv_cache_memory_fraction`, measured when the engine is built, i.e. after the parameters and
optimizer state are allocated; GPUs report it, CPUs do not). `max_seq_len` bounds one sequence,
not the pool. Without any of them the pool holds every slot at `max_seq_len` (no preemption).

Attention is a strategy (`Dense()` or `BlockSparse(...)`); for block-sparse decoding a
`SparsitySchedule` (or a constant int budget) gives each slot's page budget per step through
`schedule.budget_pages` on a traced table: changing budgets, or swapping in a schedule with the
same bins, never recompiles.

Stats of the last `generate` call are in `last_stats` (cumulative ones in `stats`): generated
tokens, decode chunks and steps, prefills, preemptions, recomputed tokens, pool high-water
mark, wasted decode steps (slot-steps of sequences that had already finished in their chunk),
idle slot steps, wall time.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparrow_jax.engine.sampling import SamplingParams, sample_tokens, topk_logprobs
from sparrow_jax.engine.scheduler import Scheduler, SeqState
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.decoder import Decoder, rope_tables
from sparrow_jax.models.kv_cache import PagedKVCache, kv_bytes_per_page, pages_for
from sparrow_jax.models.quality_head import init_quality_head, quality_logits
from sparrow_jax.engine.pruning import Detection, GroupTracker, PruneCandidate, PruneHook
from sparrow_jax.schedule.schedule import (SparsitySchedule, as_schedule, budget_pages,
                                           max_budget, teacher_forced_budgets)

AXIS = "rollout"  # the one mesh axis of the engine: every device is a shard


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static shape of the engine. Slot and pool sizes are per device (shard)."""

  num_slots: int = 8  # concurrent sequences per device
  max_seq_len: int = 2048  # prompt + generated tokens of one sequence
  page_size: int = 16
  num_pages: int | None = None  # pool pages per device incl. the null page
  kv_cache_bytes: int | None = None  # pool bytes per device (K, V, landmarks)
  kv_cache_memory_fraction: float | None = None  # of the device's free memory (GPU)
  decode_chunk: int = 16  # decode steps per jitted call
  cache_dtype: str | None = None  # default: the model's compute dtype
  logprobs_topk: int = 0  # keep the top-k log-probs of every generated token (monitor)
  min_page_bucket: int = 8  # smallest compiled page-table width (pages)
  page_buckets_per_octave: int = 4  # compiled widths per doubling (1: powers of two)

  def __post_init__(self):
    for f in ("num_slots", "max_seq_len", "page_size", "decode_chunk", "min_page_bucket",
              "page_buckets_per_octave"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"EngineConfig.{f}={v!r}: expected an int >= 1")
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"EngineConfig.page_size={self.page_size}: expected a power of two")
    given = [f for f in ("num_pages", "kv_cache_bytes", "kv_cache_memory_fraction")
             if getattr(self, f) is not None]
    if len(given) > 1:
      raise ValueError(f"EngineConfig: {' and '.join(given)} both size the KV pool; give one")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages={self.num_pages}: expected >= 2 (page 0 is "
                       "the null page)")
    if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
      raise ValueError(f"EngineConfig.kv_cache_bytes={self.kv_cache_bytes}: expected > 0")
    f = self.kv_cache_memory_fraction
    if f is not None and not 0 < f <= 1:
      raise ValueError(f"EngineConfig.kv_cache_memory_fraction={f}: expected in (0, 1]")
    if self.logprobs_topk < 0:
      raise ValueError(f"EngineConfig.logprobs_topk={self.logprobs_topk}: expected >= 0")

  @property
  def max_pages_per_seq(self) -> int:
    return pages_for(self.max_seq_len, self.page_size)

  @property
  def worst_case_pages(self) -> int:
    """Pool pages for every slot at `max_seq_len` (+ the null page)."""
    return self.num_slots * self.max_pages_per_seq + 1


def resolve_pool_pages(config: EngineConfig, bytes_per_page: int, device=None) -> int:
  """Pages of one device's pool (null page included) for `config`."""
  if config.num_pages is not None:
    return config.num_pages
  if config.kv_cache_bytes is not None:
    budget = config.kv_cache_bytes
    what = f"kv_cache_bytes={config.kv_cache_bytes}"
  elif config.kv_cache_memory_fraction is not None:
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      raise ValueError(
          f"EngineConfig.kv_cache_memory_fraction={config.kv_cache_memory_fraction}: device "
          f"{device} does not report its memory; give kv_cache_bytes or num_pages instead")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    budget = int(config.kv_cache_memory_fraction * free)
    what = (f"kv_cache_memory_fraction={config.kv_cache_memory_fraction} of "
            f"{free / 1e9:.2f} GB free")
  else:
    return config.worst_case_pages
  pages = budget // bytes_per_page
  if pages < 2:
    raise ValueError(f"EngineConfig {what}: {budget} bytes hold {pages} page(s) of "
                     f"{bytes_per_page} bytes; need at least 2 (the null page and one more)")
  return int(pages)


@dataclasses.dataclass
class Request:
  prompt_ids: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  request_id: Any = None
  group: Any = None  # prompt group (GRPO): pruning decides per group


@dataclasses.dataclass
class Completion:
  """One finished sequence. `finish_reason` is 'stop' (EOS/stop id, included in
  `token_ids`), 'length' (max_new_tokens), 'context' (max_seq_len reached) or 'pruned'
  (removed by the prune hook while running; `pruned` is also set for a sequence that finished
  after L_detect but before its group was decided)."""

  request_id: Any
  prompt_ids: np.ndarray  # [P] int32
  token_ids: np.ndarray  # [n] int32
  logprobs: np.ndarray  # [n] float32, under the sampling distribution
  finish_reason: str
  topk_ids: np.ndarray | None = None  # [n, k] int32
  topk_logprobs: np.ndarray | None = None  # [n, k] float32
  preemptions: int = 0  # times the sequence was preempted and recomputed
  pruned: bool = False  # removed by the prune hook (tokens are those generated until then)
  quality_logit: float | None = None  # head logit at the detection point (prune hook)
  detect_hidden: np.ndarray | None = None  # [D] final-normed hidden state there
  detect_index: int = -1  # generated-token index of that point (-1: none)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _report_finished(done: dict, reported: set[int], on_finish) -> set[int]:
  """Hand every completion in `done` not reported yet to `on_finish` (index order)."""
  for i in sorted(done.keys() - reported):
    on_finish(i, done[i])
    reported.add(i)
  return reported


class GenerationEngine:
  """Batched generation with a paged KV cache, continuous batching and preemption."""

  def __init__(self, model: Decoder, config: EngineConfig | None = None, *,
               attention: attn_lib.AttentionSpec | None = None, schedule=None,
               mesh: Mesh | None = None):
    self.config = cfg = config or EngineConfig()
    self.attention = attention if attention is not None else attn_lib.Dense()
    self.schedule = self._as_schedule(schedule)
    self.model_config = mc = model.cfg
    if cfg.max_seq_len > mc.max_position_embeddings:
      raise ValueError(f"EngineConfig.max_seq_len={cfg.max_seq_len} exceeds the model's "
                       f"max_position_embeddings={mc.max_position_embeddings}")
    if isinstance(self.attention, attn_lib.BlockSparse) and (
        self.attention.page_size != cfg.page_size):
      raise ValueError(f"attention page_size={self.attention.page_size} differs from "
                       f"EngineConfig.page_size={cfg.page_size}")
    devices = (np.asarray(jax.devices()[:1]) if mesh is None
               else np.asarray(mesh.devices).reshape(-1))
    self.mesh = Mesh(devices, (AXIS,))
    self.num_shards = len(devices)
    self.graphdef, state = nnx.split(model)
    self.state = self._place_state(state)
    sparse = isinstance(self.attention, attn_lib.BlockSparse)
    landmark = self.attention.landmark if sparse else "none"
    self._landmark_dtype = self.attention.landmark_dtype if sparse else "float32"
    self.cache_dtype = jnp.dtype(cfg.cache_dtype or mc.dtype)
    self.bytes_per_page = kv_bytes_per_page(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        page_size=cfg.page_size, dtype=self.cache_dtype, landmark=landmark,
        landmark_dtype=self._landmark_dtype)
    self.pool_pages = resolve_pool_pages(cfg, self.bytes_per_page, devices[0])
    self._landmark = landmark
    self._kv = self._create_pool()
    self._zero_head = None  # the quality head of random pruning (its logits are unused)
    self.num_compilations = 0
    self.stats: collections.Counter = collections.Counter()
    self.last_stats: dict[str, float] = {}
    self._prefill_fn = {}
    self._decode_fn = {}

  # --- placement ------------------------------------------------------------------------
  def _place_state(self, state):
    """Parameters in the rollout layout: replicated on every rollout device (gathered from
    any training layout) and stored in the compute dtype. The decoder casts every weight to
    the compute dtype before use, so casting once here changes no result, and a decode step
    reads half the weight bytes when training keeps float32 parameters for bf16 compute."""
    dt = jnp.dtype(self.model_config.dtype)
    cast = lambda x: (x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating)
                      and x.dtype.itemsize > dt.itemsize else x)
    return jax.device_put(jax.tree.map(cast, state), NamedSharding(self.mesh, P()))

  def _create_pool(self) -> PagedKVCache:
    mc, cfg, d = self.model_config, self.config, self.num_shards

    def make():
      return PagedKVCache.create(
          num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
          num_slots=d * cfg.num_slots, num_pages=d * self.pool_pages, max_pages_per_seq=1,
          page_size=cfg.page_size, dtype=self.cache_dtype, landmark=self._landmark,
          landmark_dtype=self._landmark_dtype)

    return jax.jit(make, out_shardings=self._cache_shardings())()

  def _cache_specs(self) -> PagedKVCache:
    """PartitionSpecs of the cache: pages and slots split over the rollout devices."""
    L = self.model_config.num_layers
    n_lm = {"none": 0, "mean": 1, "quest": 2}[self._landmark]
    pages = P(None, AXIS)
    return PagedKVCache(k=(pages,) * L, v=(pages,) * L,
                        landmarks=tuple((pages,) * n_lm for _ in range(L)),
                        page_table=P(AXIS), lengths=P(AXIS), landmark_kind=self._landmark)

  def _cache_shardings(self):
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._cache_specs(),
                        is_leaf=lambda x: isinstance(x, P))

  def _shard(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  # --- jitted bodies (per-device code, run under shard_map) -------------------------------
  def _prefill_local(self, attention, state, cache, tokens, lengths, slots, page_rows, seeds,
                     temps, top_ps, top_ks, table, prompt_lengths, lora):
    model = nnx.merge(self.graphdef, state)
    budgets = None
    if isinstance(attention, attn_lib.BlockSparse):
      n, t = tokens.shape
      budgets = teacher_forced_budgets(self.schedule, t, n, table)
    cache, logits = model.prefill(cache, tokens, lengths, slots, page_rows,
                                  attention=attention, budgets=budgets,
                                  prompt_lengths=prompt_lengths, lora=lora)
    tok, lp = sample_tokens(logits, seeds, lengths, temps, top_ps, top_ks)
    tk = self._topk(logits)
    return cache, tok, lp, tk

  def _topk(self, logits):
    k = self.config.logprobs_topk
    if k:
      return topk_logprobs(logits, k)
    b = logits.shape[0]
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)

  def _decode_local(self, state, cache, tokens, active, remaining, stop_ids, seeds, temps,
                    top_ps, top_ks, table, lora, det=None):
    """Up to `decode_chunk` steps. `det` (pruning) = (head_params, det_stop_ids [S],
    prompt_len [B], det_end [B]): records the hidden state and head logit at the last stop
    token in the detection window [prompt_len, det_end] and at the latest token in it."""
    model = nnx.merge(self.graphdef, state)
    c, b, k = self.config.decode_chunk, tokens.shape[0], self.config.logprobs_topk
    outs = (jnp.zeros((c, b), jnp.int32), jnp.zeros((c, b), jnp.float32),
            jnp.zeros((c, b, k), jnp.int32), jnp.zeros((c, b, k), jnp.float32))
    d = self.model_config.hidden_size
    rec0 = ((jnp.zeros((b,), jnp.float32), jnp.zeros((b, d), jnp.float32),
             jnp.full((b,), -1, jnp.int32)) * 2 if det is not None else ())

    def record(rec, tok, pos, active, hidden):
      head, det_stop, prompt_len, det_end = det
      logit = quality_logits(head, hidden)  # [B]
      window = active & (pos >= prompt_len) & (pos <= det_end)  # [B]
      # The window's last token is the detection point only when no stop token came before
      # it: that fallback is the "latest" record (`pruning.Detection.best`).
      at_stop = window & jnp.any(tok[:, None] == det_stop, axis=-1)
      idx = pos - prompt_len  # generated-token index of the input token
      new = []
      for j, upd in enumerate((at_stop, window)):
        lg, hs, ix = rec[3 * j:3 * j + 3]
        new += [jnp.where(upd, logit, lg), jnp.where(upd[:, None], hidden, hs),
                jnp.where(upd, idx, ix)]
      return tuple(new)

    # RoPE tables of the whole chunk, computed once outside the loop: an active slot's step j
    # writes at position lengths + j (an inactive slot's outputs are discarded anyway).
    pos = cache.lengths[None, :] + jnp.arange(c, dtype=jnp.int32)[:, None]  # [C, B]
    mc = self.model_config
    cos_t, sin_t = rope_tables(pos, mc.head_dim, mc.rope_theta)  # [C, B, Dh] x2

    def cond(carry):
      step, _, _, active, _, _, _ = carry
      return (step < c) & jnp.any(active)

    def body(carry):
      step, cache, tok, active, remaining, outs, rec = carry
      budgets = None
      if self.schedule is not None:
        budgets = budget_pages(self.schedule, cache.lengths + 1, table)
      pos = cache.lengths  # position of the input token
      rope = (jax.lax.dynamic_index_in_dim(cos_t, step, 0, keepdims=False),
              jax.lax.dynamic_index_in_dim(sin_t, step, 0, keepdims=False))
      cache, logits, hidden = model.decode(cache, tok, active, attention=self.attention,
                                           budgets=budgets, lora=lora, return_hidden=True,
                                           rope=rope)
      if det is not None:
        rec = record(rec, tok, pos, active, hidden.astype(jnp.float32))
      new_tok, lp = sample_tokens(logits, seeds, cache.lengths, temps, top_ps, top_ks)
      tk_ids, tk_lp = self._topk(logits)
      row = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, step, 0)
      outs = tuple(row(o, x) for o, x in zip(outs, (new_tok, lp, tk_ids, tk_lp)))
      # Device-side finish: a stop id or the last allowed token ends the sequence now.
      remaining = remaining - active.astype(jnp.int32)
      done = jnp.any(new_tok[:, None] == stop_ids, axis=-1) | (remaining <= 0)
      new_tok = jnp.where(active, new_tok, tok)
      return step + 1, cache, new_tok, active & ~done, remaining, outs, rec

    init = (jnp.int32(0), cache, tokens, active, remaining, outs, rec0)
    steps, cache, _, _, _, outs, rec = jax.lax.while_loop(cond, body, init)
    return cache, outs, steps[None], rec

  def _get_prefill(self, attention):
    key = attention
    if key not in self._prefill_fn:
      def fn(state, cache, *args):
        self.num_compilations += 1  # runs at trace time only
        local = lambda st, ca, *a: self._prefill_local(attention, st, ca, *a)
        rows = P(AXIS)
        in_specs = (P(), self._cache_specs(), rows, rows, rows, rows, rows, rows, rows, rows,
                    P(), rows, P())
        out_specs = (self._cache_specs(), rows, rows, (rows, rows))
        return self._shard(local, in_specs, out_specs)(state, cache, *args)
      self._prefill_fn[key] = jax.jit(fn, donate_argnums=(1,))
    return self._prefill_fn[key]

  def _get_decode(self, with_det: bool = False):
    key = (self.attention, None if self.schedule is None
           else (self.schedule.bin_size, self.schedule.num_bins), with_det)
    if key not in self._decode_fn:
      def fn(state, cache, *args):
        self.num_compilations += 1
        rows = P(AXIS)
        cols = P(None, AXIS)
        in_specs = (P(), self._cache_specs(), rows, rows, rows, rows, rows, rows, rows, rows,
                    P(), P())
        rec_specs = ()
        if with_det:
          in_specs += ((P(), P(), rows, rows),)
          rec_specs = (rows,) * 6
        out_specs = (self._cache_specs(), (cols, cols, cols, cols), rows, rec_specs)
        return self._shard(self._decode_local, in_specs, out_specs)(state, cache, *args)
      self._decode_fn[key] = jax.jit(fn, donate_argnums=(1,))
    return self._decode_fn[key]

  # --- host side ------------------------------------------------------------------------
  def set_attention(self, attention: attn_lib.AttentionSpec, schedule=None) -> None:
    """Switch schedule/strategy. Budgets are traced, so a new table alone never recompiles;
    a new static spec (e.g. a larger max_budget) or new bins trace the decode step once."""
    if (isinstance(attention, attn_lib.BlockSparse)
        and attention.landmark != self._landmark):
      raise ValueError(f"cannot switch to {attention.landmark!r} landmarks: the cache keeps "
                       f"{self._landmark!r}")
    if (isinstance(attention, attn_lib.BlockSparse) and self._landmark != "none"
        and attention.landmark_dtype != self._landmark_dtype):
      raise ValueError(f"cannot switch to landmark_dtype={attention.landmark_dtype!r}: the "
                       f"cache keeps {self._landmark_dtype} landmarks")
    old = self.attention
    self.attention = attention
    try:
      self.schedule = self._as_schedule(schedule)
    except ValueError:
      self.attention = old
      raise

  def _as_schedule(self, schedule) -> SparsitySchedule | None:
    """The budget schedule of block-sparse decoding (None for dense attention)."""
    if not isinstance(self.attention, attn_lib.BlockSparse):
      return None
    if schedule is None:
      schedule = self.attention.max_budget
    schedule = as_schedule(schedule, page_size=self.attention.page_size)
    if schedule.is_dense:
      raise ValueError(f"schedule {schedule.name!r} is dense but the attention is BlockSparse")
    need = max_budget(schedule, self.config.max_seq_len)  # bins a sequence can reach
    if need > self.attention.max_budget:
      raise ValueError(
          f"schedule {schedule.name!r} needs a budget of {need} pages up to max_seq_len="
          f"{self.config.max_seq_len}, above the attention spec's max_budget="
          f"{self.attention.max_budget}")
    return schedule

  def set_state(self, state) -> None:
    """Swap in new policy parameters (same structure), resharded from any training layout to
    the rollout layout (replicated on every rollout device): no recompilation."""
    self.state = self._place_state(state)

  def _validate(self, requests, sched: Scheduler) -> list[SeqState]:
    cfg, vocab = self.config, self.model_config.vocab_size
    seqs = []
    for i, r in enumerate(requests):
      n = len(r.prompt_ids)
      if n < 1:
        raise ValueError(f"request {r.request_id!r}: empty prompt")
      if n >= cfg.max_seq_len:
        raise ValueError(
            f"request {r.request_id!r}: prompt of {n} tokens does not fit the context "
            f"max_seq_len={cfg.max_seq_len} (needs at least one generated token)")
      bad = [t for t in r.prompt_ids if not 0 <= int(t) < vocab]
      if bad:
        raise ValueError(f"request {r.request_id!r}: token ids {bad[:5]} outside the "
                         f"vocabulary [0, {vocab})")
      stop = set(r.sampling.stop_token_ids)
      if not r.sampling.ignore_eos:
        stop.update(self.model_config.eos_token_ids)
      seq = SeqState(req=r, index=i, stop_ids=frozenset(stop),
                     max_len=min(n + r.sampling.max_new_tokens, cfg.max_seq_len))
      need, cap = sched.max_pages_of(seq), sched.allocators[0].capacity
      if need > cap:
        raise ValueError(
            f"request {r.request_id!r}: prompt {n} + max_new_tokens "
            f"{r.sampling.max_new_tokens} tokens need up to {need} pages of "
            f"{cfg.page_size} tokens, but the KV pool holds {cap} pages per device "
            f"({self.pool_pages * self.bytes_per_page / 1e9:.3f} GB); raise num_pages / "
            "kv_cache_bytes or lower max_new_tokens")
      seqs.append(seq)
    return seqs

  def _row_params(self, rows: Sequence[SeqState | None]):
    n = len(rows)
    seeds = np.zeros((n,), np.int32)
    temps = np.zeros((n,), np.float32)
    top_ps = np.ones((n,), np.float32)
    top_ks = np.zeros((n,), np.int32)
    for i, s in enumerate(rows):
      if s is None:
        continue
      sp = s.req.sampling
      seeds[i] = sp.seed & 0x7FFFFFFF
      temps[i], top_ps[i], top_ks[i] = sp.temperature, sp.top_p, sp.top_k
    return seeds, temps, top_ps, top_ks

  def _table(self):
    if self.schedule is None:
      return jnp.zeros((1,), jnp.int32)
    return jnp.asarray(self.schedule.budgets, jnp.int32)

  def _record(self, seq: SeqState, tok: int, lp: float, tk_ids, tk_lps) -> str | None:
    """Append a sampled token; return a finish reason or None."""
    seq.tokens.append(int(tok))
    seq.logprobs.append(float(lp))
    if self.config.logprobs_topk:
      seq.topk_ids.append(np.asarray(tk_ids))
      seq.topk_lps.append(np.asarray(tk_lps))
    if int(tok) in seq.stop_ids:
      return "stop"
    if len(seq.tokens) >= seq.req.sampling.max_new_tokens:
      return "length"
    if seq.prompt_len + len(seq.tokens) >= self.config.max_seq_len:
      return "context"
    return None

  def _complete(self, seq: SeqState, reason: str) -> Completion:
    k = self.config.logprobs_topk
    out = Completion(
        request_id=seq.req.request_id,
        prompt_ids=np.asarray(seq.req.prompt_ids, np.int32),
        token_ids=np.asarray(seq.tokens, np.int32),
        logprobs=np.asarray(seq.logprobs, np.float32), finish_reason=reason,
        topk_ids=(np.stack(seq.topk_ids).astype(np.int32) if k and seq.topk_ids
                  else np.zeros((len(seq.tokens), k), np.int32) if k else None),
        topk_logprobs=(np.stack(seq.topk_lps).astype(np.float32) if k and seq.topk_lps
                       else np.zeros((len(seq.tokens), k), np.float32) if k else None),
        preemptions=seq.preemptions, pruned=reason == "pruned")
    det = seq.extra.get("det")
    if det is not None:
      out.quality_logit, out.detect_hidden, out.detect_index = det.best()
    return out

  def _page_bucket(self, pages: int) -> int:
    """Compiled page-table width for a chunk whose longest sequence holds `pages` pages:
    rounded up to a multiple of 1/`page_buckets_per_octave` of the largest power of two below
    it, so the columns a dense step gathers exceed the pages held by less than that fraction,
    while the number of compiled variants grows only logarithmically with the context."""
    cfg = self.config
    below = 1 << (max(int(pages), 1).bit_length() - 1)  # largest power of two <= pages
    step = max(below // cfg.page_buckets_per_octave, 1)
    width = -(-pages // step) * step
    return min(max(width, cfg.min_page_bucket), cfg.max_pages_per_seq)

  def generate(self, requests: Sequence[Request], *, lora=None, prune: PruneHook | None = None,
               progress: Callable[[int, int], None] | None = None,
               on_finish: Callable[[int, Completion], None] | None = None
               ) -> list[Completion]:
    """Generate a completion for every request (returned in request order).

    `prune`: an online pruning hook (ARRoL, `pruning.py`); requests with the same `group`
    are decided together once all of them reached `prune.detect_len` or finished.
    `on_finish(i, completion)`: called once per request (index i) soon after it finished,
    at the latest when `generate` returns (callers that save work as it completes).
    """
    cfg = self.config
    requests = list(requests)
    sched = Scheduler(num_shards=self.num_shards, num_slots=cfg.num_slots,
                      num_pages=self.pool_pages, page_size=cfg.page_size,
                      max_pages_per_seq=cfg.max_pages_per_seq, chunk=cfg.decode_chunk)
    seqs = self._validate(requests, sched)  # every request checked before any work
    sched.submit(seqs)
    self.last_scheduler = sched  # inspection (tests, benchmarks): pools, slots, stats
    done: dict[int, Completion] = {}
    tracker = None
    if prune is not None:
      if prune.detect_len < 1:
        raise ValueError(f"prune hook detect_len={prune.detect_len}: expected >= 1")
      tracker = GroupTracker(seqs, prune.detect_len)
      for sq in seqs:
        sq.extra["det"] = Detection()
    table = self._table()
    counts = collections.Counter()
    compiles0 = self.num_compilations
    reported: set[int] = set()  # requests handed to `on_finish`
    t0 = time.perf_counter()
    while sched.has_work():
      admitted = sched.admit()
      if admitted:
        self._prefill(sched, admitted, table, lora, done, counts)
        if tracker is not None:  # a group's last member may have ended in its prefill
          self._prune(sched, tracker, prune, done, counts)
      running = sched.grow()
      if not running:
        if sched.queue and not admitted:
          raise AssertionError("scheduler made no progress with an empty engine")
        continue
      self._decode_chunk(sched, running, table, lora, done, counts, prune)
      if tracker is not None:
        self._prune(sched, tracker, prune, done, counts)
      if progress is not None:
        progress(len(done), len(requests))
      if on_finish is not None:
        reported = _report_finished(done, reported, on_finish)
    if on_finish is not None:
      _report_finished(done, reported, on_finish)
    wall = time.perf_counter() - t0
    gen = sum(len(c.token_ids) for c in done.values())
    self.last_stats = dict(counts, **sched.stats.as_dict(), generated_tokens=gen,
                           finished=len(done), wall_s=wall,
                           compilations=self.num_compilations - compiles0)
    for key, val in self.last_stats.items():
      if key not in ("pool_high_water_frac", "pool_capacity_pages", "pool_high_water_pages"):
        self.stats[key] += val
    self.stats["pool_high_water_pages"] = max(self.stats["pool_high_water_pages"],
                                              sched.stats.pool_high_water)
    return [done[i] for i in range(len(requests))]

  def _finish(self, sched: Scheduler, seq: SeqState, reason: str, done: dict) -> None:
    done[seq.index] = self._complete(seq, reason)
    sched.release(seq)

  def _prune(self, sched: Scheduler, tracker: GroupTracker, hook: PruneHook, done: dict,
             counts) -> None:
    """Decide every group that became complete; pruned members leave the engine now."""
    for key in tracker.ready_groups(set(done)):
      tracker.decided.add(key)
      cands = [sq for sq in tracker.members[key] if tracker.reached(sq)]
      if not cands:
        continue  # every member finished before L_detect: all kept
      keep = list(hook.decide(key, [PruneCandidate(sq.req.request_id,
                                                   sq.extra["det"].best()[0], len(sq.tokens))
                                    for sq in cands]))
      if len(keep) != len(cands):
        raise ValueError(f"prune hook returned {len(keep)} decisions for {len(cands)} "
                         f"candidates of group {key!r}")
      counts["prune_candidates"] += len(cands)
      for sq, kept in zip(cands, keep):
        if kept:
          continue
        counts["pruned"] += 1
        if sq.index in done:  # finished after L_detect, before its group was complete
          done[sq.index].pruned = True
          continue
        counts["pruned_running"] += 1
        if sq.slot < 0:  # preempted and waiting: leaves the queue
          sched.queue.remove(sq)
        self._finish(sched, sq, "pruned", done)

  def _prefill(self, sched: Scheduler, admitted: list[SeqState], table, lora, done: dict,
               counts) -> None:
    cfg, d = self.config, self.num_shards
    by_shard = [[s for s in admitted if s.shard == k] for k in range(d)]
    n = _next_pow2(max(len(b) for b in by_shard))
    longest = max(len(s.context) for s in admitted)
    t = min(max(cfg.page_size, _next_pow2(longest)), cfg.max_pages_per_seq * cfg.page_size)
    width = t // cfg.page_size
    tokens = np.zeros((d * n, t), np.int32)
    lengths = np.ones((d * n,), np.int32)
    prompt_lengths = np.ones((d * n,), np.int32)
    slot_ids = np.full((d * n,), cfg.num_slots, np.int32)  # out of range: dropped
    rows = np.zeros((d * n, width), np.int32)
    order: list[SeqState | None] = [None] * (d * n)
    for k, group in enumerate(by_shard):
      for j, s in enumerate(group):
        r = k * n + j
        ctx = np.asarray(s.context, np.int32)
        tokens[r, :len(ctx)] = ctx
        lengths[r] = len(ctx)
        prompt_lengths[r] = s.prompt_len
        slot_ids[r] = s.slot
        rows[r, :min(len(s.pages), width)] = s.pages[:width]
        order[r] = s
    # A readmitted sequence recomputes its generated tokens as decode attended to them.
    readmit = any(s.preemptions for s in admitted)
    attention = (self.attention if readmit and isinstance(self.attention, attn_lib.BlockSparse)
                 else attn_lib.Dense())
    cache = self._kv.replace(page_table=self._zero_table())
    params = [jnp.asarray(x) for x in self._row_params(order)]
    cache, tok, lp, (tk_ids, tk_lps) = self._get_prefill(attention)(
        self.state, cache, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(slot_ids),
        jnp.asarray(rows), *params, table, jnp.asarray(prompt_lengths), lora)
    self._kv = cache
    tok, lp, tk_ids, tk_lps = jax.device_get((tok, lp, tk_ids, tk_lps))
    counts["prefills"] += 1
    counts["prefill_tokens"] += int(sum(len(s.context) for s in admitted))
    for r, s in enumerate(order):
      if s is None:
        continue
      s.length = len(s.context)
      reason = self._record(s, tok[r], lp[r], tk_ids[r], tk_lps[r])
      if reason is not None:
        self._finish(sched, s, reason, done)

  def _det_args(self, prune: PruneHook, rows: list[SeqState | None]):
    """(head, detection stop ids, prompt length, last window position) of the decode step."""
    n = len(rows)
    prompt_len = np.zeros((n,), np.int32)
    det_end = np.full((n,), -1, np.int32)
    for r, sq in enumerate(rows):
      if sq is not None:
        prompt_len[r] = sq.prompt_len
        det_end[r] = sq.prompt_len + prune.detect_len - 1
    ids = sorted(prune.stop_ids) or [-1]
    head = prune.head_params
    if head is None:  # no score wanted (random pruning): a zero head, logits are ignored
      if self._zero_head is None:
        shapes = jax.eval_shape(
            lambda: init_quality_head(jax.random.PRNGKey(0), self.model_config.hidden_size))
        self._zero_head = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
      head = self._zero_head
    head = jax.device_put(head, NamedSharding(self.mesh, P()))
    return (head, jnp.asarray(ids, jnp.int32), jnp.asarray(prompt_len), jnp.asarray(det_end))

  def _zero_table(self):
    return jnp.zeros((self.num_shards * self.config.num_slots, 1), jnp.int32)

  def _decode_chunk(self, sched: Scheduler, running: list[SeqState], table, lora,
                    done: dict, counts, prune: PruneHook | None = None) -> None:
    d, b = self.num_shards, self.config.num_slots
    width = self._page_bucket(max(len(s.pages) for s in running))
    rows: list[SeqState | None] = [None] * (d * b)
    for s in running:
      rows[s.shard * b + s.slot] = s
    tokens = np.zeros((d * b,), np.int32)
    active = np.zeros((d * b,), bool)
    remaining = np.zeros((d * b,), np.int32)
    n_stop = max([len(s.stop_ids) for s in running] + [1])
    stop_ids = np.full((d * b, n_stop), -1, np.int32)
    for r, s in enumerate(rows):
      if s is None:
        continue
      tokens[r], active[r], remaining[r] = s.pending, True, s.remaining
      ids = sorted(s.stop_ids)
      stop_ids[r, :len(ids)] = ids
    cache = self._kv.replace(page_table=jnp.asarray(sched.page_table(width)))
    params = [jnp.asarray(x) for x in self._row_params(rows)]
    det = ()
    if prune is not None:
      det = (self._det_args(prune, rows),)
    cache, outs, steps, rec = self._get_decode(prune is not None)(
        self.state, cache, jnp.asarray(tokens), jnp.asarray(active), jnp.asarray(remaining),
        jnp.asarray(stop_ids), *params, table, lora, *det)
    self._kv = cache
    outs, steps, rec = jax.device_get((outs, steps, rec))  # one transfer per chunk
    if prune is not None:
      for r, sq in enumerate(rows):
        if sq is None:
          continue
        dt = sq.extra["det"]
        if rec[2][r] >= 0:  # a stop token in the detection window this chunk
          dt.logit, dt.hidden, dt.index = float(rec[0][r]), np.asarray(rec[1][r]), int(rec[2][r])
        if rec[5][r] >= 0:
          dt.last_logit, dt.last_hidden, dt.last_index = (float(rec[3][r]),
                                                          np.asarray(rec[4][r]), int(rec[5][r]))
    toks, lps, tk_ids, tk_lps = outs  # [C, D*B], [C, D*B, k]
    steps = np.asarray(steps)  # [D] steps run per shard
    counts["decode_chunks"] += 1
    counts["decode_steps"] += int(steps.max())
    for k in range(d):
      occupied = sum(rows[k * b + j] is not None for j in range(b))
      counts["idle_slot_steps"] += int(steps[k]) * (b - occupied)
    for r, s in enumerate(rows):
      if s is None:
        continue
      n_run = int(steps[s.shard])
      for c in range(n_run):
        s.length += 1
        reason = self._record(s, toks[c, r], lps[c, r], tk_ids[c, r], tk_lps[c, r])
        if reason is not None:
          counts["wasted_decode_steps"] += n_run - c - 1
          self._finish(sched, s, reason, done)
          break
