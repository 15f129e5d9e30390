"""GRPO trainer with sparse rollouts (the data path of DESIGN.md, one RL step at a time).

    prompts -> rollout (sparse actor: policy + LoRA, schedule-driven block-sparse decode)
            -> rewards -> dense recompute (policy only, teacher-forced, full attention)
            -> mismatch monitor -> GRPO update (policy only) -> DistillSparse (LoRA only)
            -> metrics / checkpoint

Jitted steps take pure pytrees: `params` (the dense policy, an `nnx.State`), the optimizer
state, and for DistillSparse a separate `lora` tree with its own optimizer. The recompute and
the GRPO update never receive `lora`, so the policy update cannot depend on it.

Conventions that keep the pieces consistent:
  temperature T   every training-side log-prob (recompute, update, KL reference, DistillSparse,
                  ladder probe, the monitor's dense top-k) is of softmax(logits / T), the
                  distribution the rollout sampled from (verl does the same). top_p < 1 only
                  shapes sampling: the ratios compare full tempered distributions, while the
                  engine's sampled-token log-probs are renormalised over the nucleus.
  masks           the response mask drives the monitor, DistillSparse and the ladder probe
                  (none depends on rewards); the dynamic-sampling mask (zero-variance groups
                  out) drives only the GRPO loss.
  reference       the KL reference is the policy at the start of RL (after the warm start);
                  it is checkpointed with the run.
  rewards         one process pool scores the whole run (`RewardScorer`); a verifier that
                  runs past `reward_timeout_s` is killed, counted and scores 0.
  several hosts   each process rolls out its share of the prompt groups on its own devices
                  (`generate_shared`); the gathered completions make the same step batch on
                  every process, so rewards, advantages and host arrays are computed
                  identically everywhere; training arrays are global arrays filled from it,
                  results are read back with collectives (`distributed.fetch`). Process 0
                  writes logs and exports; every process takes part in checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.models.config import ModelConfig
from sparrow_jax.rl import data as data_lib
from sparrow_jax.rl import grpo, rewards as rewards_lib
from sparrow_jax.run import distributed
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.checkpointing import Checkpointer
from sparrow_jax.models import lora as lora_lib
from sparrow_jax.rl import arrol as arrol_lib
from sparrow_jax.rl import distill as distill_lib
from sparrow_jax.run import fit_hooks
from sparrow_jax.run import microbatch as mb_lib
from sparrow_jax.run import stages
from sparrow_jax.run.programs import build_programs
from sparrow_jax.rl.monitor import MismatchMonitor, MonitorConfig, replay_diff, replay_stats
from sparrow_jax.rl.switching import (ScheduleLadder, _probe_alpha as probe_alpha_program,
                                      alpha_tail, alpha_tails_per_bin, attention_for)
from sparrow_jax.run.config import TrainConfig
from sparrow_jax.run.builders import (  # noqa: F401  (re-exported)
    Preflight, _bucket, _guarded_apply, build_examples, build_model,
    build_schedule, encode_prompt, fit_prompts, make_optimizer, model_config, preflight,
    smollm2_gguf_path)
from sparrow_jax.run.dry_run import plan_for_model
from sparrow_jax.run.memory import device_memory_bytes
from sparrow_jax.rl.logprobs import token_logprobs
from sparrow_jax.run.metrics import MetricsLogger
from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams, request_seed
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.schedule.schedule import (SparsitySchedule, attention_spec,
                                           teacher_forced_budgets, uncalibrated_positions)


_log = logging.getLogger(__name__)

# Engine stats of each rollout logged by the trainer (see `engine.GenerationEngine`).
_ENGINE_METRICS = ("preemptions", "recomputed_tokens", "pool_high_water_frac",
                   "wasted_decode_steps", "idle_slot_steps", "decode_steps",
                   "wasted_prefill_tokens", "prefill_padding_frac")


class TrainingStopped(RuntimeError):
  """The run stopped on purpose (e.g. too many non-finite steps in a row)."""


class TrainingInterrupted(RuntimeError):
  """SIGINT/SIGTERM: the step in flight finished and a checkpoint of it was saved."""

  def __init__(self, step: int, signame: str, out_dir: str):
    self.step, self.signame, self.out_dir = step, signame, out_dir
    super().__init__(f"{signame}: stopped after step {step}; checkpoint saved in "
                     f"{os.path.join(out_dir, 'checkpoints')}")


# --- building blocks -----------------------------------------------------------------------

def enable_compile_cache(path: str) -> str:
  """Turn on JAX's persistent compilation cache in `path` (created) for every program that
  takes >= 1 s to compile; returns the absolute path. Works as long as nothing has compiled
  with a cache directory set before (JAX initialises its cache once, at the first compile
  that has one)."""
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


class Trainer:
  def __init__(self, cfg: TrainConfig, *, quiet: bool = False, with_dataset: bool = True,
               checked: Preflight | None = None):
    """`with_dataset=False` builds the policy without the training prompts (evaluation,
    export): `examples` is empty and `dataset` None. `checked`: a `preflight(cfg)` result
    the caller already has."""
    self.cfg = cfg
    self.quiet = quiet
    # Everything cheap is checked before the (slow) model load.
    checked = checked or preflight(cfg, with_dataset=with_dataset)
    if cfg.compile_cache_dir:
      enable_compile_cache(cfg.compile_cache_dir)
    # A multi-host job is joined by the program's entry point, before jax starts
    # (`distributed.initialize`); a job described but not joined is an error here.
    distributed.require_initialized()
    mesh_cfg = sh.parse_mesh(cfg.mesh)
    n_mesh = int(np.prod(mesh_cfg.shape)) if mesh_cfg.is_resolved else jax.device_count()
    if n_mesh > jax.device_count():
      raise ValueError(f"mesh={cfg.mesh!r} needs {n_mesh} devices; {jax.device_count()} "
                       "available")
    if distributed.is_multi():
      if n_mesh != jax.device_count():
        raise ValueError(f"mesh={cfg.mesh!r} has {n_mesh} devices; a run over "
                         f"{jax.process_count()} processes needs all {jax.device_count()} "
                         "of theirs (e.g. mesh=data=-1)")
      if cfg.arrol:
        raise ValueError(f"arrol=true with {jax.process_count()} processes: ARRoL's head "
                         "and calibrator are trained on one process's rollouts; expected "
                         "arrol=false in a multi-process run (not supported yet)")
    self.mesh = sh.make_mesh(mesh_cfg, devices=jax.devices()[:n_mesh])
    if with_dataset:  # a run that cannot fit this machine is refused before the model loads
      self._check_memory(plan_for_model(cfg, model_config(cfg),
                                        n_mesh, **self._plan_device()))
    model, self.tokenizer = build_model(cfg)
    self.model_cfg: ModelConfig = model.cfg
    self.schedule = checked.schedule
    self.attention = self._attention_spec(self.schedule)
    self.graphdef, params = nnx.split(model)
    self.param_shardings = sh.param_shardings(params, self.mesh)
    self.params = sh.shard_tree(params, self.param_shardings)
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if cfg.kl_coef > 0 else None)
    max_len = cfg.max_prompt_len + cfg.max_new_tokens
    # The KV pool per device is what the memory plan leaves for the rollout phase (the dry run
    # prints the same plan), capped at every slot full; sequences grow into it and are
    # preempted when it runs out.
    self.memory_plan = plan_for_model(cfg, self.model_cfg, n_mesh, **self._plan_device())
    if with_dataset:
      self._check_memory(self.memory_plan)
    elif not self.memory_plan.pool_fits:
      raise ValueError(self.memory_plan.message())
    self.engine = GenerationEngine(
        model, EngineConfig(num_slots=cfg.num_slots, max_seq_len=max_len,
                            page_size=cfg.page_size, decode_chunk=cfg.decode_chunk,
                            max_prefill_tokens=cfg.max_prefill_tokens,
                            logprobs_topk=cfg.monitor_topk,
                            kv_cache_bytes=self.memory_plan.kv_cache_bytes,
                            cpu_decode_weights=cfg.cpu_decode_weights or None,
                            cache_dtype=cfg.kv_cache_dtype or None),
        attention=self.attention, schedule=None if self.schedule.is_dense else self.schedule,
        mesh=self._rollout_mesh())
    self.tx, self.lr_schedule = make_optimizer(cfg)
    self.opt_state, self.opt_shardings = self._init_opt(self.tx, self.params)
    # Micro-batches are split over the batch axes (data x fsdp): rows come in multiples.
    self.batch_divisor = sh.batch_divisor(self.mesh)
    self.update_rows = cfg.micro_batch
    self.logprob_rows = cfg.logprob_micro_batch_size or cfg.micro_batch
    for key, rows in (("micro_batch_size", self.update_rows),
                      ("logprob_micro_batch_size", self.logprob_rows)):
      if not (cfg.max_tokens_per_micro_batch or cfg.logprob_max_tokens_per_micro_batch) \
          and rows % self.batch_divisor:
        raise ValueError(f"{key}={rows}: micro-batches are split over data x fsdp = "
                         f"{self.batch_divisor} devices (mesh={cfg.mesh!r}); expected a "
                         "multiple of it")
    examples = checked.examples
    self.examples = fit_prompts(self.tokenizer, examples, cfg, "data")
    self.num_dropped_prompts = len(examples) - len(self.examples)
    self.val_examples = fit_prompts(self.tokenizer, checked.val_examples, cfg, "val_data")
    if cfg.val_max_prompts:
      self.val_examples = self.val_examples[:cfg.val_max_prompts]
    if cfg.val_data and with_dataset and not self.val_examples:
      raise ValueError(f"val_data={cfg.val_data!r}: no prompt fits max_prompt_len="
                       f"{cfg.max_prompt_len}")
    self.dataset = None
    if with_dataset:
      if len(self.examples) < cfg.prompts_per_step:
        raise ValueError(f"only {len(self.examples)} prompts fit max_prompt_len="
                         f"{cfg.max_prompt_len}; need at least prompts_per_step="
                         f"{cfg.prompts_per_step}")
      self.dataset = data_lib.PromptDataset(self.examples, batch_size=cfg.prompts_per_step,
                                            seed=cfg.seed)
    self.reward_fn: Callable = checked.reward_fn
    self._scorer: rewards_lib.RewardScorer | None = None  # started on first use
    # The engine samples greedily at temperature 0 and then reports untempered log-probs.
    self.temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    if (cfg.top_p < 1 or cfg.top_k) and (cfg.tis_cap is not None
                                         or cfg.tis_mask_threshold is not None):
      _log.warning("top_p=%s / top_k=%s with TIS: the rollout log-probs are renormalised over "
                   "the kept set, the dense ones are not, so the TIS ratio is biased low by "
                   "the kept mass (see README, Configuration)", cfg.top_p, cfg.top_k)
    self.warmstart_done = False
    self.resumed_step: int | None = None
    self.last_rollout = None  # (example of each completion, completions, rewards), last step
    self.rollout_stats: dict[str, float] = {}  # engine counters of the last rollout
    self.step = 0
    self.bad_steps = 0
    self.compilations = 0
    self.monitor = MismatchMonitor(MonitorConfig(tau=cfg.tau, bin_size=cfg.mismatch_bin_size,
                                                 min_count=8))
    self.ladder = None
    if checked.ladder:
      self.ladder = ScheduleLadder([self.schedule, *checked.ladder], tau=cfg.tau,
                                   patience=cfg.ladder_patience,
                                   probe_every=cfg.probe_every)
    if with_dataset:  # a table used past the positions its calibration measured
      for sched in (self.ladder.schedules if self.ladder else [self.schedule]):
        msg = uncalibrated_positions(sched, max_len)
        if msg:
          _log.warning(msg)
    self.lora = self.lora_opt_state = None
    self._distill_step = None
    if cfg.distill:
      lcfg = lora_lib.LoRAConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                 targets=cfg.lora_targets)
      lora = lora_lib.init_lora(self.model_cfg, lcfg, jax.random.PRNGKey(cfg.seed + 7))
      lora_shardings = sh.param_shardings(lora, self.mesh)
      self.lora = sh.shard_tree(lora, lora_shardings)
      lr = (optax.linear_schedule(cfg.distill_lr / cfg.distill_warmup_steps, cfg.distill_lr,
                                  cfg.distill_warmup_steps)
            if cfg.distill_warmup_steps else cfg.distill_lr)
      self.lora_tx = distill_lib.default_optimizer(lr)
      self.lora_opt_state, _ = self._init_opt(self.lora_tx, self.lora)
    # Without a dataset this trainer only reads a run (which may still be training).
    self.checkpointer = Checkpointer(os.path.join(os.path.abspath(cfg.out_dir), "checkpoints"),
                                     keep_last=cfg.keep_last,
                                     save_every=cfg.save_every or max(cfg.num_steps, 1),
                                     read_only=not with_dataset)
    # ARRoL: the quality head, its optimizer and calibrator; the engine prunes with it.
    self.arrol = self._arrol_hook = None
    if cfg.arrol:
      self.arrol = arrol_lib.ArrolPruner(cfg.arrol_config(), self.model_cfg.hidden_size,
                                         seed=cfg.seed + 11)
      self.arrol_stop_ids = arrol_lib.stop_token_ids(self.tokenizer)
    self._build_programs()

  def _init_opt(self, tx, params):
    """(`tx.init(params)`, its shardings) placed explicitly: moments like their parameters,
    counters replicated on the mesh. (Left to jit, a counter comes out on one device,
    uncommitted; restored from a checkpoint it is committed there, which a multi-process
    program over the global mesh refuses.)"""
    shardings = sh.opt_state_shardings(jax.eval_shape(tx.init, params),
                                       jax.tree.map(lambda x: x.sharding, params), self.mesh,
                                       params)
    return jax.jit(tx.init, out_shardings=shardings)(params), shardings

  def _rollout_mesh(self) -> jax.sharding.Mesh:
    """The engine's devices: this process's part of the mesh (each process rolls out its
    share of the prompts on its own devices; `rollout` gathers the completions)."""
    mine = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.sharding.Mesh(np.asarray(mine), ("rollout",))

  def _plan_device(self) -> dict:
    """The memory the plan is checked against: this machine's (an accelerator's limit, or the
    host RAM available on CPU, where XLA holds bf16 activations in float32);
    `device_memory_gb` only where the device reports none."""
    dev = self.mesh.devices.flat[0]
    nbytes, where = device_memory_bytes(dev, fallback=self.cfg.device_memory_gb * 1e9)
    self._memory_source = where
    return {"device_bytes": nbytes,
            "activation_dtype": "float32" if dev.platform == "cpu" else None}

  def _check_memory(self, plan) -> None:
    if not plan.fits:
      raise ValueError(f"{plan.message()} [per device: {self._memory_source}; plan: "
                       "python experiments/train.py --dry-run with the same arguments]")

  # --- jitted programs and the micro-batch driver ----------------------------------------
  def _build_programs(self):
    cfg = self.cfg
    self.loss_cfg = grpo.GRPOLossConfig(
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
        agg=cfg.loss_agg, norm_len=cfg.max_new_tokens if cfg.loss_agg.endswith("norm") else None,
        kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, entropy_coeff=cfg.entropy_coeff,
        tis_cap=cfg.tis_cap, tis_mask_threshold=cfg.tis_mask_threshold)
    dcfg = None
    if cfg.distill:
      dcfg = distill_lib.DistillConfig(kind=cfg.distill_kind, coef=cfg.distill_coef,
                                       pg_coef=cfg.distill_pg_coef,
                                       tis_cap=cfg.distill_pg_clip,
                                       temperature=self.temperature,
                                       logprob_chunk=cfg.logprob_chunk,
                                       min_gap=cfg.distill_min_gap)
    self.distill_cfg = dcfg
    count = self.programs.count if getattr(self, "programs", None) is not None else None
    self.programs = build_programs(
        self.graphdef, cfg, loss_cfg=self.loss_cfg, tx=self.tx, temperature=self.temperature,
        skip_recompute=cfg.skips_recompute, attention=self.attention,
        lora_tx=getattr(self, "lora_tx", None), dcfg=dcfg,
        apply_shardings=(self.param_shardings, self.opt_shardings,
                         sh.replicated(self.mesh), sh.replicated(self.mesh)),
        mesh=self.mesh, batch_axes=sh.BATCH_AXES)
    if count is not None:  # a schedule switch rebuilds the programs: keep counting
      self.programs.count = count

  def _place(self, inputs: dict) -> dict:
    return sh.shard_batch(inputs, self.mesh)

  def logprob_plan(self, lengths) -> list[mb_lib.MicroBatch]:
    """Micro-batches of the no-grad phases (recompute, reference, probe, validation)."""
    cfg = self.cfg
    tokens = cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch
    if tokens:
      return mb_lib.plan(lengths, divisor=self.batch_divisor, max_tokens=tokens,
                         **self._bucketing)
    return mb_lib.plan(lengths, divisor=self.batch_divisor, max_rows=self.logprob_rows,
                       **self._bucketing)

  def update_plan(self, lengths) -> list[mb_lib.MicroBatch]:
    """Micro-batches of one mini-batch of the GRPO update (and of DistillSparse)."""
    cfg = self.cfg
    if cfg.max_tokens_per_micro_batch:
      return mb_lib.plan(lengths, divisor=self.batch_divisor,
                         max_tokens=cfg.max_tokens_per_micro_batch, **self._bucketing)
    return mb_lib.plan(lengths, divisor=self.batch_divisor, max_rows=self.update_rows,
                       **self._bucketing)

  @property
  def _bucketing(self) -> dict[str, int]:
    cfg = self.cfg
    return {"per_octave": cfg.length_buckets_per_octave,
            "max_length": cfg.max_prompt_len + cfg.max_new_tokens}

  def run_micro(self, fn, arrays, plan, *, keys=None, prepare=None) -> dict[str, np.ndarray]:
    """`fn` over every micro-batch of `plan`, inputs placed sharded over the batch axes;
    results as full host arrays (`microbatch.run`)."""
    return mb_lib.run(fn, arrays, plan, place=self._place, keys=keys, prepare=prepare,
                      fetch=distributed.fetch)

  def engine_release(self) -> None:
    """Free the engine's KV pool while the trainer runs (`release_kv_cache`; the next
    rollout rebuilds it at the same size)."""
    if self.cfg.release_kv_cache:
      self.engine.release_kv_pool()

  def _attention_spec(self, schedule: SparsitySchedule):
    """The attention a schedule implies, with this run's backend, landmark dtype and page
    scorer."""
    return attention_spec(schedule, backend=self.cfg.attention_backend,
                          landmark_dtype=self.cfg.landmark_dtype,
                          page_scorer=self.cfg.page_scorer)

  def _switch_schedule(self, schedule: SparsitySchedule) -> None:
    self.schedule = schedule
    self.attention = self._attention_spec(schedule)
    self.engine.set_attention(self.attention, None if schedule.is_dense else schedule)
    if self.cfg.distill:
      self._build_programs()

  # --- supervised warm start -------------------------------------------------------------
  def warmstart(self, logger: MetricsLogger | None = None) -> dict[str, float]:
    """Cross-entropy on prompt -> solution pairs, so a random-init policy earns rewards."""
    cfg = self.cfg
    if cfg.warmstart_steps <= 0:
      return {}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.warmstart_lr))
    opt, opt_shardings = self._init_opt(tx, self.params)
    graphdef = self.graphdef
    seqs = []
    for e in self.examples:
      p = encode_prompt(self.tokenizer, e, cfg.chat_template)
      sol = e.metadata.get("solution", e.answer)
      r = self._encode_response(sol)
      seqs.append((p, r))
    t = _bucket(max(len(p) + len(r) for p, r in seqs))

    def sft(params, opt_state, tokens, lengths, mask):
      def loss_fn(p):
        lp = token_logprobs(nnx.merge(graphdef, p), tokens, lengths=lengths,
                            chunk=cfg.logprob_chunk).logp
        return -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      params, opt_state, _, _ = _guarded_apply(tx, params, opt_state, grads, loss)
      return params, opt_state, loss

    # (the policy keeps its layout: the RL programs compile once for it)
    sft = jax.jit(sft, donate_argnums=(0, 1), out_shardings=(
        self.param_shardings, opt_shardings, sh.replicated(self.mesh)))
    rng = np.random.default_rng(cfg.seed + 1)
    losses = []
    for _ in range(cfg.warmstart_steps):
      idx = rng.integers(0, len(seqs), cfg.warmstart_batch)
      tokens = np.zeros((len(idx), t), np.int32)
      mask = np.zeros((len(idx), t), np.float32)
      lengths = np.zeros((len(idx),), np.int32)
      for j, i in enumerate(idx):
        p, r = seqs[i]
        tokens[j, :len(p)] = p
        tokens[j, len(p):len(p) + len(r)] = r
        mask[j, len(p):len(p) + len(r)] = 1
        lengths[j] = len(p) + len(r)
      self.params, opt, loss = sft(self.params, opt, jnp.asarray(tokens), jnp.asarray(lengths),
                                   jnp.asarray(mask))
      losses.append(float(loss))
    self.engine.set_state(self.params)
    if self.ref_params is not None:  # the KL reference is the policy RL starts from
      self.ref_params = jax.tree.map(jnp.copy, self.params)
    out = {"warmstart/loss_first": losses[0], "warmstart/loss_last": losses[-1],
           "warmstart/steps": len(losses)}
    if logger is not None:
      logger.event(f"warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return out

  def _encode_response(self, text: str) -> list[int]:
    eos = self.model_cfg.eos_token_ids[0] if self.model_cfg.eos_token_ids else None
    if isinstance(self.tokenizer, ByteTokenizer):
      ids = self.tokenizer.encode(text, add_bos=False)
    else:
      ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + ([eos] if eos is not None else [])

  # --- one RL step -----------------------------------------------------------------------
  def rollout(self, examples, step: int, round_: int = 0):
    """G samples of every prompt; `round_` > 0 are dynamic-sampling refills (other seeds)."""
    cfg = self.cfg
    reqs = []
    for i, e in enumerate(examples):
      ids = encode_prompt(self.tokenizer, e, cfg.chat_template)
      for g in range(cfg.group_size):
        seed = request_seed(cfg.seed, step, round_, i, g)
        reqs.append(Request(ids, SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                                top_k=cfg.top_k,
                                                max_new_tokens=cfg.max_new_tokens, seed=seed),
                            (i, g), group=(round_, i)))
    lora = self.lora if self.cfg.distill else None
    self._arrol_hook = None
    if self.arrol is not None:
      self._arrol_hook = arrol_lib.ArrolHook(self.arrol, self.arrol_stop_ids, seed=cfg.seed,
                                             step=step)
    return self.generate_shared(reqs, lora=lora, prune=self._arrol_hook)

  def generate_shared(self, reqs, **kw):
    """`engine.generate` of `reqs` over every process: each generates the requests of its
    `distributed.prompt_range` of the prompts on its own devices, then the completions are
    gathered so every process returns all of them in request order (one process: the
    engine's result). `self.rollout_stats` holds the engine counters of the call, summed
    over processes."""
    if not distributed.is_multi():
      out = self.engine.generate(reqs, **kw)
      self.rollout_stats = dict(self.engine.last_stats)
      return out
    from sparrow_jax.engine.config import Completion
    mine = distributed.local_request_index(reqs)
    local = self.engine.generate([reqs[j] for j in mine], **kw) if len(mine) else []
    stats = self.engine.last_stats if len(mine) else {}
    self.rollout_stats = distributed.merge_stats(stats, _ENGINE_METRICS)
    return distributed.gather_completions(local, mine, reqs, topk=self.cfg.monitor_topk,
                                          make=Completion)

  @property
  def scorer(self) -> rewards_lib.RewardScorer:
    """The run's verifier pool: processes started on first use, reused until `close()`."""
    if self._scorer is None:
      # By name: a custom verifier's spec goes to the workers, each of which loads it itself.
      self._scorer = rewards_lib.RewardScorer(
          self.cfg.reward, timeout_s=self.cfg.reward_timeout_s,
          num_workers=self.cfg.reward_workers, backend="process")
    return self._scorer

  def close(self) -> None:
    """Stops the verifier processes (also at exit; a later `score` starts new ones)."""
    if self._scorer is not None:
      self._scorer.close()
      self._scorer = None

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score(self, examples, completions):
    cfg = self.cfg
    texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    answers = [examples[c.request_id[0]].answer for c in completions]
    res = self.scorer(texts, answers)
    r = np.asarray(res.rewards, np.float32)
    if cfg.overlong_buffer:
      r = r + rewards_lib.overlong_penalty([len(c.token_ids) for c in completions],
                                           max_len=cfg.max_new_tokens,
                                           buffer_len=cfg.overlong_buffer)
    return r, res

  def make_batch(self, completions):
    """Pad prompt+response into `[B, T]` host arrays (T = the longest row); response tokens
    carry the mask. The micro-batch driver cuts each micro-batch to its own length bucket."""
    k = self.cfg.monitor_topk
    lens = [len(c.prompt_ids) + len(c.token_ids) for c in completions]
    b, t = len(lens), max(lens)
    tokens = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.float32)
    rollout_logp = np.zeros((b, t), np.float32)
    r_ids = np.zeros((b, t, k), np.int32)
    r_lp = np.full((b, t, k), -1e9, np.float32)
    prompt_lens = np.ones((b,), np.int32)
    for j, c in enumerate(completions):
      p, n = len(c.prompt_ids), len(c.token_ids)
      if n > self.cfg.max_new_tokens:  # the programs' LM-head window would miss tokens
        raise ValueError(f"completion {c.request_id}: {n} response tokens > max_new_tokens="
                         f"{self.cfg.max_new_tokens}")
      tokens[j, :p] = c.prompt_ids
      tokens[j, p:p + n] = c.token_ids
      mask[j, p:p + n] = 1
      rollout_logp[j, p:p + n] = c.logprobs
      if c.topk_ids is not None:
        r_ids[j, p:p + n] = c.topk_ids
        r_lp[j, p:p + n] = c.topk_logprobs
      prompt_lens[j] = p
    return dict(tokens=tokens, lengths=np.asarray(lens, np.int32), mask=mask,
                rollout_logp=rollout_logp, rollout_topk_ids=r_ids, rollout_topk_logp=r_lp,
                prompt_lens=prompt_lens)

  def generate_groups(self, step: int) -> tuple[list, np.ndarray, dict[str, Any]]:
    """Rollouts and rewards of one step -> (completions, rewards [B], info).

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
    engine_stats = {k: 0 for k in _ENGINE_METRICS}
    t_roll = t_score = 0.0
    while True:
      examples = self.dataset.next_batch()
      t0 = time.perf_counter()
      new = self.rollout(examples, step, len(results))
      if self.arrol is not None:  # pruned rollouts have no answer to score: they leave here
        pruned_comps += [c for c in new if c.pruned]
        new = [c for c in new if not c.pruned]
      t1 = time.perf_counter()
      comp_examples += [examples[c.request_id[0]] for c in new]
      for k in _ENGINE_METRICS:  # summed over refill rounds (the high-water mark: max)
        v = self.rollout_stats[k]
        engine_stats[k] = max(engine_stats[k], v) if k.endswith("_frac") else engine_stats[k] + v
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
    info = {"completions": comps, "rewards": rewards, "rounds": len(results),
            "rollout_s": t_roll, "reward_s": t_score, "engine": engine_stats,
            "pruned": pruned_comps, "examples": [comp_examples[i] for i in index],
            "num_errors": sum(x.num_errors for x in results),
            "num_timeouts": sum(x.num_timeouts for x in results)}
    return [comps[i] for i in index], rewards[index], info

  def train_step(self) -> dict[str, Any]:
    """One RL step: the stages of `run/stages.py`; returns its metrics."""
    sb = stages.run_step(self, self.step + 1)
    self.step = sb.step
    self.last_rollout = (sb.gen["examples"], sb.completions, sb.rewards)
    self.bad_steps = 0 if sb.all_finite else self.bad_steps + 1
    return sb.out

  def recompute(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The no-grad recompute of a batch (old log-probs, the monitor's dense top-k, and the
    reference's log-probs when there is one), micro-batched: {"old_logp", "dense_topk_ids",
    "dense_topk_logp"[, "ref_logp"]} host arrays aligned with `arrays["tokens"]`."""
    plan = self.logprob_plan(arrays["lengths"])
    keys = tuple(k for k in ("tokens", "lengths", "prompt_lens") if k in arrays)
    res = self.run_micro(lambda mb: self.programs.logprobs(self.params, mb), arrays, plan,
                         keys=keys)
    out = {"old_logp": res["logp"], "dense_topk_ids": res.get("topk_ids"),
           "dense_topk_logp": res.get("topk_logp")}
    if self.ref_params is not None:
      out["ref_logp"] = self.run_micro(
          lambda mb: self.programs.ref_logprobs(self.ref_params, mb), arrays, plan,
          keys=keys)["logp"]
    return out

  def mini_batch_grads(self, arrays: dict[str, np.ndarray], params=None):
    """(loss, metrics, grads, aux) of one mini-batch (host arrays: tokens, lengths, mask =
    the loss mask, advantages, [old_logp, rollout_logp, ref_logp]) as the sum of its
    micro-batches, each divided by the mini-batch's loss denominators (so the result equals
    the mini-batch in one piece). `aux`: with the recompute skipped, the forward's own old
    log-probs and dense top-k, as full host arrays."""
    params = self.params if params is None else params
    progs = self.programs
    den = grpo.loss_denominators(grpo.loss_mask(
        jnp.asarray(arrays["mask"]), self.loss_cfg,
        old_logp=None if "old_logp" not in arrays else jnp.asarray(arrays["old_logp"]),
        rollout_logp=(None if "rollout_logp" not in arrays
                      else jnp.asarray(arrays["rollout_logp"]))))
    keys = [k for k in ("tokens", "lengths", "prompt_lens", "mask", "advantages", "old_logp",
                        "rollout_logp",
                        "ref_logp") if k in arrays]
    if not self.loss_cfg.uses_rollout_correction:
      keys = [k for k in keys if k != "rollout_logp"]
    if progs.skip_recompute:
      keys = [k for k in keys if k != "old_logp"]
    acc = progs.zeros(params)
    losses, per_micro, n_in, aux = [], [], [], {}
    b, t = np.shape(arrays["tokens"])[:2]
    for micro in self.update_plan(arrays["lengths"]):
      inputs = self._place(mb_lib.gather(arrays, micro, keys))
      acc, loss, m, n, a = progs.grad_step(params, acc, inputs, den)
      losses.append(loss)
      per_micro.append(m)
      n_in.append(n)
      if a:
        mb_lib.scatter(aux, micro, distributed.fetch(a), b, t)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_micro)
    metrics = grpo.combine_micro_metrics(stacked, jnp.stack(n_in))
    return jnp.sum(jnp.stack(losses)), metrics, acc, aux

  def apply_updates(self, arrays: dict[str, np.ndarray]) -> tuple[list[dict], bool]:
    """`ppo_epochs` passes of mini-batch updates over a step batch's host arrays (tokens,
    lengths, loss_mask or mask, advantages, old_logp unless the recompute is skipped,
    rollout_logp, ref_logp). Returns per-update metrics and whether every update was
    finite. With the recompute skipped, the forward's own old log-probs and the monitor's
    dense top-k are written into `arrays`."""
    cfg = self.cfg
    full = dict(arrays)
    if "loss_mask" in full:
      full["mask"] = full["loss_mask"]
    n = full["tokens"].shape[0]
    metrics, all_finite = [], True
    for _ in range(cfg.ppo_epochs):
      for s in range(0, n, cfg.mini_batch):
        rows = slice(s, s + cfg.mini_batch)
        sub = {k: v[rows] for k, v in full.items() if np.ndim(v) >= 1}
        loss, m, grads, aux = self.mini_batch_grads(sub)
        self.params, self.opt_state, ok, gnorm = self.programs.apply(
            self.params, self.opt_state, grads, loss)
        m = distributed.fetch(dict(m, loss=loss, grad_norm=gnorm, finite=ok))
        all_finite &= bool(m["finite"])
        metrics.append(m)
        for k, v in aux.items():  # only with the recompute skipped (one mini-batch)
          arrays[k] = v
    return metrics, all_finite

  def distill_grads(self, arrays: dict[str, np.ndarray], plan):
    """DistillSparse's (loss, metrics, LoRA gradients) on a batch, summed over the
    micro-batches of `plan`, each divided by the batch's token count (= one piece)."""
    cfg, progs = self.cfg, self.programs
    keys = ["tokens", "mask", "old_logp", "prompt_lens", "lengths"]
    if cfg.distill_pg_coef > 0:  # the LoRA's own truncated-IS policy gradient
      keys += ["advantages", "rollout_logp"]
    m = np.asarray(arrays["mask"], np.float32).copy()
    m[:, 0] = 0.0
    den = {"num_tokens": jnp.float32(m.sum())}
    acc = progs.zeros(self.lora)
    losses, per_micro = [], []
    for micro in plan:
      inputs = mb_lib.gather(arrays, micro, keys)
      inputs["budgets"] = np.asarray(teacher_forced_budgets(self.schedule, micro.length,
                                                            micro.rows))
      acc, loss, mm = progs.distill_grad(self.lora, acc, self.params, self._place(inputs), den)
      losses.append(loss)
      per_micro.append(mm)
    metrics = distill_lib.combine_micro_metrics(distributed.fetch(per_micro))
    return jnp.sum(jnp.stack(losses)), metrics, acc

  def distill_update(self, arrays: dict[str, np.ndarray], plan) -> dict[str, float]:
    """DistillSparse: one LoRA-only step on the step batch, micro-batched (`plan`), teacher =
    the old dense log-probs, with the batch's token count as the loss denominator."""
    t0 = time.perf_counter()
    loss, out, grads = self.distill_grads(arrays, plan)
    self.lora, self.lora_opt_state, am = self.programs.distill_apply(
        self.lora, self.lora_opt_state, grads, loss, jnp.float32(out["max_abs_gap"]))
    out.update({k: float(v) for k, v in distributed.fetch(am).items()})
    out = {f"distill/{k}": v for k, v in out.items()}
    out["time/distill_s"] = time.perf_counter() - t0
    return out

  def token_alpha(self, arrays, schedule: SparsitySchedule, lora, plan=None, *,
                  with_logp: bool = False):
    """Exact alpha_t [B, T] between the dense policy and sparse(+`lora`) under `schedule`,
    teacher-forced on a batch's tokens (micro-batched). With `with_logp`, (alpha, logp):
    logp [B, T] the sparse actor's log-prob of each token at the rollout temperature."""
    plan = plan if plan is not None else self.logprob_plan(arrays["lengths"])
    t = int(np.shape(arrays["tokens"])[1])
    attention = attention_for(schedule, t, landmark_dtype=self.cfg.landmark_dtype)

    def prepare(inputs, micro):
      inputs["budgets"] = np.asarray(teacher_forced_budgets(schedule, micro.length,
                                                            micro.rows))
      return inputs

    def fn(mb):
      out = probe_alpha_program(self.graphdef, self.params, lora, mb["tokens"], mb["budgets"],
                                mb["prompt_lens"], mb["lengths"], jnp.float32(self.temperature),
                                attention=attention, chunk=self.cfg.logprob_chunk,
                                with_logp=with_logp)
      return {"alpha": out[0], "logp": out[1]} if with_logp else {"alpha": out}

    res = self.run_micro(fn, arrays, plan, keys=("tokens", "prompt_lens", "lengths"),
                         prepare=prepare)
    if with_logp:
      return np.asarray(res["alpha"]), np.asarray(res["logp"])
    return np.asarray(res["alpha"])

  def tail_alpha(self, arrays, schedule: SparsitySchedule, lora, mask, plan=None,
                 **kw) -> float:
    """Tail (p5) of exact alpha_t between the dense policy and sparse(+`lora`) under
    `schedule` over `mask`'s tokens of a batch (micro-batched; `switching.alpha_tail`)."""
    return alpha_tail(self.token_alpha(arrays, schedule, lora, plan), mask, **kw)

  def exact_alpha(self, arrays) -> tuple[dict[str, float], np.ndarray | None]:
    """`exact_alpha_every`: the exact tail of alpha_t per position bin of the rollout actor
    (the current schedule, with its LoRA) against the dense policy that generated the
    rollouts, teacher-forced on the first `exact_alpha_rows` rollouts of the step (all with
    0), over their response tokens: what the monitor's top-k statistic bounds from below.

    The same forward replays the sparse actor on the tokens it sampled: where sampling was
    unfiltered (top_p = 1, top_k = 0) its log-prob of each sampled token must equal the one the
    engine recorded (`rollout_logp`) up to float rounding, or exact alpha would not be of the
    actor that generated the batch. `mismatch/replay_logp_maxdiff` is the largest difference,
    `mismatch/replay_frac_off` the fraction of tokens off by more than 1e-3 and
    `mismatch/replay_rows_off` the rows holding any (a page selection flipped by rounding on
    near-tied landmark scores changes that token and, through its K/V, later ones).
    Returns (metrics, per-token alpha [rows, T]); ({}, None) for a dense schedule."""
    cfg = self.cfg
    if self.schedule.is_dense:
      return {}, None
    n = int(np.shape(arrays["tokens"])[0])
    rows = n if not cfg.exact_alpha_rows else min(cfg.exact_alpha_rows, n)
    sub = {k: np.asarray(arrays[k])[:rows] for k in ("tokens", "prompt_lens", "lengths", "mask")}
    replay = "rollout_logp" in arrays and cfg.samples_unfiltered
    res = self.token_alpha(sub, self.schedule, self.lora if cfg.distill else None,
                           with_logp=replay)
    alpha, logp = res if replay else (res, None)
    tails = alpha_tails_per_bin(alpha, sub["mask"], bin_size=cfg.mismatch_bin_size)
    out: dict[str, float] = {"mismatch/exact_rows": float(rows)}
    if replay:
      diff = replay_diff(logp, np.asarray(arrays["rollout_logp"])[:rows], sub["mask"])
      out.update(replay_stats(diff, sub["mask"]))
    if tails:
      out["mismatch/exact_p5"] = min(v for v, _ in tails.values())
      out["mismatch/exact_bins_below_tau"] = float(sum(v < cfg.tau for v, _ in tails.values()))
    for k, (v, c) in tails.items():
      out[f"mismatch/exact_p5_bin_{k}"] = v
      out[f"mismatch/exact_count_bin_{k}"] = float(c)
    return out, np.asarray(alpha)

  def arrol_update(self, comps, rewards, pruned, rho_hat) -> dict[str, Any]:
    """Train the quality head on this step's labelled rollouts (label: reward > 0) and report
    ARRoL's metrics (paper Tables 4/5): kept fraction, E[rho_hat], E[rho_hat (1 - rho_hat)]
    over groups, head accuracy and AUC (scores taken before the update: held out).
    `rho_hat`: `arrol.rho_hat_stats` of the kept rollouts (computed once by the step)."""
    if self.arrol is None:
      return {}
    n_kept, n_all = len(comps), len(comps) + len(pruned)
    # A rollout that ended at its first token (sampled by the prefill) never reached a
    # decode step: it has no hidden state to learn from.
    seen = [j for j, c in enumerate(comps) if c.detect_hidden is not None]
    hidden = np.stack([comps[j].detect_hidden for j in seen]).astype(np.float32).reshape(
        len(seen), self.model_cfg.hidden_size)  # [N, D]
    labels = (np.asarray(rewards)[seen] > 0).astype(np.float32)
    head = self.arrol.train(hidden, labels)
    rho_mean, rho_var = rho_hat
    out = {"arrol/kept_frac": n_kept / max(n_all, 1), "arrol/pruned": n_all - n_kept,
           "arrol/rho_hat_mean": rho_mean, "arrol/rho_hat_var": rho_var,
           "arrol/head_acc": head["acc"], "arrol/head_auc": head["auc"],
           "arrol/head_loss": head["loss"], "arrol/warmup": float(self.arrol.warming_up)}
    if self._arrol_hook is not None:
      out.update(self._arrol_hook.metrics())
    self.arrol.end_step()
    return out

  def maybe_switch(self, step: int, arrays, plan=None) -> dict[str, Any]:
    """Probe the next, more aggressive schedule (with the current LoRA) on this step's whole
    rollout batch, over its response tokens (`arrays["mask"]`); switch after
    `ladder_patience` consecutive probes with tail alpha >= tau. Position bins with fewer than
    `probe_min_count` tokens do not count; when none qualifies the probe is skipped
    (`ladder/probe_skipped`)."""
    if self.ladder is None or self.ladder.candidate is None or not self.ladder.should_probe(step):
      return {} if self.ladder is None else dict(self.ladder.metrics())
    cfg = self.cfg
    tail = self.tail_alpha(arrays, self.ladder.candidate, self.lora, arrays["mask"], plan,
                           bin_size=cfg.mismatch_bin_size, min_count=cfg.probe_min_count)
    if not np.isfinite(tail):
      return dict(self.ladder.metrics(), **{"ladder/probe_skipped": 1.0})
    candidate = self.ladder.candidate
    if self.ladder.observe(tail, step=step):
      self._switch_schedule(self.ladder.current)
      print(f"step {step}: switched schedule to {candidate.name} (probe tail alpha "
            f"{tail:.3f} >= tau {cfg.tau} for {cfg.ladder_patience} checks)",
            flush=True)
    return dict(self.ladder.metrics(), **{"ladder/probe_tail_alpha": tail,
                                          "ladder/probe_skipped": 0.0})

  def opt_count(self):
    counts = [x for x in jax.tree.leaves(self.opt_state)
              if hasattr(x, "dtype") and x.dtype == jnp.int32 and x.ndim == 0]
    return counts[0] if counts else jnp.zeros((), jnp.int32)

  # --- checkpoints -----------------------------------------------------------------------
  def _state(self) -> dict[str, Any]:
    st = {"params": self.params, "opt_state": self.opt_state}
    if self.ref_params is not None:
      st["ref_params"] = self.ref_params
    if self.lora is not None:
      st["lora"] = self.lora
      st["lora_opt_state"] = self.lora_opt_state
    if self.arrol is not None:  # head and its Adam state (step and calibrator: metadata)
      st["arrol"] = {"params": self.arrol.params, "opt_state": self.arrol.opt_state}
    return st

  def _metadata(self) -> dict[str, Any]:
    return {"step": self.step, "data": self.dataset.state_dict(), "bad_steps": self.bad_steps,
            "warmstart_done": self.warmstart_done,
            "config": self.cfg.to_dict(), "schedule": self.schedule.to_dict(),
            "ladder": self._ladder_state(),
            "arrol": (None if self.arrol is None else
                      {"step": self.arrol.step,
                       "calibrator": self.arrol.calibrator.state_dict()}),
            # Sampling keys are fold_in(key(seed), position) with seed = request_seed(config
            # seed, step, round, prompt, sample): the step and seed fix every random draw.
            "rng": {"seed": self.cfg.seed, "scheme": "per-request fold_in(seed, position)"}}

  def _ladder_state(self):
    return None if self.ladder is None else self.ladder.state_dict()

  def save_checkpoint(self, force: bool = False) -> bool:
    return self.checkpointer.save(self.step, self._state(), self._metadata(), force=force)

  def resume(self, report: Callable[[str], None] | None = None) -> int:
    """Restore the newest intact checkpoint in `out_dir` (damaged newer steps are reported
    and moved to `checkpoints.damaged/`); returns its step."""
    if self.checkpointer.latest_step() is None:
      raise FileNotFoundError(f"--resume: no checkpoint in {self.checkpointer.directory}")
    report = report or (lambda m: print(m, file=sys.stderr, flush=True))
    # The live state is the template: the checkpointer restores into its shapes and shardings.
    step, state, meta, damaged = self.checkpointer.restore_latest_intact(self._state(),
                                                                          report=report)
    for d in damaged:  # the resumed run writes these step numbers again
      report(f"moved damaged checkpoint step {d.step} to {self.checkpointer.set_aside(d.step)}")
    self.params = state["params"]
    self.opt_state = state["opt_state"]
    self.ref_params = state.get("ref_params", self.ref_params)
    if "lora" in state:
      self.lora, self.lora_opt_state = state["lora"], state["lora_opt_state"]
    if self.arrol is not None and "arrol" in state:
      am = meta["arrol"]
      self.arrol.load_state_dict({
          "step": am["step"], "params": state["arrol"]["params"],
          "opt_state": state["arrol"]["opt_state"],
          "calibrator": {k: np.asarray(v, np.int64) for k, v in am["calibrator"].items()
                         if k.endswith("_counts")}})
    self.step = int(meta["step"])
    self.bad_steps = int(meta.get("bad_steps", 0))
    self.warmstart_done = bool(meta.get("warmstart_done", self.step > 0))
    self.resumed_step = self.step
    self.dataset.load_state_dict(meta["data"])
    self._load_ladder_state(meta.get("ladder"))
    self.engine.set_state(self.params)
    return self.step

  def _load_ladder_state(self, state) -> None:
    if self.ladder is not None and state is not None:
      self.ladder.load_state_dict(state)
      if self.ladder.current != self.schedule:
        self._switch_schedule(self.ladder.current)

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
    step, state, meta, _ = self.checkpointer.restore_latest_intact(
        abstract, partial=True, report=report or (lambda m: print(m, file=sys.stderr)))
    self.params = state["params"]
    if "lora" in state:
      self.lora = state["lora"]
    if "arrol" in state:
      self.arrol.params = {k: jnp.asarray(v) for k, v in state["arrol"]["params"].items()}
    self._load_ladder_state(meta.get("ladder"))  # the sparse actor's schedule at that step
    self.step = step
    self.engine.set_state(self.params)
    return step

  def export_hf(self, out_dir: str | None = None, dtype: str | None = None) -> str:
    """Write the dense policy as an HF safetensors directory with its tokenizer (and chat
    template) beside it: transformers and `load_tokenizer` read it. `dtype` (default the
    config's `export_dtype`, else `param_dtype`) is the stored weight dtype."""
    from sparrow_jax.models import save_pretrained
    out_dir = out_dir or os.path.join(self.cfg.out_dir, "hf")
    params = distributed.fetch(self.params)  # (FSDP shards of every host: a collective)
    if distributed.is_writer():  # one writer
      save_pretrained(nnx.merge(self.graphdef, params), out_dir, overwrite=True,
                      tokenizer=self.tokenizer, dtype=dtype or self.cfg.export_dtype)
    return out_dir

  # --- the loop --------------------------------------------------------------------------
  def fit(self) -> dict[str, Any]:
    """Warm start (at step 0), then RL steps up to `num_steps`. SIGINT/SIGTERM finish the step
    in flight, save a checkpoint and raise TrainingInterrupted (a second signal stops at once,
    without saving). The verifier processes are stopped when it returns or raises."""
    try:
      return self._fit()
    finally:
      self.close()

  def _fit(self) -> dict[str, Any]:
    cfg = self.cfg
    steps = self.checkpointer.all_steps()
    if steps and self.resumed_step is None:
      raise ValueError(f"out_dir={cfg.out_dir!r} already holds checkpoints (steps {steps}); "
                       "call resume() first, or use a new out_dir")
    logger = MetricsLogger(cfg.out_dir, total_steps=cfg.num_steps, tensorboard=cfg.tensorboard,
                           start_step=self.step, quiet=self.quiet, loggers=cfg.loggers,
                           run_config=cfg.to_dict(), wandb_project=cfg.wandb_project,
                           writer=distributed.is_writer())
    if distributed.is_writer():
      with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    try:
      return self._fit_steps(logger)
    finally:
      logger.release_logs()  # (an exception mid-run must not leave the bar's log handler)

  def _fit_steps(self, logger: MetricsLogger) -> dict[str, Any]:
    cfg = self.cfg
    say = logger.event if not self.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    with fit_hooks.StopSignals(say) as stop:
      if self.step == 0 and cfg.warmstart_steps and not self.warmstart_done:
        logger.phase("warm start")
        self.warmstart(logger)
        self.warmstart_done = True
        agreed = distributed.agree_stop(stop.signame)  # all stop, or none (a collective)
        if agreed:
          stop.signame = agreed
          self._stop(logger, agreed)
      logger.phase("compiling")  # the first step of a process compiles every stage
      while self.step < cfg.num_steps:
        stop.step = self.step + 1
        metrics = self.train_step()
        logger.phase("rollout/update")
        metrics.update(fit_hooks.validation_metrics(self))
        logger.log(self.step, metrics)
        rows = fit_hooks.sample_rows(self)
        if rows:
          logger.samples(self.step, rows)
        if self.bad_steps == 0 and self.step < cfg.num_steps:
          self.save_checkpoint()
        if metrics["skipped_update"]:
          logger.event(f"step {self.step}: non-finite loss or gradient, update skipped "
                       f"({self.bad_steps} in a row)")
        # Every process stops after the same step: a signal on any one counts for all. A
        # signal that lands during the agreement itself (after this process sent its flag)
        # stays pending here and is agreed at the next step's end: the agreed value must
        # not overwrite it (a lost SIGTERM ran a 2-process job to its last step).
        agreed = distributed.agree_stop(stop.signame)
        if agreed:
          stop.signame = agreed
        if self.bad_steps >= cfg.max_bad_steps:
          logger.close()
          raise TrainingStopped(
              f"stopping: {self.bad_steps} consecutive steps with a non-finite loss or "
              f"gradient (max_bad_steps={cfg.max_bad_steps}); parameters are those of the "
              "last finite step and earlier checkpoints are untouched")
        if agreed and self.step < cfg.num_steps:
          self._stop(logger, agreed)
      stop.step = None  # the end: a signal now only skips the export
      if self.bad_steps == 0 and self.checkpointer.latest_step() != self.step:
        self.save_checkpoint(force=True)  # (a resumed, finished run keeps its checkpoint)
      self.checkpointer.wait()
      if cfg.export_hf and stop.signame:
        say(f"{stop.signame}: export skipped; python experiments/export.py --checkpoint "
            f"{cfg.out_dir} writes it")
      elif cfg.export_hf:
        logger.event(f"exported the policy to {self.export_hf()}")
    if self.monitor.summary_line():  # the tail warnings, counted (only the first is printed)
      logger.event(self.monitor.summary_line())
    return logger.close()

  def _stop(self, logger: MetricsLogger, signame: str):
    """Save the finished step (force: off the save_every interval too) and stop."""
    self.save_checkpoint(force=True)
    self.checkpointer.wait()
    logger.close()
    raise TrainingInterrupted(self.step, signame, self.cfg.out_dir)

  def rollout_mode(self) -> str:
    """The evaluation mode that matches the training rollouts (the sparse actor)."""
    if self.schedule.is_dense:
      return "dense"
    return "sparse_lora" if self.lora is not None else "sparse"
