"""`train.py --dry-run --compile`: every jitted program of one step, compiled ahead of time at
the preset's real shapes and mesh, and XLA's own memory analysis per device.

Nothing is allocated: parameters, optimizer state, LoRA and micro-batches are
`jax.ShapeDtypeStruct`s carrying the shardings the trainer would give them (`nnx.eval_shape`
for the model), and `jax.jit(f).lower(*abstract).compile().memory_analysis()` reports what one
device would hold: arguments, outputs, temporaries and the donated bytes outputs reuse. The
programs are the trainer's own (`run/programs.py`), so what compiles here is what runs.

Each phase is compiled at its worst micro-batch: the longest sequence a run can have
(max_prompt_len + max_new_tokens) with as many rows as the micro-batch knobs allow (the
token budget, else the micro-batch size). A program's peak per device is
`arguments + outputs + temporaries - aliased`; the phase's total adds what stays resident
while it runs but is not an argument (e.g. the optimizer state during the forward/backward).
`run/memory.py: phase_estimates` gives the analytic plan of the same peaks; the dry run prints
both side by side.

Devices: `--num-devices N` CPU devices (forced host devices when the machine has fewer: the
CLI sets `--xla_force_host_platform_device_count` before jax starts). CPU and GPU compilers
fuse differently, so the figures are XLA:CPU's reading of the GPU program; the rollout phases
run the XLA attention path here (the Pallas kernels compile only on a GPU).

One CPU-only correction, applied to the decode chunk alone and reported (`CPU_DECODE_OPTIONS`):
XLA:CPU multiplies bf16 in float32, so the decode chunk's loop converts every rollout weight
to float32, and while-loop-invariant-code-motion hoists those converts out of the loop: the
program would hold a float32 copy of all rollout weights for the whole chunk (twice the bf16
weights; 33 GB on qwen3_8b). A GPU's GEMMs read the bf16 weights themselves and have no such
copy, so on a CPU mesh the decode chunk is compiled a second time with that pass disabled
(per-program compiler options: the process's XLA flags and every other program are untouched)
and the fit is judged on that figure; the figure with the pass stays in the report beside it.
On a GPU/TPU mesh nothing changes: every program compiles as the trainer compiles it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparrow_jax.engine.engine import GenerationEngine
from sparrow_jax.engine.steps import AXIS
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.kv_cache import PagedKVCache
from sparrow_jax.models.decoder import Decoder
from sparrow_jax.models import lora as lora_lib
from sparrow_jax.run import algorithm
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.builders import build_schedule, make_optimizer, model_config
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.programs import build_programs
from sparrow_jax.schedule.schedule import attention_spec


GB = 1e9

# Compiler options of the decode chunk's memory figure on an XLA:CPU mesh (module docstring):
# no hoisting of the loop-invariant bf16 -> float32 weight converts XLA:CPU inserts.
CPU_DECODE_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
CPU_DECODE_WHY = ("XLA:CPU computes bf16 GEMMs in float32 and hoists the weights' converts out "
                  "of the decode loop (a float32 copy of every rollout weight); a GPU reads "
                  "the bf16 weights, so the fit uses the compile without that pass")


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
  """XLA's memory analysis of one compiled program, bytes per device. With `options` set
  the figures are those of the compile with those compiler options (CPU-only, see
  `CPU_DECODE_OPTIONS`) and `default_peak` is the same program compiled without them."""

  name: str
  arguments: int
  outputs: int
  temporaries: int
  aliased: int
  compile_s: float
  shape: str  # the micro-batch it was compiled for
  options: dict | None = None
  default_peak: int | None = None
  default_temporaries: int | None = None

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs + self.temporaries - self.aliased


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def worst_micro_batch(cfg: TrainConfig, divisor: int, *, grad: bool) -> tuple[int, int]:
  """(rows, length) of the largest micro-batch a phase can see: the longest sequence, with
  the rows the token budget (per device) or the micro-batch size allows."""
  length = cfg.max_prompt_len + cfg.max_new_tokens
  budget = (cfg.max_tokens_per_micro_batch if grad else
            (cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch))
  if budget:
    return divisor * max(1, budget // length), length
  rows = cfg.micro_batch if grad else (cfg.logprob_micro_batch_size or cfg.micro_batch)
  return rows, length


def _analyse(name: str, fn, args, shape: str, options: dict | None = None) -> PhaseMemory:
  """Compile `fn` at `args`; with `options`, also compile it with those compiler options
  (`Lowered.compile(compiler_options=...)`: this program only) and report that figure, the
  default compile's peak kept beside it."""
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  ma = lowered.compile().memory_analysis()
  fields = dict(arguments=int(ma.argument_size_in_bytes), outputs=int(ma.output_size_in_bytes),
                temporaries=int(ma.temp_size_in_bytes), aliased=int(ma.alias_size_in_bytes))
  extra = {}
  if options:
    default = PhaseMemory(name=name, compile_s=0.0, shape=shape, **fields)
    ma = lowered.compile(compiler_options=dict(options)).memory_analysis()
    fields = dict(arguments=int(ma.argument_size_in_bytes),
                  outputs=int(ma.output_size_in_bytes),
                  temporaries=int(ma.temp_size_in_bytes), aliased=int(ma.alias_size_in_bytes))
    extra = dict(options=dict(options), default_peak=default.peak,
                 default_temporaries=default.temporaries)
  return PhaseMemory(name=name, compile_s=time.perf_counter() - t0, shape=shape, **fields,
                     **extra)


