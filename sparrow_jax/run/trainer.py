"""GRPO trainer with sparse rollouts: a producer, a learner, hooks and one training state
(the data path of docs/training_step.md).

    producer (run/producer.py)   prompts -> rollout (sparse actor: policy + LoRA,
                                 schedule-driven block-sparse decode) -> rewards -> TrainBatch
    learner stages (run/stages)  prepare -> dense recompute -> advantages -> [DistillSparse]
                                 -> GRPO update (policy only); new weights to the engine
    hooks (run/hooks.py)         exact alpha (before the update), monitor, schedule ladder,
                                 ARRoL's head (after it)
    loop (run/loop.py)           warm start, steps, validation, samples, checkpoints, signals

`TrainState` (run/state.py) is the one pytree a step changes and a checkpoint saves: params,
optimizer state, the KL reference, the sparse actor's LoRA and its optimizer state, the step,
the policy version, the data position. The recompute and the GRPO update never receive the
LoRA, so the policy update cannot depend on it.

Conventions that keep the pieces consistent:
  temperature T   every training-side log-prob (recompute, update, KL reference, DistillSparse,
                  ladder probe, the monitor's dense top-k) is of softmax(logits / T), the
                  distribution the rollout sampled from (verl does the same). top_p < 1 only
                  shapes sampling: the ratios compare full tempered distributions, while the
                  engine's sampled-token log-probs are renormalised over the nucleus.
  masks           the batch's `mask` (the policy's own response tokens) drives the monitor,
                  DistillSparse and the ladder probe (none depends on rewards); the
                  dynamic-sampling mask (zero-variance groups out) drives only the GRPO loss.
  reference       the KL reference is the policy at the start of RL (after the warm start);
                  it is checkpointed with the run.
  several hosts   each process rolls out its share of the prompt groups on its own devices;
                  the gathered completions make the same batch on every process; training
                  arrays are global arrays filled from it, results are read back with
                  collectives (`distributed.fetch`). Process 0 writes logs and exports; every
                  process takes part in checkpoints.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.engine.engine import GenerationEngine
from sparrow_jax.models import save_pretrained
from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl.monitor import MismatchMonitor, MonitorConfig
from sparrow_jax.rl.switching import ScheduleLadder
from sparrow_jax.run import algorithm
from sparrow_jax.run import compile_clock
from sparrow_jax.run import distributed
from sparrow_jax.run import loop
from sparrow_jax.run import setup
from sparrow_jax.run import sharding as sh
from sparrow_jax.run import stages as stages_lib
from sparrow_jax.run import warmstart as warmstart_lib
from sparrow_jax.run.async_producer import AsyncProducer, EngineOverlap
from sparrow_jax.run.batch import TrainBatch, make_batch
from sparrow_jax.run.builders import (Preflight, build_model, make_optimizer, model_config,
                                      preflight)
from sparrow_jax.run.checkpointing import Checkpointer
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.dry_run import plan_for_model
from sparrow_jax.run.hooks import remember_policy, step_hooks
from sparrow_jax.run.learner import Learner, StepRecord
from sparrow_jax.run.loop import TrainingInterrupted, TrainingStopped  # noqa: F401 (API)
from sparrow_jax.run.metrics import MetricsLogger
from sparrow_jax.run.producer import EngineRollout, Producer
from sparrow_jax.run.state import TrainState
from sparrow_jax.run.step_metrics import step_metrics
from sparrow_jax.schedule.schedule import SparsitySchedule, attention_spec, uncalibrated_positions

_log = logging.getLogger(__name__)


def _state_field(name: str) -> property:
  return property(lambda self: getattr(self.state, name),
                  lambda self, v: setattr(self.state, name, v),
                  doc=f"`self.state.{name}`")


class Trainer:
  params = _state_field("params")
  opt_state = _state_field("opt_state")
  ref_params = _state_field("ref_params")
  lora = _state_field("lora")
  lora_opt_state = _state_field("lora_opt_state")
  step = _state_field("step")
  bad_steps = _state_field("bad_steps")

  def __init__(self, cfg: TrainConfig, *, quiet: bool = False, with_dataset: bool = True,
               checked: Preflight | None = None):
    """`with_dataset=False` builds the policy without the training prompts (evaluation,
    export): `examples` is empty and `dataset` None. `checked`: a `preflight(cfg)` result
    the caller already has."""
    self.cfg, self.quiet = cfg, quiet
    # Everything cheap is checked before the (slow) model load.
    checked = checked or preflight(cfg, with_dataset=with_dataset)
    if cfg.compile_cache_dir:
      setup.enable_compile_cache(cfg.compile_cache_dir)
    # A multi-host job is joined by the program's entry point, before jax starts
    # (`distributed.initialize`); a job described but not joined is an error here.
    distributed.require_initialized()
    self.mesh = setup.build_mesh(cfg)
    n_mesh = self.mesh.devices.size
    device, self._memory_source = setup.plan_device(self.mesh, cfg)
    if with_dataset:  # a run that cannot fit this machine is refused before the model loads
      setup.check_memory(plan_for_model(cfg, model_config(cfg), n_mesh, **device),
                         self._memory_source)
    model, self.tokenizer = build_model(cfg)
    self.model_cfg = model.cfg
    self.schedule = checked.schedule
    self.attention = self._attention_spec(self.schedule)
    self.graphdef, params = nnx.split(model)
    param_shardings = sh.param_shardings(params, self.mesh)
    params = sh.shard_tree(params, param_shardings)
    # The KV pool per device is what the memory plan leaves for the rollout phase (the dry run
    # prints the same plan), capped at every slot full; sequences grow into it and are
    # preempted when it runs out.
    self.memory_plan = plan_for_model(cfg, self.model_cfg, n_mesh, **device)
    if with_dataset:
      setup.check_memory(self.memory_plan, self._memory_source)
    elif not self.memory_plan.pool_fits:
      raise ValueError(self.memory_plan.message())
    self.rollout = EngineRollout(self._build_engine(model), topk=cfg.monitor_topk,
                                 release_kv_cache=cfg.kv_pool_released)
    self.state = self._initial_state(params, param_shardings)
    self.examples, self.num_dropped_prompts, self.val_examples, dataset = setup.load_prompts(
        cfg, self.tokenizer, checked, with_dataset)
    self.reward_fn: Callable = checked.reward_fn
    if (cfg.top_p < 1 or cfg.top_k) and self.learner.loss_cfg.uses_rollout_correction:
      _log.warning("top_p=%s / top_k=%s with TIS: the rollout log-probs are renormalised over "
                   "the kept set, the dense ones are not, so the TIS ratio is biased low by "
                   "the kept mass (see README, Configuration)", cfg.top_p, cfg.top_k)
    self.resumed_step: int | None = None
    self.last_rollout = None  # (example of each completion, completions, rewards), last step
    self.policy_history: dict = {}  # version -> (params, actor LoRA): hooks.alpha_split
    self.monitor = MismatchMonitor(MonitorConfig(tau=cfg.tau, bin_size=cfg.mismatch_bin_size,
                                                 min_count=8))
    self.ladder = None
    if checked.ladder:
      self.ladder = ScheduleLadder([self.schedule, *checked.ladder], tau=cfg.tau,
                                   patience=cfg.ladder_patience, probe_every=cfg.probe_every)
    if with_dataset:  # a table used past the positions its calibration measured
      for sched in (self.ladder.schedules if self.ladder else [self.schedule]):
        msg = uncalibrated_positions(sched, cfg.max_prompt_len + cfg.max_new_tokens)
        if msg:
          _log.warning(msg)
    # Without a dataset this trainer only reads a run (which may still be training).
    self.checkpointer = Checkpointer(os.path.join(os.path.abspath(cfg.out_dir), "checkpoints"),
                                     keep_last=cfg.keep_last,
                                     save_every=cfg.save_every or max(cfg.num_steps, 1),
                                     read_only=not with_dataset)
    # ARRoL: the quality head, its optimizer and calibrator; the engine prunes with it.
    self.arrol = self.arrol_stop_ids = None
    if cfg.arrol:
      self.arrol = arrol_lib.ArrolPruner(cfg.arrol_config(), self.model_cfg.hidden_size,
                                         seed=cfg.seed + 11)
      self.arrol_stop_ids = arrol_lib.stop_token_ids(self.tokenizer)
    producer = AsyncProducer if cfg.max_staleness else Producer  # (run/async_producer.py)
    self.producer = producer(cfg, self.tokenizer, dataset, self.rollout, arrol=self.arrol,
                             arrol_stop_ids=self.arrol_stop_ids)
    self.hooks = step_hooks(cfg, ladder_on=self.ladder is not None,
                            arrol_on=self.arrol is not None)
    self.overlap = EngineOverlap(self.producer) if cfg.async_overlap else None

  def _build_engine(self, model) -> GenerationEngine:
    return GenerationEngine(
        model, algorithm.engine_config(self.cfg, kv_cache_bytes=self.memory_plan.kv_cache_bytes),
        attention=self.attention, schedule=None if self.schedule.is_dense else self.schedule,
        mesh=setup.rollout_mesh(self.mesh, self.cfg.rollout_devices))

  def _initial_state(self, params, param_shardings) -> TrainState:
    """Builds the learner and the step-0 state: optimizer, KL reference, LoRA."""
    cfg = self.cfg
    tx, lr_schedule = make_optimizer(cfg)
    opt_state, opt_shardings = self._init_opt(tx, params)
    lora = lora_opt_state = lora_tx = None
    if cfg.distill:
      lora, lora_opt_state, lora_tx = setup.build_lora(cfg, self.model_cfg, self.mesh)
    self.learner = Learner(cfg, self.graphdef, self.mesh, tx=tx, lr_schedule=lr_schedule,
                           param_shardings=param_shardings, opt_shardings=opt_shardings,
                           attention=self.attention, lora_tx=lora_tx)
    return TrainState(step=0, params=params, opt_state=opt_state,
                      ref_params=jax.tree.map(jnp.copy, params) if cfg.kl_coef > 0 else None,
                      lora=lora, lora_opt_state=lora_opt_state, seed=cfg.seed)

  def _init_opt(self, tx, params):
    return setup.init_opt(tx, params, self.mesh)

  # --- the pieces, by name ---------------------------------------------------------------
  @property
  def engine(self) -> GenerationEngine:
    return self.rollout.engine

  @property
  def programs(self):
    return self.learner.programs

  @property
  def dataset(self):
    return self.producer.dataset

  @property
  def temperature(self) -> float:
    return self.learner.temperature

  def make_batch(self, completions, **kw) -> TrainBatch:
    """Completions -> a TrainBatch (`run/batch.py`) with this run's window and top-k."""
    return make_batch(completions, max_new_tokens=self.cfg.max_new_tokens,
                      topk=self.cfg.monitor_topk, **kw)

  def _attention_spec(self, schedule: SparsitySchedule):
    """The attention a schedule implies, with this run's backend, landmark dtype and page
    scorer."""
    return attention_spec(schedule, backend=self.cfg.attention_backend,
                          landmark_dtype=self.cfg.landmark_dtype,
                          page_scorer=self.cfg.page_scorer)

  def switch_schedule(self, schedule: SparsitySchedule) -> None:
    """The sparse actor's schedule from the next rollout on (the ladder's switch)."""
    self.schedule = schedule
    self.attention = self._attention_spec(schedule)
    self.rollout.set_schedule(self.attention, schedule)
    if self.cfg.distill:  # DistillSparse's sparse forward follows the schedule
      self.learner.build_programs(self.attention)

  def _actor_lora(self):
    """The sparse actor's LoRA (DistillSparse), else None."""
    return self.state.lora if self.cfg.distill else None

  def _publish(self) -> None:
    """The training state's policy (and actor LoRA) to the engine for the next rollouts."""
    self.rollout.update_weights(self.state.params, lora=self._actor_lora(),
                                version=self.state.policy_version)

  def rollout_mode(self) -> str:
    """The evaluation mode that matches the training rollouts (the sparse actor)."""
    if self.schedule.is_dense:
      return "dense"
    return "sparse_lora" if self.lora is not None else "sparse"

  # --- one RL step -----------------------------------------------------------------------
  def pipeline(self) -> tuple:
    """(name, fn(rec)) of one step in order: generate (the engine's KV pool is released when
    it hands the batch over), the learner's stages with the before-update hooks ahead of
    DistillSparse and the update, the new policy published to the engine, the after-update
    hooks, metrics. A feature adds its stage, hook or phase."""
    hooks = {p: [h for h in self.hooks if h.point == p]
             for p in ("before_update", "after_update")}
    learner_stages = stages_lib.learner_stages(self.cfg)
    first = [s for s in learner_stages if s[0] in ("batch", "recompute", "advantages")]
    *rest, update = [s for s in learner_stages if s not in first]
    assert update[0] == "update", learner_stages  # the learner's stages end with the update
    snapshot = []
    if self.cfg.max_staleness and (self.cfg.exact_alpha_every or self.ladder is not None):
      # older actors, by version (the alpha split; the ladder's total)
      snapshot = [("policy_snapshot", lambda rec: remember_policy(self))]
    overlap_start, overlap_stop = (), ()
    if self.overlap is not None:  # the engine decodes on its devices while the learner trains
      overlap_start = (("overlap_start", lambda rec: self.overlap.start()),)
      overlap_stop = (("overlap_stop", lambda rec: rec.out.update(self.overlap.stop())),)
    return (("generate", self._generate), *overlap_start,
            *[(n, self._stage(fn)) for n, fn in first],
            *[(h.name, self._hook(h)) for h in hooks["before_update"]],
            *[(n, self._stage(fn)) for n, fn in rest], *snapshot,
            ("update", self._stage(update[1])), *overlap_stop,
            ("publish", self._publish_update),
            *[(h.name, self._hook(h)) for h in hooks["after_update"]],
            ("metrics", self._metrics))

  def _generate(self, rec: StepRecord) -> None:
    rec.batch = self.producer.produce(rec.step, version=self.state.policy_version,
                                      schedule=self.schedule, lora=self._actor_lora())
    self.rollout.release()  # the learner gets the KV pool's memory back
    rec.times["rollout"], rec.times["reward"] = rec.batch.info.rollout_s, rec.batch.info.reward_s
    rec.out.update(self.producer.metrics)  # async/* (asynchronous training)

  def _stage(self, fn) -> Callable[[StepRecord], None]:
    def run(rec: StepRecord) -> None:
      self.state = fn(self.learner, self.state, rec)
    return run

  def _publish_update(self, rec: StepRecord) -> None:
    """The updated policy goes to the engine for the next rollout, as a new version. With
    `rollout_devices` it is copied to the engine's own devices: waited for and timed (unless
    the session drains first, `partial_rollouts=false`: then it loads, timed by the session,
    once the running sequences finish)."""
    self.state.policy_version += 1
    t0 = time.perf_counter()
    self._publish()
    if self.cfg.rollout_devices and self.engine.version == self.state.policy_version:
      ro = self.rollout
      if ro.session is None and ro.lora is not None:  # (else placed at the next rollout)
        ro.lora = self.engine._replicate(ro.lora)
      jax.block_until_ready((self.engine.state,
                             ro.lora if ro.session is None else ro.session.run.lora))
      rec.out["async/weight_sync_s"] = time.perf_counter() - t0

  def _hook(self, hook) -> Callable[[StepRecord], None]:
    def run(rec: StepRecord) -> None:
      if hook.due(rec.step):
        rec.out.update(hook.fn(self, rec))
    return run

  def _metrics(self, rec: StepRecord) -> None:
    rec.out = step_metrics(self, rec)

  def run_step(self, wrap: Callable | None = None) -> StepRecord:
    """One RL step over a fresh step record; `wrap(name, fn)` may wrap every phase (a
    profiler). Wall time per phase goes to `rec.times` (`time/<phase>_s` in the metrics)."""
    rec = StepRecord(step=self.state.step + 1)
    c0 = compile_clock.seconds()
    t0 = time.perf_counter()
    try:
      for name, fn in self.pipeline():
        fn = wrap(name, fn) if wrap is not None else fn
        t1 = time.perf_counter()
        fn(rec)
        rec.times.setdefault(name, time.perf_counter() - t1)
    finally:
      if self.overlap is not None:  # (a stage failed or was interrupted: the engine stops too)
        self.overlap.stop()
    rec.out["time/step_s"] = time.perf_counter() - t0
    # Part of the phase times above that was compilation (lowering + XLA), in any phase.
    rec.out["time/compile_s"] = compile_clock.seconds() - c0
    self.state.step = rec.step
    self.last_rollout = (rec.batch.examples, rec.batch.completions, rec.batch.rewards)
    return rec

  def train_step(self) -> dict[str, Any]:
    """One RL step; returns its metrics."""
    rec = self.run_step()
    self.state.bad_steps = 0 if rec.all_finite else self.state.bad_steps + 1
    return rec.out

  # --- supervised warm start -------------------------------------------------------------
  def warmstart(self, logger: MetricsLogger | None = None) -> dict[str, float]:
    """Cross-entropy on prompt -> solution pairs, so a random-init policy earns rewards."""
    cfg = self.cfg
    if cfg.warmstart_steps <= 0:
      return {}
    eos = self.model_cfg.eos_token_ids[0] if self.model_cfg.eos_token_ids else None
    pairs = warmstart_lib.warmstart_pairs(cfg, self.tokenizer, self.examples, eos)
    self.params, losses = warmstart_lib.warmstart(
        cfg, self.params, self.graphdef, self.mesh, self.learner.param_shardings, pairs,
        self._init_opt)
    self._publish()
    if self.ref_params is not None:  # the KL reference is the policy RL starts from
      self.ref_params = jax.tree.map(jnp.copy, self.params)
    if logger is not None:
      logger.event(f"warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"warmstart/loss_first": losses[0], "warmstart/loss_last": losses[-1],
            "warmstart/steps": len(losses)}

  # --- checkpoints -----------------------------------------------------------------------
  def _state(self) -> dict[str, Any]:
    """The arrays a checkpoint saves (the layout runs have always written)."""
    st = self.state.checkpoint_arrays()
    if self.arrol is not None:  # head and its Adam state (step and calibrator: metadata)
      st["arrol"] = {"params": self.arrol.params, "opt_state": self.arrol.opt_state}
    return st

  def _metadata(self) -> dict[str, Any]:
    if self.dataset is not None:
      self.state.data = self.dataset.state_dict()
    return {**self.state.checkpoint_metadata(),
            "config": self.cfg.to_dict(), "schedule": self.schedule.to_dict(),
            "ladder": None if self.ladder is None else self.ladder.state_dict(),
            "async": self.producer.state_dict(),
            "arrol": (None if self.arrol is None else
                      {"step": self.arrol.step,
                       "calibrator": self.arrol.calibrator.state_dict()})}

  def save_checkpoint(self, force: bool = False) -> bool:
    return self.checkpointer.save(self.step, self._state(), self._metadata(), force=force)

  def resume(self, report: Callable[[str], None] | None = None) -> int:
    """Restore the newest intact checkpoint in `out_dir` (damaged newer steps are reported
    and moved to `checkpoints.damaged/`); returns its step."""
    if self.checkpointer.latest_step() is None:
      raise FileNotFoundError(f"--resume: no checkpoint in {self.checkpointer.directory}")
    report = report or (lambda m: print(m, file=sys.stderr, flush=True))
    # The live state is the template: the checkpointer restores into its shapes and shardings.
    step, arrays, meta, damaged = self.checkpointer.restore_latest_intact(self._state(),
                                                                           report=report)
    for d in damaged:  # the resumed run writes these step numbers again
      report(f"moved damaged checkpoint step {d.step} to {self.checkpointer.set_aside(d.step)}")
    self.state = self.state.restored(arrays, meta)
    if self.arrol is not None and "arrol" in arrays:
      am = meta["arrol"]
      self.arrol.load_state_dict({
          "step": am["step"], "params": arrays["arrol"]["params"],
          "opt_state": arrays["arrol"]["opt_state"],
          "calibrator": {k: np.asarray(v, np.int64) for k, v in am["calibrator"].items()
                         if k.endswith("_counts")}})
    self.resumed_step = self.step
    self.dataset.load_state_dict(meta["data"])
    self.producer.load_state_dict(meta.get("async"))  # outstanding groups, regenerated
    self._load_ladder_state(meta.get("ladder"))
    self._publish()
    return self.step

  def _load_ladder_state(self, state) -> None:
    if self.ladder is not None and state is not None:
      self.ladder.load_state_dict(state)
      if self.ladder.current != self.schedule:
        self.switch_schedule(self.ladder.current)

  def restore_weights(self, *, lora: bool = True,
                      report: Callable[[str], None] | None = None) -> int:
    """Load only the policy (and, if `lora` and this trainer has one, the sparse actor's
    LoRA) from the newest intact checkpoint; optimizer and data position are not read, so
    any data set or batch size may follow. Returns the step."""
    if self.checkpointer.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {self.checkpointer.directory}")
    abstract = {"params": self.params}
    if lora and self.lora is not None:
      abstract["lora"] = self.lora
    if self.arrol is not None:  # the quality head (test-time voting weights)
      abstract["arrol"] = {"params": self.arrol.params}
    step, arrays, meta, _ = self.checkpointer.restore_latest_intact(
        abstract, partial=True, report=report or (lambda m: print(m, file=sys.stderr)))
    self.params = arrays["params"]
    if "lora" in arrays:
      self.lora = arrays["lora"]
    if "arrol" in arrays:
      self.arrol.params = {k: jnp.asarray(v) for k, v in arrays["arrol"]["params"].items()}
    self._load_ladder_state(meta.get("ladder"))  # the sparse actor's schedule at that step
    self.step = step
    self.state.policy_version = step
    self._publish()
    return step

  def export_hf(self, out_dir: str | None = None, dtype: str | None = None) -> str:
    """Write the dense policy as an HF safetensors directory with its tokenizer (and chat
    template) beside it: transformers and `load_tokenizer` read it. `dtype` (default the
    config's `export_dtype`, else `param_dtype`) is the stored weight dtype."""
    out_dir = out_dir or os.path.join(self.cfg.out_dir, "hf")
    params = distributed.fetch(self.params)  # (FSDP shards of every host: a collective)
    if distributed.is_writer():  # one writer
      save_pretrained(nnx.merge(self.graphdef, params), out_dir, overwrite=True,
                      tokenizer=self.tokenizer, dtype=dtype or self.cfg.export_dtype)
    return out_dir

  # --- the loop --------------------------------------------------------------------------
  def fit(self) -> dict[str, Any]:
    """Warm start (at step 0), then RL steps up to `num_steps` (`run/loop.py`). The verifier
    processes are stopped when it returns or raises."""
    try:
      return loop.fit(self)
    finally:
      self.close()

  def close(self) -> None:
    """Stops the verifier processes (also at exit; a later `score` starts new ones)."""
    self.producer.close()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
