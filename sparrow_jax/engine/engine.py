"""Generation engine: memory-sized paged KV pool, continuous batching with recompute
preemption, chunked jitted decode, rollouts sharded over devices.

Each device of the rollout mesh (a *shard*) runs `num_slots` sequence slots over its own pool
of KV pages; requests wait in one queue and go to whichever shard has a free slot and pages
(`scheduler.py`). One loop iteration, in vLLM's order:

1. gives every running sequence pages for its next chunk, preempting the most recently
   admitted sequence of a shard that runs out;
2. admits queued requests into free slots while the shard keeps `admission_watermark` of its
   pool free, and prefills them: fresh prompts in one padded batch per shard, sequences
   readmitted after preemption (prompt + generated tokens) in another, so a long readmission
   does not pad the fresh prompts to its length;
   Sequences of a rollout session resumed after a pause (`session.py`) then get the tokens
   appended to them written into their own pages (`_append`: a chunked prefill at their ends,
   `Decoder.extend`);
3. runs up to `decode_chunk` decode steps for all slots in one jitted `lax.while_loop`
   (under `shard_map`: every device decodes its own slots against its own pool). A sequence
   that samples a stop id or reaches its length limit stops writing at once, and the loop
   ends early when every slot has stopped;
4. reads the chunk back and writes it into preallocated per-request buffers in one vectorised
   pass (`outputs.py`); finished sequences free their slots and pages.

When nothing is queued and the pool has pages for two more chunks, the next chunk is
dispatched *before* step 4 (its inputs are the previous chunk's device outputs), so the host
work of a chunk overlaps the device work of the next (`overlapped_chunks`).

Cost of a decode step. The cache is one buffer per layer (see `models/kv_cache.py`), written in
place; attention reads only what it needs: dense layers the sequence's own pages, block-sparse
layers the landmarks of the sequence's pages plus the selected pages. The page table passed to
a chunk is cut to the longest running sequence, rounded up by less than a quarter
(`page_buckets_per_octave` widths per doubling; at least `min_page_bucket` pages), so neither
the pool size nor `max_seq_len` enters a step's cost.
One decode program is compiled per page-table width bucket (and attention strategy, and the
largest top_k of the call's requests), one prefill per (rows, length) bucket;
`num_compilations` counts traces.

Pool size. `EngineConfig` takes the pool as pages (`num_pages`), as bytes (`kv_cache_bytes`:
K, V and landmarks, per device) or as a fraction of the device's free memory
(`kv_cache_memory_fraction`, measured when the engine is built, i.e. after the parameters and
optimizer state are allocated; GPUs report it, CPUs do not). `max_seq_len` bounds one sequence,
not the pool. Without any of them the pool holds every slot at `max_seq_len` (no preemption).
`release_kv_pool()` frees the pool's device buffers between rollouts (vLLM's sleep mode,
SGLang's `release_memory_occupation`) and the next `generate` rebuilds it; `kv_pool_bytes`
says what it holds now.

Attention is a strategy (`Dense()` or `BlockSparse(...)`); for block-sparse decoding a
`SparsitySchedule` (or a constant int budget) gives each slot's page budget per step through
`schedule.budget_pages` on a traced table: changing budgets, or swapping in a schedule with the
same bins, never recompiles.

Stats of the last `generate` call are in `last_stats` (cumulative ones in `stats`): generated
tokens, decode chunks and steps, prefills, preemptions, recomputed tokens, wasted prefill
tokens (prefilled, then preempted before one decode step), prefill padding fraction, pool
high-water mark, wasted decode steps (slot-steps of sequences that had already finished in
their chunk), idle slot steps, overlapped chunks, time blocked on the device, wall time.
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

from sparrow_jax import cpu_kernels
from sparrow_jax.engine.config import Completion, EngineConfig, Request, resolve_pool_pages
from sparrow_jax.engine.outputs import OutputBuffers, RequestTable
from sparrow_jax.engine.pruning import (DetectionTable, GroupTracker, PruneCandidate,
                                        PruneHook)
from sparrow_jax.engine.scheduler import Scheduler, SeqState
from sparrow_jax.engine.session import EngineSession
from sparrow_jax.engine.steps import AXIS, DeviceSteps
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.decoder import Decoder, pack_decode_weights
from sparrow_jax.models.kv_cache import PagedKVCache, kv_bytes_per_page
from sparrow_jax.models.quality_head import init_quality_head
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import SparsitySchedule, max_budget

__all__ = ["AXIS", "Completion", "EngineConfig", "GenerationEngine", "Request",
           "resolve_pool_pages"]

_COUNTS = ("prefills", "prefill_tokens", "decode_chunks", "decode_steps", "idle_slot_steps",
           "busy_slot_steps", "wasted_decode_steps", "overlapped_chunks", "device_wait_s",
           "appends", "append_tokens", "pauses")


_APPEND_CHUNK = 64  # context tokens one append call writes per sequence (`_append`)
_APPEND_MIN = 16  # the smallest chunk width an append call is compiled for


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _identity(*xs):
  return xs


def _gather_remote(tree):
  """`tree` with every leaf that spans other processes' devices (a multi-host training
  layout) replaced by a full local copy: one jitted all-gather to replicated on the leaf's
  own mesh, then this process's replica. In a multi-host run every process calls this at
  the same point (it is a collective); the rollout devices are this process's own."""
  leaves, treedef = jax.tree.flatten(tree)
  far = [i for i, x in enumerate(leaves)
         if isinstance(x, jax.Array) and not x.is_fully_addressable]
  if not far:
    return tree
  if not all(isinstance(leaves[i].sharding, NamedSharding) for i in far):
    raise ValueError("engine: a parameter spans other processes' devices without a "
                     "NamedSharding; expected the training mesh's NamedShardings")
  out = jax.jit(_identity, out_shardings=tuple(
      NamedSharding(leaves[i].sharding.mesh, P()) for i in far))(*(leaves[i] for i in far))
  for i, x in zip(far, out):
    leaves[i] = x.addressable_data(0)
  return jax.tree.unflatten(treedef, leaves)