def decode_options(mesh) -> dict | None:
  """The decode chunk's compiler options for the memory report: `CPU_DECODE_OPTIONS` on an
  XLA:CPU mesh, none elsewhere (a GPU/TPU program is reported as the trainer compiles it)."""
  return dict(CPU_DECODE_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None


def training_phases(cfg: TrainConfig, mesh, *, report: Callable[[str], None] = lambda m: None
                    ) -> dict[str, PhaseMemory]:
  """Compile the training-side programs of one step on `mesh` (recompute, reference, update
  forward/backward and optimizer step, DistillSparse, ladder probe: what `cfg` enables)."""
  mcfg = model_config(cfg)
  model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract = nnx.split(model)
  pshard = sh.param_shardings(abstract, mesh)
  params = _abstract(abstract, pshard)
  tx, _ = make_optimizer(cfg)
  opt_abs = jax.eval_shape(tx.init, params)
  opt = _abstract(opt_abs, sh.opt_state_shardings(opt_abs, pshard, mesh, abstract))
  temperature = algorithm.rollout_temperature(cfg)
  loss_cfg = algorithm.loss_config(cfg)
  schedule = build_schedule(cfg)
  attention = attention_spec(schedule, backend="xla", landmark_dtype=cfg.landmark_dtype)
  dcfg = lora_tx = lora = lora_opt = None
  if cfg.distill:
    dcfg = algorithm.distill_config(cfg)
    lora_tx = algorithm.distill_optimizer(cfg)
    lcfg = algorithm.lora_config(cfg)
    lora_abs = jax.eval_shape(lambda: lora_lib.init_lora(mcfg, lcfg, jax.random.PRNGKey(0)))
    lshard = sh.param_shardings(lora_abs, mesh)
    lora = _abstract(lora_abs, lshard)
    lopt_abs = jax.eval_shape(lora_tx.init, lora)
    lora_opt = _abstract(lopt_abs, sh.opt_state_shardings(lopt_abs, lshard, mesh, lora_abs))
  progs = build_programs(graphdef, cfg, loss_cfg=loss_cfg, tx=tx, temperature=temperature,
                         skip_recompute=cfg.skips_recompute, attention=attention,
                         lora_tx=lora_tx, dcfg=dcfg, mesh=mesh, batch_axes=sh.BATCH_AXES)
  div = sh.batch_divisor(mesh)
  rows_sh = NamedSharding(mesh, P(sh.BATCH_AXES))
  rep = NamedSharding(mesh, P())

  def batch(rows, length, keys):
    spec = {"tokens": ((rows, length), jnp.int32), "lengths": ((rows,), jnp.int32),
            "prompt_lens": ((rows,), jnp.int32), "advantages": ((rows,), jnp.float32),
            "budgets": ((rows, length), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(*spec.get(k, ((rows, length), jnp.float32)),
                                    sharding=rows_sh) for k in keys}

  den = {k: jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
         for k in ("num_tokens", "num_seqs")}
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  out: dict[str, PhaseMemory] = {}

  def run(name, fn, args, rows, length):
    report(f"compiling {name} ({rows} x {length} tokens) ...")
    out[name] = _analyse(name, fn, args, f"{rows}x{length}")
    report(f"  {name}: peak {out[name].peak / GB:.2f} GB per device "
           f"({out[name].compile_s:.1f} s)")

  r, l = worst_micro_batch(cfg, div, grad=False)
  if not cfg.skips_recompute:
    run("recompute", progs.logprobs,
        (params, batch(r, l, ("tokens", "lengths", "prompt_lens"))), r, l)
  if cfg.kl_coef > 0:
    run("reference", progs.ref_logprobs,
        (params, batch(r, l, ("tokens", "lengths", "prompt_lens"))), r, l)
  # The ladder probe and exact_alpha_every run the same program (the ladder's next rung, or
  # the run's own schedule; the memory model has one "probe" phase for either).
  probe_spec = cfg.ladder.split(",")[0].strip() if cfg.ladder.strip() else (
      cfg.schedule if cfg.exact_alpha_every else "")
  cand = build_schedule(cfg, probe_spec) if probe_spec else None
  if cand is not None and not cand.is_dense:
    from sparrow_jax.rl.switching import _probe_alpha
    att = attention_spec(cand, max_position=l, backend="xla",
                         landmark_dtype=cfg.landmark_dtype)
    # exact alpha also replays the sampled tokens' log-probs (Trainer.exact_alpha)
    with_logp = bool(cfg.exact_alpha_every) and cfg.samples_unfiltered
    probe = jax.jit(lambda p, lo, mb, t: _probe_alpha(
        graphdef, p, lo, mb["tokens"], mb["budgets"], mb["prompt_lens"], mb["lengths"], t,
        attention=att, chunk=cfg.logprob_chunk, with_logp=with_logp))
    run("probe", probe, (params, lora, batch(r, l, ("tokens", "budgets", "prompt_lens",
                                                    "lengths")), scalar), r, l)
  r, l = worst_micro_batch(cfg, div, grad=True)
  keys = ["tokens", "lengths", "mask", "advantages", "prompt_lens"]  # (as the trainer's)
  if not cfg.skips_recompute or loss_cfg.rollout_mode == "bypass":
    keys.append("old_logp")
  if loss_cfg.uses_rollout_correction:
    keys.append("rollout_logp")
  if cfg.kl_coef > 0:
    keys.append("ref_logp")
  run("update", progs.grad_step, (params, params, batch(r, l, keys), den), r, l)
  run("update_apply", progs.apply, (params, opt, params, scalar), r, l)
  if cfg.distill:
    dkeys = ["tokens", "mask", "old_logp", "prompt_lens", "lengths", "budgets"]
    if cfg.distill_pg_coef > 0:
      dkeys += ["advantages", "rollout_logp"]
    run("distill", progs.distill_grad,
        (lora, lora, params, batch(r, l, dkeys), {"num_tokens": scalar}), r, l)
    run("distill_apply", progs.distill_apply, (lora, lora_opt, lora, scalar, scalar), r, l)
  return out


class _AbstractEngine(GenerationEngine):
  """The trainer's engine with abstract parameters and an abstract KV pool: its own jitted
  prefill / decode programs can be lowered and compiled, and nothing is allocated."""

  def _place_state(self, state):
    dt = jnp.dtype(self.model_config.dtype)
    rep = NamedSharding(self.mesh, P())

    def cast(x):
      dtype = (dt if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dt.itemsize
               else x.dtype)
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=rep)
    return jax.tree.map(cast, state)

  def _create_pool(self):
    mc, cfg, d = self.model_config, self.config, self.num_shards
    pool = jax.eval_shape(lambda: PagedKVCache.create(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        num_slots=d * cfg.num_slots, num_pages=d * self.pool_pages, max_pages_per_seq=1,
        page_size=cfg.page_size, dtype=self.cache_dtype, landmark=self._landmark,
        landmark_dtype=self._landmark_dtype))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pool,
                        self._cache_shardings())

  def abstract_cache(self, width: int):
    """The pool with a page table of `width` pages per slot (what a call is handed)."""
    rows = self.num_shards * self.config.num_slots
    table = jax.ShapeDtypeStruct((rows, width), jnp.int32,
                                 sharding=NamedSharding(self.mesh, P(AXIS)))
    return self._pool().replace(page_table=table)


