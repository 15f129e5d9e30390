"""The learner: the jitted programs of a step and the micro-batch driver that runs them.

`Learner` owns what every training-side phase shares — the GRPO loss and DistillSparse
configs (`run/algorithm.py`), the programs (`run/programs.py`), the mesh and the micro-batch
plans — and nothing of the rollout. The stages (`run/stages.py`) are functions of (learner,
training state, step record) that do their own work with it:

    logprob_plan / update_plan   micro-batches of the no-grad phases / of one mini-batch
    run_micro                    a program over every micro-batch, results as host arrays
    token_alpha / tail_alpha     exact alpha_t of a sparse actor against the dense policy,
                                 teacher-forced (exact-alpha hook, ladder probe, evaluation)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl.switching import _probe_alpha as probe_alpha_program
from sparrow_jax.rl.switching import alpha_tail, attention_for
from sparrow_jax.run import algorithm
from sparrow_jax.run import distributed
from sparrow_jax.run import microbatch as mb_lib
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.batch import TrainBatch
from sparrow_jax.run.programs import build_programs
from sparrow_jax.schedule.schedule import SparsitySchedule, teacher_forced_budgets


@dataclasses.dataclass(slots=True)
class StepRecord:
  """One step as it runs: the typed batch, the plans, and what every stage reports."""

  step: int
  batch: TrainBatch | None = None
  logprob_plan: list = dataclasses.field(default_factory=list)
  update_metrics: list = dataclasses.field(default_factory=list)  # one dict per update
  all_finite: bool = True
  rho_hat: tuple = (0.0, 0.0)  # ARRoL's Table 4 statistics of the batch's groups
  exact_token_alpha: np.ndarray | None = None  # [rows, T] exact alpha of the first rows
  out: dict = dataclasses.field(default_factory=dict)  # metrics of every stage and hook
  times: dict = dataclasses.field(default_factory=dict)  # wall seconds per stage


class Learner:
  def __init__(self, cfg, graphdef, mesh, *, tx, lr_schedule, param_shardings, opt_shardings,
               attention, lora_tx=None):
    self.cfg = cfg
    self.graphdef = graphdef
    self.mesh = mesh
    self.tx, self.lr_schedule, self.lora_tx = tx, lr_schedule, lora_tx
    self.param_shardings, self.opt_shardings = param_shardings, opt_shardings
    self.temperature = algorithm.rollout_temperature(cfg)
    self.loss_cfg = algorithm.loss_config(cfg)
    self.distill_cfg = algorithm.distill_config(cfg)
    # Micro-batches are split over the batch axes (data x fsdp): rows come in multiples.
    self.batch_divisor = sh.batch_divisor(mesh)
    self.update_rows = cfg.micro_batch
    self.logprob_rows = cfg.logprob_micro_batch_size or cfg.micro_batch
    for key, rows in (("micro_batch_size", self.update_rows),
                      ("logprob_micro_batch_size", self.logprob_rows)):
      if not (cfg.max_tokens_per_micro_batch or cfg.logprob_max_tokens_per_micro_batch) \
          and rows % self.batch_divisor:
        raise ValueError(f"{key}={rows}: micro-batches are split over data x fsdp = "
                         f"{self.batch_divisor} devices (mesh={cfg.mesh!r}); expected a "
                         "multiple of it")
    self.programs = None
    self.build_programs(attention)

  def build_programs(self, attention) -> None:
    """(Re)build the jitted programs for `attention` (DistillSparse's sparse forward follows
    the schedule: a ladder switch rebuilds them; the compile counter keeps counting)."""
    count = self.programs.count if self.programs is not None else None
    rep = sh.replicated(self.mesh)
    self.programs = build_programs(
        self.graphdef, self.cfg, loss_cfg=self.loss_cfg, tx=self.tx,
        temperature=self.temperature, skip_recompute=self.cfg.skips_recompute,
        attention=attention, lora_tx=self.lora_tx, dcfg=self.distill_cfg,
        apply_shardings=(self.param_shardings, self.opt_shardings, rep, rep),
        mesh=self.mesh, batch_axes=sh.BATCH_AXES)
    if count is not None:
      self.programs.count = count

  # --- micro-batch driver ----------------------------------------------------------------
  def place(self, inputs: dict) -> dict:
    return sh.shard_batch(inputs, self.mesh)

  @property
  def _bucketing(self) -> dict[str, int]:
    cfg = self.cfg
    return {"per_octave": cfg.length_buckets_per_octave,
            "max_length": cfg.max_prompt_len + cfg.max_new_tokens}

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

  def run_micro(self, fn, arrays, plan, *, keys=None, prepare=None) -> dict[str, np.ndarray]:
    """`fn` over every micro-batch of `plan`, inputs placed sharded over the batch axes;
    results as full host arrays (`microbatch.run`)."""
    return mb_lib.run(fn, arrays, plan, place=self.place, keys=keys, prepare=prepare,
                      fetch=distributed.fetch)

  # --- exact alpha -----------------------------------------------------------------------
  def token_alpha(self, params, arrays, schedule: SparsitySchedule, lora, plan=None, *,
                  with_logp: bool = False, dense_params=None):
    """Exact alpha_t [B, T] between the dense policy `params` and sparse(+`lora`) under
    `schedule`, teacher-forced on a batch's tokens (micro-batched). With `with_logp`,
    (alpha, logp): logp [B, T] the sparse actor's log-prob of each token at the rollout
    temperature. `dense_params`: the dense side's weights when they are not `params` (the
    sparse actor of an older policy version against the learner's current one)."""
    plan = plan if plan is not None else self.logprob_plan(arrays["lengths"])
    t = int(np.shape(arrays["tokens"])[1])
    attention = attention_for(schedule, t, landmark_dtype=self.cfg.landmark_dtype)

    def prepare(inputs, micro):
      inputs["budgets"] = np.asarray(teacher_forced_budgets(schedule, micro.length,
                                                            micro.rows))
      return inputs

    def fn(mb):
      out = probe_alpha_program(self.graphdef, params, lora, mb["tokens"], mb["budgets"],
                                mb["prompt_lens"], mb["lengths"], jnp.float32(self.temperature),
                                attention=attention, chunk=self.cfg.logprob_chunk,
                                with_logp=with_logp, dense_state=dense_params)
      return {"alpha": out[0], "logp": out[1]} if with_logp else {"alpha": out}

    res = self.run_micro(fn, arrays, plan, keys=("tokens", "prompt_lens", "lengths"),
                         prepare=prepare)
    if with_logp:
      return np.asarray(res["alpha"]), np.asarray(res["logp"])
    return np.asarray(res["alpha"])

  def tail_alpha(self, params, arrays, schedule: SparsitySchedule, lora, mask, plan=None,
                 **kw) -> float:
    """Tail (p5) of exact alpha_t between the dense policy and sparse(+`lora`) under
    `schedule` over `mask`'s tokens of a batch (micro-batched; `switching.alpha_tail`)."""
    return alpha_tail(self.token_alpha(params, arrays, schedule, lora, plan), mask, **kw)

  def opt_count(self, opt_state) -> Any:
    """The optimizer's step counter (the learning-rate schedule's position)."""
    counts = [x for x in jax.tree.leaves(opt_state)
              if hasattr(x, "dtype") and x.dtype == jnp.int32 and x.ndim == 0]
    return counts[0] if counts else jnp.zeros((), jnp.int32)