def _seed_context(seqs) -> None:
  """A continuation starts holding its context tokens (`Request.context_ids`) as generated
  tokens: its admission prefills them like a readmission's."""
  for s in seqs:
    k = len(s.req.context_ids)
    if k:
      s.tokens[:k] = np.asarray(s.req.context_ids, np.int32)
      s.num_tokens = k


def _report_finished(done: dict, reported: set[int], on_finish) -> set[int]:
  """Hand every completion in `done` not reported yet to `on_finish` (index order)."""
  for i in sorted(done.keys() - reported):
    on_finish(i, done[i])
    reported.add(i)
  return reported


@dataclasses.dataclass(eq=False)
class _Run:
  """Host state of one `generate` call."""

  sched: Scheduler
  seqs: list[SeqState]
  table: RequestTable  # per-request sampling inputs
  out: OutputBuffers  # per-request outputs
  budgets: jax.Array  # the schedule's budget table (traced)
  lora: Any  # placed once in the rollout layout
  prune: PruneHook | None = None
  tracker: GroupTracker | None = None
  det: DetectionTable | None = None
  det_consts: tuple = ()  # (head, detection stop ids) on the rollout devices
  done: dict = dataclasses.field(default_factory=dict)  # request index -> Completion
  paused: dict = dataclasses.field(default_factory=dict)  # paused since the last collect
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass(eq=False)
class _Chunk:
  """A dispatched decode chunk: its row layout and its (device) outputs."""

  rows: list  # [D*B] SeqState | None, as dispatched
  row_seq: np.ndarray  # [D*B] request index of each row (-1: empty)
  outs: tuple  # tokens, log-probs [C, D*B], top-k ids, log-probs [C, D*B, k]
  steps: jax.Array  # [D] steps run per shard
  rec: tuple  # detection record (pruning) or ()
  carry: tuple  # last token, still active, remaining, tokens generated [D*B]
  params: tuple  # the rows' stop ids, seed words, temperature, top_p, top_k (device)
  det: tuple  # the rows' detection inputs (pruning) or ()
  occupied: np.ndarray  # [D] running rows per shard
  version: int = 0  # the policy version of the weights it runs