def rollout_phases(cfg: TrainConfig, mesh, plan, *,
                   report: Callable[[str], None] = lambda m: None) -> dict[str, PhaseMemory]:
  """Compile the engine's programs at the planned pool (`plan.kv_pool_pages` per device):
  one decode chunk with every slot at the longest context, the prefill of a full batch of
  fresh prompts (dense) and the prefill of one readmitted sequence at the longest context
  (the sparse teacher-forced path under a sparse schedule). Attention on the XLA path."""
  mcfg = model_config(cfg)
  model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))
  schedule = build_schedule(cfg)
  attention = attention_spec(schedule, backend="xla", landmark_dtype=cfg.landmark_dtype)
  ecfg = algorithm.engine_config(cfg, num_pages=plan.kv_pool_pages, cpu_decode_weights=None)
  eng = _AbstractEngine(model, ecfg, attention=attention,
                        schedule=None if schedule.is_dense else schedule, mesh=mesh)
  d, b = eng.num_shards, ecfg.num_slots
  rows_sh = NamedSharding(eng.mesh, P(AXIS))
  rep = NamedSharding(eng.mesh, P())
  vec = lambda n, dt, *tail: jax.ShapeDtypeStruct((n, *tail), dt, sharding=rows_sh)
  table = jax.ShapeDtypeStruct((1 if schedule.is_dense else len(schedule.budgets),),
                               jnp.int32, sharding=rep)
  # Sampling as the trainer's requests ask (top_k bounds the compiled sampler).
  max_top_k = min(cfg.top_k, mcfg.vocab_size) if cfg.temperature > 0 else 0

  def params(n):  # stop ids (decode only), seed words, temperature, top_p, top_k of n rows
    return (vec(n, jnp.int32, 2), vec(n, jnp.uint32, 2), vec(n, jnp.float32),
            vec(n, jnp.float32), vec(n, jnp.int32))

  out: dict[str, PhaseMemory] = {}

  def run(name, fn, args, shape, options=None):
    report(f"compiling {name} ({shape}) ...")
    out[name] = pm = _analyse(name, fn, args, shape, options)
    extra = (f"; {pm.default_peak / GB:.2f} GB compiled without the options" if pm.options
             else "")
    report(f"  {name}: peak {pm.peak / GB:.2f} GB per device{extra} ({pm.compile_s:.1f} s)")

  width = ecfg.max_pages_per_seq
  n = d * b
  decode = eng._get_decode(False, max_top_k)
  run("rollout_decode", decode,
      (eng.state, eng.abstract_cache(width), vec(n, jnp.int32), vec(n, jnp.bool_),
       vec(n, jnp.int32), *params(n), table, None),
      f"{b} slots x {width} pages, chunk {ecfg.decode_chunk}", decode_options(eng.mesh))

  def prefill(name, attn, rows, t):
    fn = eng._get_prefill(attn, max_top_k, False)
    nr = d * rows
    args = (eng.state, eng.abstract_cache(1), vec(nr, jnp.int32, t), vec(nr, jnp.int32),
            vec(nr, jnp.int32), vec(nr, jnp.int32, t // ecfg.page_size), *params(nr)[1:], table,
            vec(nr, jnp.int32), None,
            (jax.ShapeDtypeStruct((t, mcfg.head_dim), jnp.float32, sharding=rep),) * 2)
    return run(name, fn, args, f"{rows}x{t}")

  cap = width * ecfg.page_size
  t_prompt = min(max(ecfg.page_size, 1 << max(0, (cfg.max_prompt_len - 1).bit_length())), cap)
  rows = b  # the admitted prompts one prefill call takes (max_prefill_tokens bounds them)
  if cfg.max_prefill_tokens:
    rows = min(b, max(1, 1 << ((cfg.max_prefill_tokens // t_prompt).bit_length() - 1)))
  prefill("rollout_prefill", attn_lib.Dense(), rows, t_prompt)
  if cap > t_prompt:
    prefill("rollout_readmit", attention, 1, cap)
  return out


def all_phases(cfg: TrainConfig, mesh, *, plan=None,
               report: Callable[[str], None] = lambda m: None) -> dict[str, PhaseMemory]:
  """Every program of one step that `cfg` enables: the rollout's (with `plan`: its pool)
  and the training side's (see `rollout_phases`, `training_phases`)."""
  out = rollout_phases(cfg, mesh, plan, report=report) if plan is not None else {}
  out.update(training_phases(cfg, mesh, report=report))
  return out


def check_devices(num_devices: int) -> list:
  """The first `num_devices` devices, or a clear error naming the XLA flag."""
  devs = jax.devices()
  if len(devs) < num_devices:
    raise ValueError(
        f"--compile on {num_devices} devices: this process has {len(devs)} "
        f"({devs[0].platform}); run it as `python experiments/train.py ... --dry-run --compile "
        f"--num-devices {num_devices}` (the CLI forces host devices before jax starts) or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}")
  return devs[:num_devices]


def make_compile_mesh(cfg: TrainConfig, num_devices: int):
  return sh.make_mesh(sh.parse_mesh(cfg.mesh), devices=check_devices(num_devices))
