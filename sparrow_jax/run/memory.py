"""Dry-run memory planner: per-device bytes of one GRPO training configuration.

`plan_memory` answers "does qwen3_14b fit on 32 H200s with this batch and context?" without
allocating anything and without needing those devices:

* the parameter tree comes from `nnx.eval_shape` (abstract shapes only). All decoder layers have
  identical shapes, so one layer is traced and its leaves replicated for every layer index —
  the result is the same tree as tracing the whole model (a test checks it), in a fraction of
  a second even for qwen3_32b;
* the partition rules of `sharding.py` are applied to the mesh *axis sizes* (`param_specs`
  needs no devices), and per-device bytes are computed arithmetically from the specs: every
  sharded dimension is divisible by its mesh axes (non-divisible ones fall back to
  replicated), so a shard holds exactly `dim / prod(axis sizes)` of each sharded dimension —
  what `NamedSharding` places on each device (checked against real 8-device shards in the
  sharded test).

Rows of the plan (bytes per device) and their assumptions:

  params        policy parameters in `param_dtype`, sharded by PARAM_RULES.
  grads         one gradient tree, same dtype and sharding as the parameters.
  optimizer     AdamW/Adam: 2 moments (mu, nu) in `opt_dtype`; plus a master copy of the
                parameters in `opt_dtype` when `param_dtype` is narrower (bf16 params with
                float32 moments => float32 master weights); the step count. SGD: nothing.
  reference     a frozen copy of the parameters when `reference_model` (KL penalty β > 0).
  lora          LoRA factors (`lora_dtype`) for `lora_targets` in every layer, their gradient
                and optimizer moments, sharded by the LoRA rules of PARAM_RULES.
  kv_cache      the rollout engine's paged KV pool, sized to memory as the engine does it
                (vLLM's gpu_memory_utilization): every device runs its own engine shard
                (`batch_slots` slots, its own pool); the pool gets `kv_cache_fraction` of
                what the other rows leave of the usable memory (or `kv_cache_bytes` when
                given), in whole pages of `kv_bytes_per_page` bytes (K and V in the cache
                dtype + float32 landmarks, all layers, all kv heads: rollout parameters are
                replicated, not tensor-sharded), capped at every slot holding `context_len`
                tokens. Sequences take pages as they grow; when the pool runs out the engine
                preempts. The plan reports how many sequences of the mean and of the maximum
                length fit at once.
  rollout_params  the parameters in the rollout layout: replicated and in the compute
                dtype, when that differs from the training arrays (fsdp or tensor > 1, or
                float32 parameters for bf16 compute); otherwise the engine uses the training
                arrays themselves.
  activations   training micro-batch, ceil(train_micro_batch / groups) sequences per device
                of train_seq_len tokens. With `remat` (per-layer checkpointing): the saved
                input of every layer, plus one layer's recomputed working set during its
                backward: q/k/v/o and their cotangents, the float32 attention probabilities
                of one query chunk `[b, N, attn_chunk, T]` (each chunk is rematerialised in
                the backward pass, so only one chunk's probabilities are live), the MLP
                gate/up/hidden and cotangents, float32 norm temporaries. Without remat, every
                layer's working set. Plus float32 logits and their gradient, `[b, chunk, V]`
                (chunk = T unless `logits_chunk`). Heads, F and V divided by tensor when
                divisible.
  fsdp_buffers  when fsdp > 1: two all-gathered layers (the current and the prefetched one)
                of weights per tensor shard, or the embedding if larger.

Not counted: XLA temporaries and fragmentation (hence `usable_fraction` = 0.9 of the device;
jax preallocates 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION is raised: train.py sets 0.9), the
rollout's prefill activations, the dense recompute's (no-grad) activations, host memory.
The kv cache and training activations are summed although they peak in different phases:
an engine that keeps its cache allocated between steps holds both.

`plan_memory` only composes the terms, each a small function below it: `_training_state`
(params, grads, optimizer, reference, LoRA), `_activations_item`, `_fsdp_buffers`,
`_rollout_params_item`, `_training_phases` (over `_Work`'s forward / backward working sets),
`_PoolGeometry`, `_rollout_workspaces`, `_size_pool` and `_all_phases`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from sparrow_jax.models.config import ModelConfig
from sparrow_jax.models.decoder import Decoder
from sparrow_jax.models.kv_cache import kv_bytes_per_page
from sparrow_jax.rl.logprobs import time_chunk
from sparrow_jax.run import sharding as sh

GB = 1e9
# Calibrated against XLA's memory analysis of the trainer's programs (run/compile_plan.py;
# docs/memory.md): multiples of one layer's per-token activations live in a forward and in a
# forward/backward, per-token activations a layer keeps without remat, copies of one query
# chunk's attention scores and of one LM-head chunk's logits, and the optimizer step's
# temporaries per parameter (float32).
_RHO_FWD, _RHO_BWD, _SIGMA_NO_REMAT = 0.2, 0.8, 1.7
_ATTN_FWD, _ATTN_BWD = 2.0, 4.0
_LOGITS_FWD, _LOGITS_BWD = 3.0, 4.0
_APPLY = 1.39
# Rollout (engine) programs, fitted to XLA's analysis of the Qwen3-1.7B prefill / readmission
# / decode at the flagship pool: a prefill holds about 1.5 layers' per-token activations; a
# decode step on the XLA attention path gathers every slot's selected K/V pages and its
# page landmarks (float32 after XLA:CPU's upcast) and holds about 4 such copies. The Pallas
# kernels read pages in place: only the landmark gather and its scores remain.
_RHO_PREFILL = 1.48
_DECODE_XLA = 4.0
DECODE_BACKENDS = ("xla", "pallas")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0}


def _itemsize(dtype: str) -> int:
  return np.dtype(jax.numpy.dtype(dtype)).itemsize


def abstract_params(cfg: ModelConfig) -> dict:
  """Pure-dict abstract parameter tree of `Decoder(cfg)` (ShapeDtypeStruct leaves).

  Traces a one-layer model and repeats its layer for every index (all layers are identical).
  """
  one = cfg.replace(num_layers=1)
  model = nnx.eval_shape(lambda: Decoder(one, rngs=nnx.Rngs(0)))
  tree = nnx.split(model)[1].to_pure_dict()
  layer = tree["layers"][0]
  tree["layers"] = {i: layer for i in range(cfg.num_layers)}
  return tree


def abstract_lora(cfg: ModelConfig, rank: int, targets: Sequence[str],
                  dtype: str = "float32") -> dict:
  """Abstract LoRA tree in the decoder's layout: layers/<i>/<proj>/{a, b, scale}.

  a maps the projection input to rank r, b maps r to the projection output.
  """
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  shapes = {"q": ((d, rank), (rank, n, h)), "k": ((d, rank), (rank, k, h)),
            "v": ((d, rank), (rank, k, h)), "o": ((n, h, rank), (rank, d)),
            "gate": ((d, rank), (rank, f)), "up": ((d, rank), (rank, f)),
            "down": ((f, rank), (rank, d))}
  dt = jax.numpy.dtype(dtype)
  layer = {t: {"a": jax.ShapeDtypeStruct(shapes[t][0], dt),
               "b": jax.ShapeDtypeStruct(shapes[t][1], dt),
               "scale": jax.ShapeDtypeStruct((), jax.numpy.float32)} for t in targets}
  return {"layers": {i: layer for i in range(cfg.num_layers)}}


def shard_elements(shape: Sequence[int], spec, axis_sizes) -> int:
  """Elements of one device's shard of an array of `shape` under PartitionSpec `spec`."""
  n = 1
  for d, size in enumerate(shape):
    entry = spec[d] if d < len(spec) else None
    axes = sh.entry_axes(entry)
    div = math.prod(axis_sizes[a] for a in axes)
    n *= -(-size // div)
  return n


def per_device_bytes(tree, axis_sizes, dtype: str | None = None) -> tuple[int, int, list]:
  """(bytes per device, global bytes, fallbacks) of a tree under PARAM_RULES.

  `dtype` overrides the leaves' dtype (e.g. optimizer moments in float32).
  """
  specs, fallbacks = sh.param_specs(tree, axis_sizes)
  leaves = jax.tree.leaves(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  dev = tot = 0
  for leaf, spec in zip(leaves, spec_leaves):
    item = _itemsize(dtype) if dtype else np.dtype(leaf.dtype).itemsize
    dev += shard_elements(leaf.shape, spec, axis_sizes) * item
    tot += math.prod(leaf.shape) * item
  return dev, tot, fallbacks


@dataclasses.dataclass(frozen=True)
class MemoryItem:
  name: str
  per_device: int  # bytes
  note: str


@dataclasses.dataclass(frozen=True)
class PhasePlan:
  """One phase of a step: `program` = the bytes its compiled program peaks at per device
  (arguments + outputs + temporaries - donated), `resident` = what else stays allocated
  while it runs (e.g. the optimizer state during the forward/backward)."""

  name: str
  program: int
  resident: int
  note: str

  @property
  def total(self) -> int:
    return self.program + self.resident


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device memory of one configuration; `fits` compares against the usable memory."""

  model: str
  mesh: sh.MeshConfig
  num_devices: int
  device_bytes: float
  usable_fraction: float
  param_count: int
  param_bytes_total: int  # all parameters once, in param_dtype
  items: tuple[MemoryItem, ...]
  fallbacks: tuple[str, ...] = ()
  kv_pool_pages: int = 0  # pages of one device's pool, null page included
  kv_bytes_per_page: int = 0
  kv_min_pages: int = 2  # one sequence of the maximum length + the null page
  concurrency: dict = dataclasses.field(default_factory=dict)
  concurrency_held: dict = dataclasses.field(default_factory=dict)  # pool kept in training
  phases: tuple[PhasePlan, ...] = ()
  pool_released: bool = True  # the KV pool is freed while the trainer runs
  pool_room: float = 0.0  # bytes the pool was sized from (before kv_cache_fraction)

  def phase(self, name: str) -> PhasePlan:
    for ph in self.phases:
      if ph.name == name:
        return ph
    raise KeyError(f"no phase {name!r}; phases: {[p.name for p in self.phases]}")

  @property
  def peak_phase(self) -> PhasePlan:
    return max(self.phases, key=lambda ph: ph.total)

  def item(self, name: str) -> MemoryItem:
    for it in self.items:
      if it.name == name:
        return it
    raise KeyError(f"no memory item {name!r}; items: {[i.name for i in self.items]}")

  def __getitem__(self, name: str) -> int:
    return self.item(name).per_device

  @property
  def total(self) -> int:
    """Bytes per device at the step's peak: the largest phase (phases do not overlap)."""
    return self.peak_phase.total

  @property
  def usable_bytes(self) -> float:
    return self.device_bytes * self.usable_fraction

  @property
  def headroom(self) -> float:
    return self.usable_bytes - self.total

  @property
  def kv_cache_bytes(self) -> int:
    """Bytes of one device's KV pool (whole pages): what the engine is given."""
    return self.kv_pool_pages * self.kv_bytes_per_page

  @property
  def pool_fits(self) -> bool:
    """The pool holds at least one sequence of the maximum length."""
    return self.kv_pool_pages >= self.kv_min_pages

  @property
  def fits(self) -> bool:
    return self.total <= self.usable_bytes and self.pool_fits

  def message(self) -> str:
    """One sentence: fits, or what does not fit and by how much."""
    where = f"{self.model} on {self.num_devices} device(s) ({self.mesh.describe()})"
    if self.total <= self.usable_bytes and not self.pool_fits:
      return (f"{where} does not fit: after parameters, optimizer and activations the KV "
              f"pool gets {self.kv_pool_pages} pages but one sequence of the maximum length "
              f"needs {self.kv_min_pages - 1} (+ the null page); use more devices "
              "(fsdp/tensor), a shorter context, a smaller micro-batch or kv_cache_gb=")
    if self.fits:
      return (f"{where} fits: {self.total / GB:.2f} GB per device of "
              f"{self.usable_bytes / GB:.2f} GB usable ({self.headroom / GB:.2f} GB headroom)")
    top = sorted(self.items, key=lambda i: -i.per_device)[:3]
    parts = ", ".join(f"{i.name} {i.per_device / GB:.2f} GB" for i in top)
    peak = self.peak_phase
    knobs = {"rollout_decode": "num_slots=, kv_cache_fraction= or a shorter context",
             "rollout_prefill": "max_prefill_tokens= (tokens per prefill call), num_slots=",
             "rollout_readmit": "a shorter context (max_new_tokens=)",
             "update": "max_tokens_per_micro_batch= / micro_batch_size=, remat=true",
             "distill": "max_tokens_per_micro_batch= / micro_batch_size=",
             "recompute": "logprob_max_tokens_per_micro_batch= / logprob_micro_batch_size=",
             "reference": "logprob_max_tokens_per_micro_batch= / logprob_micro_batch_size=",
             "probe": "logprob_max_tokens_per_micro_batch= / logprob_micro_batch_size=",
             "update_apply": "more devices (mesh=fsdp=-1) or bfloat16 parameters"}
    return (f"{where} does not fit: its largest phase, {peak.name}, needs "
            f"{peak.total / GB:.2f} GB per device ({peak.program / GB:.2f} GB program + "
            f"{peak.resident / GB:.2f} GB resident) but only {self.usable_bytes / GB:.2f} GB "
            f"is usable ({self.usable_fraction:.0%} of {self.device_bytes / GB:.2f} GB), short "
            f"by {-self.headroom / GB:.2f} GB; largest items: {parts}. Change "
            f"{knobs.get(peak.name, 'the batch or context')}, or use more devices "
            "(fsdp/tensor) or bfloat16 parameters")

  def format_table(self) -> str:
    w = max(len(i.name) for i in self.items) + 2
    lines = [f"memory plan: {self.model} ({self.param_count / 1e9:.3f} B params) on "
             f"{self.num_devices} device(s), mesh {self.mesh.describe()}; GB = 1e9 bytes, "
             "per device",
             f"  {'item'.ljust(w)}{'GB':>10}  note"]
    for i in self.items:
      lines.append(f"  {i.name.ljust(w)}{i.per_device / GB:>10.3f}  {i.note}")
    pw = max([len(p.name) for p in self.phases] + [5]) + 2
    lines.append(f"  phases (one at a time; the KV pool is "
                 f"{'released while training' if self.pool_released else 'held throughout'}):")
    lines.append(f"    {'phase'.ljust(pw)}{'program':>9}{'resident':>10}{'total':>9}  note")
    for ph in self.phases:
      lines.append(f"    {ph.name.ljust(pw)}{ph.program / GB:>9.3f}{ph.resident / GB:>10.3f}"
                   f"{ph.total / GB:>9.3f}  {ph.note}")
    lines.append(f"  {'total'.ljust(w)}{self.total / GB:>10.3f}  peak phase: "
                 f"{self.peak_phase.name}")
    lines.append(f"  {'usable'.ljust(w)}{self.usable_bytes / GB:>10.3f}  "
                 f"{self.usable_fraction:.0%} of {self.device_bytes / GB:.2f} GB")
    lines.append(f"  {'headroom'.ljust(w)}{self.headroom / GB:>10.3f}  "
                 f"{'fits' if self.fits else 'DOES NOT FIT'}")
    for fb in self.fallbacks:
      lines.append(f"  fallback: {fb}")
    lines.append(self.message())
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {"model": self.model, "mesh": self.mesh.describe(), "num_devices": self.num_devices,
            "device_bytes": self.device_bytes, "usable_bytes": self.usable_bytes,
            "param_count": self.param_count, "param_bytes_total": self.param_bytes_total,
            "items": {i.name: i.per_device for i in self.items}, "total": self.total,
            "headroom": self.headroom, "fits": self.fits,
            "kv_pool_pages": self.kv_pool_pages, "kv_bytes_per_page": self.kv_bytes_per_page,
            "concurrency": dict(self.concurrency),
            "concurrency_held": dict(self.concurrency_held),
            "phases": {p.name: {"program": p.program, "resident": p.resident,
                                "total": p.total} for p in self.phases}}



H200_BYTES = 141e9  # what a dry run plans for when no accelerator is at hand


def device_memory_bytes(device=None, fallback: float = 0.0) -> tuple[float, str]:
  """(bytes one device can hold, where the figure comes from): an accelerator's own limit
  (`fallback`, else an H200's, when it reports none), or on CPU the host's available RAM
  (what a CPU run's arrays come out of)."""
  if device is None:
    device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      return float(stats["bytes_limit"]), f"{device.device_kind} memory"
    return (fallback or H200_BYTES,
            f"{device.device_kind} (no memory stats: {fallback or H200_BYTES:.3g} bytes)")
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    avail = float(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    avail = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
  # Every CPU "device" shares the host: each gets its share.
  return avail / max(jax.local_device_count(), 1), "host RAM available (CPU)"


def _div_or_keep(n: int, t: int) -> int:
  """Size of a dimension split over `t` devices, or whole when not divisible."""
  return n // t if n % t == 0 else n


# ----------------------------------------------------------------------------- the plan


def plan_memory(model_cfg: ModelConfig, mesh_cfg: sh.MeshConfig | str | None = None, *,
                batch_slots: int, context_len: int, page_size: int = 16,
                train_micro_batch: int, train_seq_len: int, lora_rank: int = 0,
                lora_targets: Sequence[str] = (), lora_dtype: str = "float32",
                optimizer: str = "adamw", param_dtype: str | None = None,
                opt_dtype: str = "float32", compute_dtype: str | None = None,
                cache_dtype: str | None = None, landmark: str = "mean",
                landmark_dtype: str = "float32",
                master_weights: bool | None = None, reference_model: bool = False,
                remat: bool = True, logits_chunk: int | None = None,
                attn_chunk: int = 256,
                device_bytes: float = 141e9, usable_fraction: float = 0.9,
                num_devices: int | None = None, kv_cache_bytes: int | None = None,
                kv_cache_fraction: float = 0.9,
                mean_context_len: int | None = None, logprob_micro_batch: int | None = None,
                logprob_seq_len: int | None = None, logprob_topk: int = 20,
                skip_recompute: bool = False, distill: bool = True,
                release_kv_cache: bool = True, prefill_len: int | None = None,
                probe: bool = False,
                activation_dtype: str | None = None, decode_backend: str = "pallas",
                decode_pages: int | None = None,
                kv_cache_pages: int | None = None,
                max_prefill_tokens: int = 0) -> MemoryPlan:
  """Per-device memory plan (see the module docstring for what each row counts).

  `mesh_cfg` may hold a -1 axis when `num_devices` is given; `param_dtype`, `compute_dtype`
  default to the model config's, `cache_dtype` to the compute dtype; `master_weights`
  defaults to "param_dtype narrower than opt_dtype". `activation_dtype` (default the compute
  dtype) is the dtype activations are held in: "float32" models XLA:CPU, which computes bf16
  dots in float32 (`train.py --dry-run --compile` compares against such a compile).
  `decode_backend`: the decode attention that runs ("pallas": the kernels read K/V pages in
  place; "xla": selected pages are gathered); `decode_pages`: pages a sparse decode step
  reads per sequence (max budget + reserved pages; None: dense, every page);
  `kv_cache_pages`: a pool of this many pages per device instead of one sized to memory;
  `max_prefill_tokens`: the engine's per-call prefill limit (0: every slot at once).
  """
  if decode_backend not in DECODE_BACKENDS:
    raise ValueError(f"plan_memory decode_backend={decode_backend!r}: expected one of "
                     f"{DECODE_BACKENDS}")
  mesh_cfg, num_devices = _resolve_mesh(mesh_cfg, num_devices)
  _check_args(batch_slots=batch_slots, context_len=context_len, page_size=page_size,
              train_micro_batch=train_micro_batch, train_seq_len=train_seq_len,
              optimizer=optimizer, landmark=landmark, lora_rank=lora_rank,
              lora_targets=lora_targets, usable_fraction=usable_fraction,
              kv_cache_fraction=kv_cache_fraction, kv_cache_bytes=kv_cache_bytes)
  param_dtype = param_dtype or model_cfg.param_dtype
  compute_dtype = compute_dtype or model_cfg.dtype
  cfg = model_cfg.replace(param_dtype=param_dtype, dtype=compute_dtype)
  sizes = mesh_cfg.axis_sizes()
  if master_weights is None:
    master_weights = optimizer != "sgd" and _itemsize(param_dtype) < _itemsize(opt_dtype)

  state = _training_state(cfg, sizes, optimizer=optimizer, opt_dtype=opt_dtype,
                          master_weights=master_weights, reference_model=reference_model,
                          lora_rank=lora_rank, lora_targets=lora_targets,
                          lora_dtype=lora_dtype)
  work = _Work.of(cfg, sizes, state.params, activation_dtype=activation_dtype,
                  logits_chunk=logits_chunk, attn_chunk=attn_chunk)
  train = _TrainShape.of(work.groups, train_micro_batch=train_micro_batch,
                         train_seq_len=train_seq_len, logprob_micro_batch=logprob_micro_batch,
                         logprob_seq_len=logprob_seq_len)
  items = list(state.items)
  items.append(_activations_item(work, train, remat))
  fsdp = _fsdp_buffers(cfg, sizes, state.params)
  if fsdp.item is not None:
    items.append(fsdp.item)
  rollout_params = _rollout_params_item(cfg, sizes, state.n_params)
  if rollout_params is not None:
    items.append(rollout_params)
  train_phases = _training_phases(
      items, work, train, fsdp, logprob_topk=logprob_topk, skip_recompute=skip_recompute,
      reference_model=reference_model, lora_rank=lora_rank, distill=distill, probe=probe)

  geo = _PoolGeometry.of(cfg, batch_slots=batch_slots, context_len=context_len,
                         page_size=page_size, cache_dtype=cache_dtype or compute_dtype,
                         landmark=landmark, landmark_dtype=landmark_dtype)
  ws = _rollout_workspaces(work, geo, prefill_len=prefill_len,
                           max_prefill_tokens=max_prefill_tokens, landmark=landmark,
                           decode_pages=decode_pages, decode_backend=decode_backend)
  rollout_bytes = rollout_params.per_device if rollout_params is not None else 0
  pool = _size_pool(
      geo, ws, train_phases, rollout_params=rollout_bytes,
      rollout_resident=_rollout_resident(items), usable=device_bytes * usable_fraction,
      release_kv_cache=release_kv_cache, kv_cache_pages=kv_cache_pages,
      kv_cache_bytes=kv_cache_bytes, kv_cache_fraction=kv_cache_fraction,
      mean_context_len=mean_context_len)
  items.append(_kv_cache_item(geo, pool))
  phases = _all_phases(train_phases, geo, ws, pool, rollout_params=rollout_bytes,
                       rollout_resident=_rollout_resident(items),
                       release_kv_cache=release_kv_cache)
  return MemoryPlan(
      kv_pool_pages=int(pool.pages), kv_bytes_per_page=int(geo.per_page),
      kv_min_pages=geo.max_pages + 1, concurrency=pool.concurrency,
      concurrency_held=pool.concurrency_held, phases=tuple(phases),
      pool_released=release_kv_cache, pool_room=float(max(pool.left, 0.0)),
      model=model_cfg.name, mesh=mesh_cfg, num_devices=num_devices, device_bytes=device_bytes,
      usable_fraction=usable_fraction, param_count=state.n_params,
      param_bytes_total=state.p_tot, items=tuple(items),
      fallbacks=tuple(sh.summarize_fallbacks(state.fallbacks)))


def _resolve_mesh(mesh_cfg, num_devices: int | None) -> tuple[sh.MeshConfig, int]:
  """The mesh with its -1 axis resolved, and the device count."""
  if not isinstance(mesh_cfg, sh.MeshConfig):
    mesh_cfg = sh.parse_mesh(mesh_cfg)
  if num_devices is None:
    if not mesh_cfg.is_resolved:
      raise ValueError(f"plan_memory: mesh {mesh_cfg.describe()} has a -1 axis; pass "
                       "num_devices")
    num_devices = math.prod(mesh_cfg.shape)
  return mesh_cfg.resolve(num_devices), num_devices


def _check_args(*, batch_slots, context_len, page_size, train_micro_batch, train_seq_len,
                optimizer, landmark, lora_rank, lora_targets, usable_fraction,
                kv_cache_fraction, kv_cache_bytes) -> None:
  for name, v in (("batch_slots", batch_slots), ("context_len", context_len),
                  ("page_size", page_size), ("train_micro_batch", train_micro_batch),
                  ("train_seq_len", train_seq_len)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"plan_memory {name}={v!r}: expected a positive int")
  if optimizer not in _MOMENTS:
    raise ValueError(f"plan_memory optimizer={optimizer!r}: expected one of {sorted(_MOMENTS)}")
  if landmark not in ("none", "mean", "quest"):
    raise ValueError(f"plan_memory landmark={landmark!r}: expected 'none', 'mean' or 'quest'")
  bad = [t for t in lora_targets if t not in LORA_TARGETS]
  if bad:
    raise ValueError(f"plan_memory lora_targets={tuple(lora_targets)}: unknown {bad}; "
                     f"expected a subset of {LORA_TARGETS}")
  if lora_rank < 0 or (lora_rank > 0 and not lora_targets):
    raise ValueError(f"plan_memory lora_rank={lora_rank} with lora_targets="
                     f"{tuple(lora_targets)}: expected rank >= 0 and targets when rank > 0")
  if not 0 < usable_fraction <= 1:
    raise ValueError(f"plan_memory usable_fraction={usable_fraction}: expected in (0, 1]")
  if not 0 < kv_cache_fraction <= 1:
    raise ValueError(f"plan_memory kv_cache_fraction={kv_cache_fraction}: expected in (0, 1]")
  if kv_cache_bytes is not None and kv_cache_bytes <= 0:
    raise ValueError(f"plan_memory kv_cache_bytes={kv_cache_bytes}: expected > 0")


# ----------------------------------------------------------------------------- training state


@dataclasses.dataclass(frozen=True)
class _State:
  """The rows held between phases: params, grads, optimizer, reference, LoRA."""

  items: tuple[MemoryItem, ...]
  params: dict  # the abstract parameter tree
  n_params: int
  p_tot: int  # bytes of all parameters once
  fallbacks: list


def _training_state(cfg: ModelConfig, sizes, *, optimizer, opt_dtype, master_weights,
                    reference_model, lora_rank, lora_targets, lora_dtype) -> _State:
  params = abstract_params(cfg)
  p_dev, p_tot, fallbacks = per_device_bytes(params, sizes)
  pb = _itemsize(cfg.param_dtype)
  n_params = p_tot // pb
  items = [MemoryItem("params", p_dev, f"{n_params / 1e9:.3f} B x {cfg.param_dtype}"),
           MemoryItem("grads", p_dev, f"{cfg.param_dtype}, sharded like params"),
           _optimizer_item(p_dev // pb, optimizer, opt_dtype, master_weights)]
  if reference_model:
    items.append(MemoryItem("reference", p_dev, "frozen reference policy (KL)"))
  if lora_rank > 0:
    lora, lfb = _lora_item(cfg, sizes, lora_rank, lora_targets, lora_dtype, optimizer,
                           opt_dtype)
    items.append(lora)
    fallbacks += lfb
  return _State(tuple(items), params, n_params, p_tot, fallbacks)


def _optimizer_item(elems: int, optimizer: str, opt_dtype: str,
                    master_weights: bool) -> MemoryItem:
  """Moments (and a master copy) of `elems` parameters per device, plus the step count."""
  n_mom = _MOMENTS[optimizer]
  opt = (n_mom + int(master_weights)) * elems * _itemsize(opt_dtype) + (4 if n_mom else 0)
  note = (f"{optimizer}: {n_mom} moments {opt_dtype}"
          + (f" + {opt_dtype} master copy" if master_weights else ""))
  return MemoryItem("optimizer", opt, note)


def _lora_item(cfg: ModelConfig, sizes, rank: int, targets, dtype: str, optimizer: str,
               opt_dtype: str) -> tuple[MemoryItem, list]:
  """LoRA factors, their gradient and optimizer moments; and the sharding fallbacks."""
  lora = abstract_lora(cfg, rank, targets, dtype)
  l_dev, l_tot, fallbacks = per_device_bytes(lora, sizes)
  lb, ob, n_mom = _itemsize(dtype), _itemsize(opt_dtype), _MOMENTS[optimizer]
  l_master = n_mom > 0 and lb < ob
  l_opt = (n_mom + int(l_master)) * (l_dev // lb) * ob
  item = MemoryItem("lora", 2 * l_dev + l_opt,
                    f"r={rank} on {','.join(targets)}: {l_tot // lb / 1e6:.1f} M x {dtype}"
                    f" + grads + {n_mom} moments")
  return item, fallbacks


@dataclasses.dataclass(frozen=True)
class _Fsdp:
  item: MemoryItem | None
  fsdp: int  # a forward/backward's gathered buffers
  fwd: int  # a no-grad forward's


def _fsdp_buffers(cfg: ModelConfig, sizes, params: dict) -> _Fsdp:
  """Gathered weights of a forward/backward (`fsdp`) and of a no-grad forward."""
  if sizes["fsdp"] <= 1:
    return _Fsdp(None, 0, 0)
  t = sizes["tensor"]
  layer1, _, _ = per_device_bytes(params["layers"][0], {"data": 1, "fsdp": 1, "tensor": t})
  embed = _div_or_keep(cfg.vocab_size, t) * cfg.hidden_size * _itemsize(cfg.param_dtype)
  fsdp = 2 * max(layer1, embed)
  # A no-grad forward gathers layer by layer; its LM head needs no gathered embedding (the
  # batch-sharded logits are computed from the sharded table; compiled: 7.5 GB per device
  # for the 1.7B recompute on 4 devices, with 2 gathered layers).
  item = MemoryItem("fsdp_buffers", fsdp, "2 gathered layers (or the embedding) per tensor shard")
  return _Fsdp(item, fsdp, 2 * layer1)


def _rollout_params_item(cfg: ModelConfig, sizes, n_params: int) -> MemoryItem | None:
  """The engine's replicated copy of the parameters, when it cannot use the training ones."""
  ci, pb = _itemsize(cfg.dtype), _itemsize(cfg.param_dtype)
  if not (sizes["fsdp"] * sizes["tensor"] > 1 or ci < pb):
    return None
  return MemoryItem("rollout_params", n_params * min(ci, pb),
                    f"replicated rollout copy in {cfg.dtype if ci < pb else cfg.param_dtype}")


def _rollout_resident(items) -> int:
  """What stays while rolling out: the training state (params, optimizer, reference,
  LoRA); the engine's parameter copy and the pool are the rollout phases' own."""
  item = {i.name: i.per_device for i in items}
  return item["params"] + (item["optimizer"] + item.get("reference", 0) + item.get("lora", 0))


# ----------------------------------------------------------------------------- training phases


@dataclasses.dataclass(frozen=True)
class _Work:
  """Working-set model of one device's forward / backward (run/compile_plan.py measures the
  same programs): per-token activations of one layer, attention and logits chunks."""

  cfg: ModelConfig
  groups: int  # batch shards: rows of a micro-batch are split over them
  a: int  # bytes of an activation element
  ci: int  # bytes of a compute-dtype element
  n_h: int  # heads, intermediate size, vocabulary, kv heads per tensor shard
  f_d: int
  v_d: int
  kh: int
  e_layer: int  # one layer's activations per token (elements)
  layer_elems: int  # the decoder's stacked (scanned) layer weights per device
  chunk_tokens: int
  attn_chunk: int

  @classmethod
  def of(cls, cfg: ModelConfig, sizes, params: dict, *, activation_dtype, logits_chunk,
         attn_chunk) -> _Work:
    t = sizes["tensor"]
    n_h, f_d, v_d = (_div_or_keep(cfg.num_heads, t), _div_or_keep(cfg.intermediate_size, t),
                     _div_or_keep(cfg.vocab_size, t))
    kh = _div_or_keep(cfg.num_kv_heads, t)
    # x / norms / residuals, q / o, k / v, the MLP's gate / up / product.
    e_layer = 4 * cfg.hidden_size + 2 * n_h * cfg.head_dim + 2 * kh * cfg.head_dim + 3 * f_d
    layer_dev, _, _ = per_device_bytes(params["layers"], sizes, dtype="float32")
    return cls(cfg=cfg, groups=sh.batch_divisor(sizes),
               a=_itemsize(activation_dtype or cfg.dtype), ci=_itemsize(cfg.dtype),
               n_h=n_h, f_d=f_d, v_d=v_d, kh=kh, e_layer=e_layer, layer_elems=layer_dev // 4,
               chunk_tokens=logits_chunk or 128, attn_chunk=attn_chunk)

  def logits_bytes(self, rows_dev, rows, length):
    c = time_chunk(self.chunk_tokens, rows, length)
    return rows_dev * c * self.v_d * 4

  def attn_bytes(self, rows_dev, length):
    c = min(self.attn_chunk, length)
    return rows_dev * c * self.n_h * length * 4

  def forward_ws(self, rows_dev, rows, length):
    """Temporaries of a no-grad forward (recompute, reference)."""
    n, a = rows_dev * length, self.a
    return (self.layer_elems * a + _RHO_FWD * n * self.e_layer * a
            + _ATTN_FWD * self.attn_bytes(rows_dev, length)
            + _LOGITS_FWD * self.logits_bytes(rows_dev, rows, length))

  def backward_ws(self, rows_dev, rows, length, remat_):
    """Temporaries of a forward + backward (update, DistillSparse) besides the gradients."""
    n, a = rows_dev * length, self.a
    per_token = self.cfg.hidden_size if remat_ else _SIGMA_NO_REMAT * self.e_layer
    saved = n * self.cfg.num_layers * per_token * a
    return (self.layer_elems * self.ci + saved + _RHO_BWD * n * self.e_layer * a
            + _ATTN_BWD * self.attn_bytes(rows_dev, length)
            + _LOGITS_BWD * self.logits_bytes(rows_dev, rows, length))


@dataclasses.dataclass(frozen=True)
class _TrainShape:
  """Micro-batches per device: the update's (b rows of seq tokens, of `rows` globally) and
  the no-grad forwards' (lb of lb_seq, of `lb_rows`)."""

  rows: int
  b: int
  seq: int
  lb_rows: int
  lb: int
  lb_seq: int

  @classmethod
  def of(cls, groups: int, *, train_micro_batch, train_seq_len, logprob_micro_batch,
         logprob_seq_len) -> _TrainShape:
    lb_rows = logprob_micro_batch or train_micro_batch
    return cls(rows=train_micro_batch, b=-(-train_micro_batch // groups), seq=train_seq_len,
               lb_rows=lb_rows, lb=-(-lb_rows // groups), lb_seq=logprob_seq_len or train_seq_len)


def _activations_item(work: _Work, train: _TrainShape, remat: bool) -> MemoryItem:
  act = int(work.backward_ws(train.b, train.rows, train.seq, remat))
  return MemoryItem("activations", act, f"update micro-batch: {train.b} seq x {train.seq} tok "
                    f"per device, remat={remat}")


def _training_phases(items, work: _Work, train: _TrainShape, fsdp: _Fsdp, *, logprob_topk,
                     skip_recompute, reference_model, lora_rank, distill,
                     probe) -> list[PhasePlan]:
  """The step's training phases in order, program and resident bytes unrounded."""
  item = {i.name: i.per_device for i in items}
  p_dev, act = item["params"], item["activations"]
  opt_b, ref_b, lora_b = item["optimizer"], item.get("reference", 0), item.get("lora", 0)
  lora_params = lora_b // 4 if lora_b else 0  # factors, grads, 2 moments (float32)
  lb, lb_rows, lb_seq = train.lb, train.lb_rows, train.lb_seq
  fwd = work.forward_ws(lb, lb_rows, lb_seq)
  train_resident = opt_b + ref_b + lora_b
  phases: list[PhasePlan] = []
  if not skip_recompute:
    phases.append(PhasePlan(
        "recompute", p_dev + fwd + fsdp.fwd + lb * lb_seq * (4 + 8 * logprob_topk),
        train_resident, f"no-grad forward, {lb} seq x {lb_seq} tok per device"))
  if reference_model:
    phases.append(PhasePlan("reference", p_dev + fwd + fsdp.fwd, p_dev + opt_b + lora_b,
                            "the KL reference's forward"))
  if lora_rank > 0 and distill:
    bwd = work.backward_ws(train.b, train.rows, train.seq, True)
    phases.append(PhasePlan(
        "distill", p_dev + 2 * lora_params + bwd + fsdp.fsdp,
        opt_b + ref_b + 2 * lora_params, "LoRA-only forward/backward through the sparse path"))
    phases.append(PhasePlan("distill_apply", 4 * lora_params + int(_APPLY * lora_params),
                            p_dev + opt_b + ref_b, "the LoRA's optimizer step"))
  if probe:
    phases.append(PhasePlan(
        "probe", p_dev + lora_params + fwd + _RHO_FWD * lb * lb_seq * work.e_layer * work.a
        + fsdp.fwd, opt_b + ref_b + 3 * lora_params,
        "ladder probe or exact alpha: dense and sparse(+LoRA) forwards"))
  phases.append(PhasePlan("update", 2 * p_dev + p_dev + act + fsdp.fsdp, train_resident,
                          "forward/backward: params + gradient accumulator + gradients"))
  o_dev_elems = p_dev // _itemsize(work.cfg.param_dtype)
  phases.append(PhasePlan("update_apply", p_dev + opt_b + p_dev + int(_APPLY * o_dev_elems * 4),
                          ref_b + lora_b, "the optimizer step"))
  return phases


# ----------------------------------------------------------------------------- rollout


@dataclasses.dataclass(frozen=True)
class _PoolGeometry:
  """The engine's pages: bytes of one page, pages of one maximum-length sequence, the pool's
  cap (every slot at context_len + the null page), the page tables' bytes."""

  batch_slots: int
  context_len: int
  page_size: int
  cache_dtype: str
  landmark: str
  per_page: int
  max_pages: int
  cap: int
  tables: int

  @classmethod
  def of(cls, cfg: ModelConfig, *, batch_slots, context_len, page_size, cache_dtype, landmark,
         landmark_dtype) -> _PoolGeometry:
    per_page = kv_bytes_per_page(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, page_size=page_size, dtype=cache_dtype,
                                 landmark=landmark, landmark_dtype=landmark_dtype)
    max_pages = -(-context_len // page_size)
    return cls(batch_slots=batch_slots, context_len=context_len, page_size=page_size,
               cache_dtype=cache_dtype, landmark=landmark, per_page=per_page,
               max_pages=max_pages, cap=batch_slots * max_pages + 1,
               tables=batch_slots * (max_pages * 4 + 4))  # page table rows + lengths


@dataclasses.dataclass(frozen=True)
class _RolloutWork:
  prefill_rows: int  # prompts a prefill runs together
  prompt: int  # tokens of each
  prefill: int  # bytes: a prefill's, a readmission's and a decode step's working sets
  readmit: int
  decode: int


def _rollout_workspaces(work: _Work, geo: _PoolGeometry, *, prefill_len, max_prefill_tokens,
                        landmark, decode_pages, decode_backend) -> _RolloutWork:
  """Working sets of the engine's programs: a prefill runs the admitted prompts together,
  or one readmitted sequence alone; a decode step samples every slot and, in the sparse
  layers, selects pages (and on the XLA path gathers them; dense layers walk 16-page blocks:
  small)."""
  a, v_d, slots, context_len = work.a, work.v_d, geo.batch_slots, geo.context_len
  prompt = min(prefill_len or context_len, context_len)
  prefill_rows = slots
  if max_prefill_tokens:  # (the engine pads rows to a power of two within the limit)
    prefill_rows = min(slots, max(1, 1 << ((max_prefill_tokens // prompt).bit_length() - 1)))
  prefill_tokens = prefill_rows * prompt
  prefill_ws = int(_RHO_PREFILL * prefill_tokens * work.e_layer * a + slots * 3 * v_d * 4)
  readmit_ws = int(_RHO_PREFILL * context_len * work.e_layer * a + 3 * v_d * 4)
  kv_row = work.kh * work.cfg.head_dim * 4  # one token's (or landmark's) K or V row, float32
  sparse = landmark != "none"
  lm_gather = 2 * geo.max_pages * kv_row if sparse else 0
  read_pages = min(decode_pages or geo.max_pages, geo.max_pages) if sparse else 16
  kv_gather = 2 * read_pages * geo.page_size * kv_row if decode_backend == "xla" else 0
  decode_ws = int(slots * (3 * v_d * 4 + 8 * work.cfg.hidden_size * 4
                           + (_DECODE_XLA if decode_backend == "xla" else 1.0)
                           * (lm_gather + kv_gather)))
  return _RolloutWork(prefill_rows, prompt, prefill_ws, readmit_ws, decode_ws)


@dataclasses.dataclass(frozen=True)
class _Pool:
  pages: int  # of one device's pool, null page included
  how: str  # what it was sized from
  left: float  # bytes it was sized from (before kv_cache_fraction)
  concurrency: dict
  concurrency_held: dict  # were the pool kept through training


def _size_pool(geo: _PoolGeometry, ws: _RolloutWork, train_phases, *, rollout_params: int,
               rollout_resident: int, usable: float, release_kv_cache: bool, kv_cache_pages,
               kv_cache_bytes, kv_cache_fraction, mean_context_len) -> _Pool:
  """The KV pool in whole pages: what the rollout phase leaves of the usable memory (vLLM's
  gpu_memory_utilization), or a given size. Held through training too
  (release_kv_cache=false), it must also fit beside the largest training phase."""
  rollout_ws = rollout_params + geo.tables + max(ws.prefill, ws.readmit, ws.decode)
  left_rollout = usable - rollout_resident - rollout_ws
  left_train = usable - max(ph.total for ph in train_phases)
  left_held = min(left_rollout, left_train)
  left = left_rollout if release_kv_cache else left_held

  def pages_for_left(room):
    if kv_cache_pages is not None:
      return int(kv_cache_pages)
    if kv_cache_bytes is not None:
      return min(int(kv_cache_bytes) // geo.per_page, geo.cap)
    return min(int(max(room, 0.0) * kv_cache_fraction) // geo.per_page, geo.cap)

  if kv_cache_pages is not None:
    how = "a given pool size"
  elif kv_cache_bytes is not None:
    how = f"kv_cache_bytes={kv_cache_bytes / GB:.2f} GB"
  else:
    how = (f"{kv_cache_fraction:.0%} of the {max(left, 0.0) / GB:.2f} GB the "
           f"{'rollout phase' if release_kv_cache else 'largest phase'} leaves")
  pages = pages_for_left(left)
  mean_len = mean_context_len or max(geo.context_len // 2, 1)
  return _Pool(pages, how, left, _concurrency(geo, pages, mean_len),
               _concurrency(geo, pages_for_left(left_held), mean_len))


def _concurrency(geo: _PoolGeometry, pages: int, mean_len: int) -> dict:
  """Sequences of the maximum and of the mean length a pool of `pages` holds at once."""
  usable_pages = max(pages - 1, 0)
  return {"max_len": geo.context_len, "mean_len": mean_len,
          "at_max": min(geo.batch_slots, usable_pages // geo.max_pages),
          "at_mean": min(geo.batch_slots, usable_pages // -(-mean_len // geo.page_size))}


def _kv_cache_item(geo: _PoolGeometry, pool: _Pool) -> MemoryItem:
  conc = pool.concurrency
  capped = ", capped at every slot full" if pool.pages == geo.cap else ""
  return MemoryItem(
      "kv_cache", pool.pages * geo.per_page + geo.tables,
      f"{pool.pages} pages x {geo.page_size} tok ({pool.how}{capped}); "
      f"{geo.per_page / 1e6:.3f} MB/page, {geo.cache_dtype}, landmarks={geo.landmark}; "
      f"{geo.batch_slots} slots/device; concurrent sequences: {conc['at_mean']} at the mean "
      f"length {conc['mean_len']}, {conc['at_max']} at the max {geo.context_len}")


def _all_phases(train_phases, geo: _PoolGeometry, ws: _RolloutWork, pool: _Pool, *,
                rollout_params: int, rollout_resident: int,
                release_kv_cache: bool) -> list[PhasePlan]:
  """The rollout phases (engine weights, pool and one program's working set, beside the
  training state), then the training phases in whole bytes; a pool held through training
  adds to every training phase's resident bytes."""
  engine = rollout_params + pool.pages * geo.per_page + geo.tables
  phases = [
      PhasePlan("rollout_decode", engine + ws.decode, rollout_resident,
                "decode steps: engine weights + KV pool"),
      PhasePlan("rollout_prefill", engine + ws.prefill, rollout_resident,
                f"prefill: {ws.prefill_rows} admitted prompts x {ws.prompt} tokens"),
      PhasePlan("rollout_readmit", engine + ws.readmit, rollout_resident,
                f"prefill of one readmitted sequence at {geo.context_len} tokens")]
  phases += [dataclasses.replace(ph, program=int(ph.program), resident=int(ph.resident))
             for ph in train_phases]
  if not release_kv_cache:
    pool_bytes = pool.pages * geo.per_page + geo.tables
    phases = [ph if ph.name.startswith("rollout") else
              dataclasses.replace(ph, resident=ph.resident + pool_bytes,
                                  note=ph.note + " (+ KV pool)") for ph in phases]
  return phases