class GenerationEngine(DeviceSteps):
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
    self._packed = None
    self._pack_fn = None
    if cfg.cpu_decode_weights is not None:
      cpu_kernels.require(f"EngineConfig.cpu_decode_weights={cfg.cpu_decode_weights!r}")
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
    self._make_pool = None
    self._kv: PagedKVCache | None = self._create_pool()
    self.version = 0  # the policy version of the weights it holds (`set_state`)
    self._zero_head = None  # the quality head of random pruning (its logits are unused)
    self.num_compilations = 0
    self.stats: collections.Counter = collections.Counter()
    self.last_stats: dict[str, float] = {}
    self._prefill_fn = {}
    self._decode_fn = {}
    self._rope_cache = {}  # padded prefill length -> its (cos, sin) tables (`prefill_rope`)

  # --- placement ------------------------------------------------------------------------
  def _place_state(self, state):
    """Parameters in the rollout layout: replicated on every rollout device (gathered from
    any training layout) and stored in the compute dtype. The decoder casts every weight to
    the compute dtype before use, so casting once here changes no result, and a decode step
    reads half the weight bytes when training keeps float32 parameters for bf16 compute."""
    dt = jnp.dtype(self.model_config.dtype)
    cast = lambda x: (x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating)
                      and x.dtype.itemsize > dt.itemsize else x)
    placed = self._replicate(jax.tree.map(cast, state))
    if self.config.cpu_decode_weights is not None:
      # The decode step's weights, packed for the C++ CPU matmul (one jitted pass over the
      # parameters, again at every `set_state`); prefill uses them too when they are bf16.
      if self._pack_fn is None:
        dtype = jnp.dtype(self.config.cpu_decode_weights)
        self._pack_fn = jax.jit(
            lambda st: pack_decode_weights(nnx.merge(self.graphdef, st), dtype))
      self._packed = self._replicate(self._pack_fn(placed))
    return placed

  def _replicate(self, tree):
    """A pytree (parameters, LoRA, quality head) replicated on the rollout devices: placed
    once per `generate`, so no chunk call reshards it from the training layout."""
    if tree is None:
      return None
    return jax.device_put(_gather_remote(tree), NamedSharding(self.mesh, P()))

  def _create_pool(self) -> PagedKVCache:
    mc, cfg, d = self.model_config, self.config, self.num_shards

    def make():
      return PagedKVCache.create(
          num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
          num_slots=d * cfg.num_slots, num_pages=d * self.pool_pages, max_pages_per_seq=1,
          page_size=cfg.page_size, dtype=self.cache_dtype, landmark=self._landmark,
          landmark_dtype=self._landmark_dtype)

    if self._make_pool is None:  # one compiled constructor, reused by every rebuild
      self._make_pool = jax.jit(make, out_shardings=self._cache_shardings())
    return self._make_pool()

  def release_kv_pool(self) -> None:
    """Free the KV pool's device buffers now (K, V, landmarks, page table, lengths), e.g.
    while the trainer runs; the next `generate` rebuilds a pool of the same size. Nothing
    is lost: a `generate` call never leaves state in the pool for the next one."""
    if self._kv is None:
      return
    for x in jax.tree.leaves(self._kv):
      x.delete()
    self._kv = None

  @property
  def kv_pool_bytes(self) -> int:
    """Bytes the KV pool holds now on each device (K, V and landmarks: `pool_pages *
    bytes_per_page`); 0 after `release_kv_pool()`."""
    if self._kv is None:
      return 0
    kv = self._kv
    arrays = kv.k + kv.v + tuple(x for lm in kv.landmarks for x in lm)
    return sum(x.nbytes for x in arrays) // self.num_shards

  def _pool(self) -> PagedKVCache:
    if self._kv is None:
      self._kv = self._create_pool()
    return self._kv

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

  def set_state(self, state, version: int | None = None) -> None:
    """Swap in new policy parameters (same structure), resharded from any training layout to
    the rollout layout (replicated on every rollout device): no recompilation. `version`:
    the policy version every token sampled from now on records (`Completion.versions`)."""
    self.state = self._place_state(state)
    if version is not None:
      self.version = int(version)

  def _validate(self, requests, sched: Scheduler, indices=None) -> list[SeqState]:
    """SeqStates of `requests` (row `indices[j]` of the run's tables; default 0..n-1), every
    request checked first."""
    cfg, vocab = self.config, self.model_config.vocab_size
    seqs = []
    indices = range(len(requests)) if indices is None else indices
    for i, r in zip(indices, requests):
      n = len(r.prompt_ids)
      if n < 1:
        raise ValueError(f"request {r.request_id!r}: empty prompt")
      if n >= cfg.max_seq_len:
        raise ValueError(
            f"request {r.request_id!r}: prompt of {n} tokens does not fit the context "
            f"max_seq_len={cfg.max_seq_len} (needs at least one generated token)")
      _check_vocab(r.request_id, "token ids", r.prompt_ids, vocab)
      k = len(r.context_ids)
      if k and (k >= r.sampling.max_new_tokens or n + k >= cfg.max_seq_len):
        raise ValueError(
            f"request {r.request_id!r}: {k} context tokens leave no token to generate "
            f"(max_new_tokens={r.sampling.max_new_tokens}, prompt {n}, max_seq_len="
            f"{cfg.max_seq_len})")
      _check_vocab(r.request_id, "context token ids", r.context_ids, vocab)
      _check_vocab(r.request_id, "pause token ids", r.pause_token_ids, vocab)
      stop = set(r.sampling.stop_token_ids) | set(int(t) for t in r.pause_token_ids)
      if not r.sampling.ignore_eos:
        stop.update(self.model_config.eos_token_ids)
      seq = SeqState(req=r, index=i, stop_ids=frozenset(stop),
                     max_len=min(n + r.sampling.max_new_tokens, cfg.max_seq_len),
                     continued=k > 0,
                     pause_ids=frozenset(int(t) for t in r.pause_token_ids))
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

  def _table(self):
    if self.schedule is None:
      return jnp.zeros((1,), jnp.int32)
    return jnp.asarray(self.schedule.budgets, jnp.int32)

  # --- the loop ---------------------------------------------------------------------------
  def generate(self, requests: Sequence[Request], *, lora=None, prune: PruneHook | None = None,
               progress: Callable[[int, int], None] | None = None,
               on_finish: Callable[[int, Completion], None] | None = None
               ) -> list[Completion]:
    """Generate a completion for every request (returned in request order).

    `lora`: the sparse actor's adapter (placed on the rollout devices once per call).
    `prune`: an online pruning hook (ARRoL, `pruning.py`); requests with the same `group`
    are decided together once all of them reached `prune.detect_len` or finished.
    `on_finish(i, completion)`: called once per request (index i) soon after it finished,
    at the latest when `generate` returns (callers that save work as it completes).

    A thin loop over a rollout session (`session.py`): every request added at once, one
    scheduling + decode-chunk iteration at a time until all finished.
    """
    paused = [r.request_id for r in requests if len(r.pause_token_ids)]
    if paused:
      raise ValueError(f"generate: requests {paused[:5]} have pause_token_ids; a paused "
                       "sequence needs a rollout session (EngineSession.resume)")
    session = EngineSession(self, requests, lora=lora, prune=prune)  # all checked first
    run = session.run
    reported: set[int] = set()  # requests handed to `on_finish`
    while session.has_work():
      if not session.step():
        continue
      if progress is not None:
        progress(len(run.done), len(run.seqs))
      if on_finish is not None:
        reported = _report_finished(run.done, reported, on_finish)
    if on_finish is not None:
      _report_finished(run.done, reported, on_finish)
    self.record_stats(session)
    return [run.done[i] for i in range(len(run.seqs))]

  def record_stats(self, session: EngineSession) -> None:
    """`last_stats` from a finished session's counters; added to the cumulative `stats`."""
    run = session.run
    self.last_stats = session.stats()
    for key, val in self.last_stats.items():
      if key not in ("pool_high_water_frac", "pool_capacity_pages", "pool_high_water_pages",
                     "prefill_padding_frac"):
        self.stats[key] += val
    self.stats["pool_high_water_pages"] = max(self.stats["pool_high_water_pages"],
                                              run.sched.stats.pool_high_water)

  def _begin(self, requests, lora=None, prune: PruneHook | None = None) -> _Run:
    """Validate the requests and set up the host state of one generate call (or of a
    session: `requests` may be empty, `_add` adds more)."""
    cfg = self.config
    sched = Scheduler(num_shards=self.num_shards, num_slots=cfg.num_slots,
                      num_pages=self.pool_pages, page_size=cfg.page_size,
                      max_pages_per_seq=cfg.max_pages_per_seq, chunk=cfg.decode_chunk,
                      watermark_pages=int(cfg.admission_watermark * (self.pool_pages - 1)))
    seqs = self._validate(list(requests), sched)
    if prune is not None and prune.detect_len < 1:
      raise ValueError(f"prune hook detect_len={prune.detect_len}: expected >= 1")
    if prune is not None and any(s.pause_ids for s in seqs):
      raise ValueError("a prune hook and pause_token_ids together are not supported")
    out = OutputBuffers(np.asarray([s.max_len - s.prompt_len for s in seqs], np.int64),
                        cfg.logprobs_topk)
    for s in seqs:
      s.tokens = out.tokens[s.index]  # the sequence's row of the token buffer (a view)
    _seed_context(seqs)
    run = _Run(sched=sched, seqs=seqs, table=RequestTable(seqs, self.model_config.vocab_size),
               out=out, budgets=self._table(), lora=self._replicate(lora), prune=prune)
    run.counts.update(dict.fromkeys(_COUNTS, 0))  # every stat present, even when zero
    if prune is not None and seqs:
      run.counts.update(dict.fromkeys(("pruned", "pruned_running", "prune_candidates"), 0))
      run.tracker = GroupTracker(seqs, prune.detect_len)
      run.det = DetectionTable(len(seqs), self.model_config.hidden_size)
      head = prune.head_params
      if head is None:  # no score wanted (random pruning): a zero head, logits are ignored
        if self._zero_head is None:
          shapes = jax.eval_shape(
              lambda: init_quality_head(jax.random.PRNGKey(0), self.model_config.hidden_size))
          self._zero_head = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        head = self._zero_head
      run.det_consts = (self._replicate(head),
                        jnp.asarray(sorted(prune.stop_ids) or [-1], jnp.int32))
    self._pool()  # rebuilt here after release_kv_pool()
    sched.submit(seqs)
    self.last_scheduler = sched  # inspection (tests, benchmarks): pools, slots, stats
    return run

  def _add(self, run: _Run, requests, indices: Sequence[int]) -> list[SeqState]:
    """Queue more requests in a running session at rows `indices` (every request checked
    first); the tables and output buffers grow to hold them."""
    seqs = self._validate(list(requests), run.sched, indices)
    if not seqs:
      return seqs
    rows = max(indices) + 1
    if run.out.grow(rows, max(s.max_len - s.prompt_len for s in seqs)):
      for s in run.seqs:  # the buffers moved: every live row view follows
        if s is not None:
          s.tokens = run.out.tokens[s.index]
    for s in seqs:
      s.tokens = run.out.tokens[s.index]
    _seed_context(seqs)
    run.table.put(seqs)
    run.seqs.extend([None] * (rows - len(run.seqs)))
    for s in seqs:
      run.seqs[s.index] = s
    run.sched.submit(seqs)
    return seqs

  def _schedule(self, run: _Run, admit: bool = True) -> list[SeqState]:
    """Running sequences first (pages for their next chunk, preempting the newest when a
    shard runs out), then admissions above the watermark, prefilled readmissions apart from
    fresh prompts (none when not `admit`: a session draining before new weights). Returns
    the sequences the next chunk decodes."""
    sched = run.sched
    sched.grow()
    admitted = sched.admit() if admit else []
    if admitted:
      # A readmission's long context would pad every fresh prompt of its batch to its length
      # (and send them through the teacher-forced sparse path): it gets its own batch.
      for group in ([s for s in admitted if s.recomputes],
                    [s for s in admitted if not s.recomputes]):
        for part in self._prefill_batches(group):
          self._prefill(run, part)
      if run.tracker is not None:  # a group's last member may have ended in its prefill
        self._prune(run)
    behind = [s for s in sched.running() if s.unwritten > 1]
    if behind:  # resumed sequences: their environment tokens into their own pages first
      self._append(run, behind)
    running = sched.running()
    if not running and sched.queue and not admitted and admit and not sched.paused():
      raise AssertionError("scheduler made no progress with an empty engine")
    return running

  def _prefill_shape(self, seqs: list[SeqState]) -> tuple[int, int]:
    """(rows per shard, padded length) of one prefill call over `seqs`."""
    cfg = self.config
    per_shard = collections.Counter(s.shard for s in seqs)
    n = _next_pow2(max(per_shard.values()))
    longest = max(s.context_len for s in seqs)
    t = min(max(cfg.page_size, _next_pow2(longest)), cfg.max_pages_per_seq * cfg.page_size)
    return n, t

  def _prefill_batches(self, seqs: list[SeqState]) -> list[list[SeqState]]:
    """`seqs` in admission order, cut into prefill calls of at most `max_prefill_tokens`
    tokens per device (rows x padded length; at least one sequence per call)."""
    limit = self.config.max_prefill_tokens
    if not seqs or not limit:
      return [seqs] if seqs else []
    parts, cur = [], []
    for s in seqs:
      n, t = self._prefill_shape(cur + [s])
      if cur and n * t > limit:
        parts.append(cur)
        cur = []
      cur.append(s)
    return parts + [cur]

  def _device_get(self, run: _Run, tree):
    """The one blocking read of a prefill or chunk (its wait is counted)."""
    t0 = time.perf_counter()
    out = jax.device_get(tree)
    run.counts["device_wait_s"] += time.perf_counter() - t0
    return out

  def _prefill(self, run: _Run, admitted: list[SeqState]) -> None:
    cfg, d = self.config, self.num_shards
    by_shard = [[s for s in admitted if s.shard == k] for k in range(d)]
    n, t = self._prefill_shape(admitted)
    width = t // cfg.page_size
    tokens = np.zeros((d * n, t), np.int32)
    lengths = np.ones((d * n,), np.int32)
    prompt_lengths = np.ones((d * n,), np.int32)
    slot_ids = np.full((d * n,), cfg.num_slots, np.int32)  # out of range: dropped
    page_rows = np.zeros((d * n, width), np.int32)
    row_seq = np.full((d * n,), -1, np.int64)
    order: list[SeqState | None] = [None] * (d * n)
    for k, group in enumerate(by_shard):
      for j, s in enumerate(group):
        r = k * n + j
        ctx = s.context
        tokens[r, :len(ctx)] = ctx
        lengths[r] = len(ctx)
        prompt_lengths[r] = s.prompt_len
        slot_ids[r] = s.slot
        page_rows[r, :min(len(s.pages), width)] = s.pages[:width]
        order[r], row_seq[r] = s, s.index
    # A readmitted sequence recomputes its generated tokens as decode attended to them.
    readmit = any(s.recomputes for s in admitted)
    # Fresh prompts attend densely, through the decode backend's prefill path where it has
    # one (`backend="cpu"`: the C++ causal kernel; others: `train_backend`'s default).
    attention = (self.attention if readmit and isinstance(self.attention, attn_lib.BlockSparse)
                 else attn_lib.Dense(backend=self.attention.backend))
    stop_ids, *params = run.table.rows(row_seq)
    det = ()
    if run.prune is not None:
      det = (self._det_rows(run, row_seq),)
    fn = self._get_prefill(attention, run.table.max_top_k, run.prune is not None)
    cache = self._pool().replace(page_table=self._zero_table())
    cache, tok, lp, (tk_ids, tk_lps), rec = fn(
        self.state, cache, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(slot_ids),
        jnp.asarray(page_rows), *(jnp.asarray(x) for x in params), run.budgets,
        jnp.asarray(prompt_lengths), run.lora, self.prefill_rope(t), *det,
        *((self._packed,) if self._prefill_packed() else ()))
    self._kv = cache
    tok, lp, tk_ids, tk_lps, rec = self._device_get(run, (tok, lp, tk_ids, tk_lps, rec))
    counts = run.counts
    counts["prefills"] += 1
    real = int(sum(s.context_len for s in admitted))
    counts["prefill_tokens"] += real
    counts["prefill_slot_tokens"] += d * n * t
    counts["prefill_padded_tokens"] += d * n * t - real
    live = np.flatnonzero(row_seq >= 0)
    seq_ids = row_seq[live]
    start = np.asarray([order[r].num_tokens for r in live], np.int64)
    run.out.append_one(seq_ids, start, tok[live], lp[live], tk_ids[live], tk_lps[live],
                       version=self.version)
    if rec:
      run.det.update(seq_ids, [x[live] for x in rec])
    for r in live:
      s = order[r]
      s.length = s.context_len
      s.num_tokens += 1
      reason = self._reason(s, decoded=False)
      if reason is not None:
        self._finish(run, s, reason)

  def _append(self, run: _Run, seqs: list[SeqState]) -> None:
    """Write the unwritten context tokens of resumed sequences (the token they paused on and
    the environment's tokens after it) into their own pages at their true positions, then
    sample each one's next token, as `_prefill` does for an admission. The history is not
    recomputed: each call is a chunked prefill at the sequences' ends (`Decoder.extend`, up
    to `_APPEND_CHUNK` tokens per sequence, the resumed sequences only, as rows like a
    prefill's), in which every query attends exactly as decode would at its position (its
    budget by its position, landmarks written as pages fill, the reserved bos/recent pages
    at its true end); the next token is sampled from (seed, position) like any other."""
    cfg, d = self.config, self.num_shards
    counts = run.counts
    while seqs:
      by_shard = [[s for s in seqs if s.shard == k] for k in range(d)]
      n = _next_pow2(max(len(g) for g in by_shard))
      longest = max(min(s.unwritten, _APPEND_CHUNK) for s in seqs)
      f = min(_APPEND_CHUNK, max(_APPEND_MIN, _next_pow2(longest)))
      inputs = np.zeros((d * n, f), np.int32)
      n_in = np.zeros((d * n,), np.int32)
      slot_ids = np.full((d * n,), cfg.num_slots, np.int32)  # out of range: dropped
      row_seq = np.full((d * n,), -1, np.int64)
      fed = {}
      for k, group in enumerate(by_shard):
        for j, s in enumerate(group):
          if len(s.pages) * cfg.page_size <= s.context_len:  # (a write past them: null page)
            raise AssertionError(f"request {s.req.request_id!r}: {len(s.pages)} pages do not "
                                 f"hold its {s.context_len} context tokens and the next one")
          r = k * n + j
          todo = s.context[s.length:s.context_len][:f]
          inputs[r, :len(todo)], n_in[r], slot_ids[r], row_seq[r] = todo, len(todo), s.slot, \
              s.index
          fed[s.index] = (r, len(todo))
      width = self._page_bucket(max(len(s.pages) for s in seqs))
      cache = self._pool().replace(page_table=jnp.asarray(run.sched.page_table(width)))
      _, *params = run.table.rows(row_seq)
      fn = self._get_append(run.table.max_top_k)
      packed = () if self._packed is None else (self._packed,)
      self._kv, tok, lp, (tk_ids, tk_lps) = fn(
          self.state, cache, self._rows(inputs), self._rows(n_in), self._rows(slot_ids),
          *(self._rows(x) for x in params), run.budgets, run.lora, *packed)
      tok, lp, tk_ids, tk_lps = self._device_get(run, (tok, lp, tk_ids, tk_lps))
      counts["appends"] += 1
      counts["append_tokens"] += int(n_in.sum())
      for s in seqs:
        s.length += fed[s.index][1]
        s.decoded = True
      done = [s for s in seqs if s.unwritten == 0]
      if done:  # every context token written: the token sampled after the last one is new
        rows = np.asarray([fed[s.index][0] for s in done], np.int64)
        run.out.append_one(row_seq[rows], np.asarray([s.num_tokens for s in done], np.int64),
                           tok[rows], lp[rows], tk_ids[rows], tk_lps[rows],
                           version=self.version)
        for s in done:
          s.num_tokens += 1
          reason = self._reason(s, decoded=False)
          if reason is not None:
            self._finish(run, s, reason)
      seqs = [s for s in seqs if s.unwritten > 0 and s not in done]

  def _reason(self, s: SeqState, decoded: bool = True) -> str | None:
    """Finish reason of a sequence whose last token was just sampled (None: it goes on).
    After a decode chunk (`decoded`) the device has already decided that it ends."""
    if s.pending in s.stop_ids:
      return "stop"
    if s.num_tokens >= s.req.sampling.max_new_tokens:
      return "length"
    if s.context_len >= self.config.max_seq_len:
      return "context"
    if decoded:
      raise AssertionError(f"request {s.req.request_id!r} ended on device without a reason")
    return None

  def _det_rows(self, run: _Run, row_seq: np.ndarray):
    """(head, detection stop ids, prompt length, last window position) of rows `row_seq`."""
    valid = row_seq >= 0
    plen = np.where(valid, run.table.prompt_len[np.where(valid, row_seq, 0)], 0)
    det_end = np.where(valid, plen + run.prune.detect_len - 1, -1)
    return (*run.det_consts, self._rows(plen.astype(np.int32)),
            self._rows(det_end.astype(np.int32)))

  def _rows(self, x):
    """A per-row host array placed as the decode step's outputs are (split over the rollout
    devices), so a chunk fed from the host and one fed from the previous chunk's outputs
    hit the same compiled program."""
    return jax.device_put(x, NamedSharding(self.mesh, P(AXIS)))

  def _zero_table(self):
    return jnp.zeros((self.num_shards * self.config.num_slots, 1), jnp.int32)

  def _dispatch(self, run: _Run, running: list[SeqState], prev: _Chunk | None = None
                ) -> _Chunk:
    """Start a decode chunk of `running` (asynchronously). Without `prev` its inputs come
    from the host; with `prev` (a chunk not read back yet, same slots) from `prev`'s device
    outputs, masked to the rows the host still runs."""
    d, b = self.num_shards, self.config.num_slots
    width = self._page_bucket(max(len(s.pages) for s in running))
    rows: list[SeqState | None] = [None] * (d * b)
    row_seq = np.full((d * b,), -1, np.int64)
    for s in running:
      r = s.shard * b + s.slot
      rows[r], row_seq[r] = s, s.index
    alive = row_seq >= 0
    if prev is None:
      stop_ids, seeds, temps, top_ps, top_ks = run.table.rows(row_seq)
      params = tuple(self._rows(x) for x in (stop_ids, seeds, temps, top_ps, top_ks))
      det = (self._det_rows(run, row_seq),) if run.prune is not None else ()
      tokens = np.zeros((d * b,), np.int32)
      remaining = np.zeros((d * b,), np.int32)
      for r in np.flatnonzero(alive):
        tokens[r], remaining[r] = rows[r].pending, rows[r].remaining
      tokens, active, remaining = (self._rows(x) for x in (tokens, alive, remaining))
    else:
      params, det = prev.params, prev.det
      tokens, active, remaining, _ = prev.carry
      active = jnp.logical_and(active, self._rows(alive))
    cache = self._pool().replace(page_table=jnp.asarray(run.sched.page_table(width)))
    fn = self._get_decode(run.prune is not None, run.table.max_top_k)
    packed = () if self._packed is None else (self._packed,)
    self._kv, outs, steps, rec, carry = fn(self.state, cache, tokens, active, remaining,
                                           *params, run.budgets, run.lora, *det, *packed)
    return _Chunk(rows=rows, row_seq=row_seq, outs=outs, steps=steps, rec=rec, carry=carry,
                  params=params, det=det, occupied=alive.reshape(d, b).sum(axis=1),
                  version=self.version)

  def _absorb(self, run: _Run, chunk: _Chunk) -> None:
    """Read a chunk back and book it in one vectorised pass: tokens, log-probs and top-k into
    the output buffers, detection records, finished sequences out."""
    outs, steps, rec, (_, still, _, count) = self._device_get(
        run, (chunk.outs, chunk.steps, chunk.rec, chunk.carry))
    toks, lps, tk_ids, tk_lps = outs  # [C, D*B], [C, D*B, k]
    counts, b = run.counts, self.config.num_slots
    counts["decode_chunks"] += 1
    counts["decode_steps"] += int(steps.max())
    counts["idle_slot_steps"] += int(np.sum(steps * (b - chunk.occupied)))
    counts["busy_slot_steps"] += int(np.sum(steps * chunk.occupied))
    # Rows the host still runs (an overlapped chunk may hold rows that ended or were pruned
    # when the chunk before it was read).
    # (A sequence that paused in the chunk before an overlapped one is inactive in it.)
    live = np.asarray([r for r, s in enumerate(chunk.rows)
                       if s is not None and s.slot >= 0 and s.index not in run.done
                       and not s.paused], np.int64)
    if not live.size:
      return
    seq_ids, n_new = chunk.row_seq[live], count[live].astype(np.int64)
    start = np.asarray([chunk.rows[r].num_tokens for r in live], np.int64)
    run.out.append_chunk(seq_ids, start, n_new, toks[:, live], lps[:, live], tk_ids[:, live],
                         tk_lps[:, live], version=chunk.version)
    if rec:
      run.det.update(seq_ids, [x[live] for x in rec])
    for r, n in zip(live, n_new):
      s = chunk.rows[r]
      s.num_tokens += int(n)
      s.length += int(n)
      s.decoded = s.decoded or n > 0
    for j in np.flatnonzero(~still[live]):
      s = chunk.rows[live[j]]
      counts["wasted_decode_steps"] += int(steps[s.shard]) - int(n_new[j])
      self._finish(run, s, self._reason(s))

  def _decode_chunk(self, run: _Run, running: list[SeqState]) -> None:
    """One decode chunk, dispatched and read back (benchmarks time this)."""
    self._absorb(run, self._dispatch(run, running))

  def _finish(self, run: _Run, seq: SeqState, reason: str) -> None:
    if reason == "stop" and seq.pending in seq.pause_ids:  # a tool-call boundary: it pauses
      seq.paused = True
      run.paused[seq.index] = self._complete(run, seq, "paused")
      run.counts["pauses"] += 1
      return
    run.done[seq.index] = self._complete(run, seq, reason)
    run.sched.release(seq)

  def _complete(self, run: _Run, seq: SeqState, reason: str) -> Completion:
    ids, lps, tk_ids, tk_lps, versions = run.out.slices(seq.index, seq.num_tokens)
    out = Completion(request_id=seq.req.request_id,
                     prompt_ids=np.asarray(seq.req.prompt_ids, np.int32), token_ids=ids,
                     logprobs=lps, finish_reason=reason, topk_ids=tk_ids,
                     topk_logprobs=tk_lps, preemptions=seq.preemptions,
                     pruned=reason == "pruned", versions=versions)
    if run.det is not None:
      out.quality_logit, out.detect_hidden, out.detect_index = run.det.best(seq.index)
    return out

  def _prune(self, run: _Run) -> None:
    """Decide every group that became complete; pruned members leave the engine now."""
    tracker, hook, done, counts = run.tracker, run.prune, run.done, run.counts
    for key in tracker.ready_groups(set(done)):
      tracker.decided.add(key)
      cands = [sq for sq in tracker.members[key] if tracker.reached(sq)]
      if not cands:
        continue  # every member finished before L_detect: all kept
      keep = list(hook.decide(key, [PruneCandidate(sq.req.request_id,
                                                   run.det.best(sq.index)[0], sq.num_tokens)
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
          run.sched.queue.remove(sq)
        self._finish(run, sq, "pruned")


def _check_vocab(request_id, what: str, ids, vocab: int) -> None:
  """Refuse token ids outside [0, vocab), naming the request and the first few."""
  bad = [t for t in ids if not 0 <= int(t) < vocab]
  if bad:
    raise ValueError(f"request {request_id!r}: {what} {bad[:5]} outside the vocabulary "
                     f"[0, {vocab})")
