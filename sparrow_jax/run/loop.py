"""The training loop around the steps: the warm start at step 0, then RL steps up to
`num_steps`, with the loop's periodic work (validation every `val_every`, samples every
`sample_every`, checkpoints every `save_every`), signals and the non-finite-step guard.

SIGINT/SIGTERM finish the step in flight, save a checkpoint and raise TrainingInterrupted (a
second signal stops at once, without saving). Every process of a multi-host job stops after
the same step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from sparrow_jax.run import distributed
from sparrow_jax.run import fit_hooks
from sparrow_jax.run import signal_check
from sparrow_jax.run.metrics import MetricsLogger


class TrainingStopped(RuntimeError):
  """The run stopped on purpose (e.g. too many non-finite steps in a row)."""


class TrainingInterrupted(RuntimeError):
  """SIGINT/SIGTERM: the step in flight finished and a checkpoint of it was saved."""

  def __init__(self, step: int, signame: str, out_dir: str):
    self.step, self.signame, self.out_dir = step, signame, out_dir
    super().__init__(f"{signame}: stopped after step {step}; checkpoint saved in "
                     f"{os.path.join(out_dir, 'checkpoints')}")


def fit(tr) -> dict[str, Any]:
  """Run `tr` (a Trainer) to `num_steps`; returns the logger's summary."""
  cfg = tr.cfg
  steps = tr.checkpointer.all_steps()
  if steps and tr.resumed_step is None:
    raise ValueError(f"out_dir={cfg.out_dir!r} already holds checkpoints (steps {steps}); "
                     "call resume() first, or use a new out_dir")
  logger = MetricsLogger(cfg.out_dir, total_steps=cfg.num_steps, tensorboard=cfg.tensorboard,
                         start_step=tr.step, quiet=tr.quiet, loggers=cfg.loggers,
                         run_config=cfg.to_dict(), wandb_project=cfg.wandb_project,
                         writer=distributed.is_writer())
  if distributed.is_writer():
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
  try:
    return _fit_steps(tr, logger)
  finally:
    logger.release_logs()  # (an exception mid-run must not leave the bar's log handler)


def _after_step(tr, logger: MetricsLogger, metrics: dict) -> None:
  """The loop's periodic work after a step: validation joins the step's record, samples,
  the checkpoint (every `save_every`), the non-finite notice."""
  cfg = tr.cfg
  metrics.update(fit_hooks.validation_metrics(tr))
  logger.log(tr.step, metrics)
  rows = fit_hooks.sample_rows(tr)
  if rows:
    logger.samples(tr.step, rows)
  if tr.bad_steps == 0 and tr.step < cfg.num_steps:
    tr.save_checkpoint()
  if metrics["skipped_update"]:
    logger.event(f"step {tr.step}: non-finite loss or gradient, update skipped "
                 f"({tr.bad_steps} in a row)")


def _fit_steps(tr, logger: MetricsLogger) -> dict[str, Any]:
  cfg = tr.cfg
  say = logger.event if not tr.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
  with fit_hooks.StopSignals(say) as stop:
    if tr.step == 0 and cfg.warmstart_steps and not tr.state.warmstart_done:
      logger.phase("warm start")
      tr.warmstart(logger)
      tr.state.warmstart_done = True
      agreed = distributed.agree_stop(stop.signame)  # all stop, or none (a collective)
      if agreed:
        stop.signame = agreed
        _stop(tr, logger, agreed)
    logger.phase("compiling")  # the first step of a process compiles every stage
    check = signal_check.ZeroSignalCheck(cfg.reward, first_k=max(1, min(
        5, cfg.num_steps - tr.step)))
    while tr.step < cfg.num_steps:
      stop.step = tr.step + 1
      metrics = tr.train_step()
      warning = signal_check.observe_step(check, tr, metrics)
      if warning:  # (once: every reward 0, or no group with signal, in the first steps)
        logging.getLogger(signal_check.__name__).warning(warning)
      logger.phase("rollout/update")
      _after_step(tr, logger, metrics)
      # Every process stops after the same step: a signal on any one counts for all. A
      # signal that lands during the agreement itself (after this process sent its flag)
      # stays pending here and is agreed at the next step's end: the agreed value must
      # not overwrite it (a lost SIGTERM ran a 2-process job to its last step).
      agreed = distributed.agree_stop(stop.signame)
      if agreed:
        stop.signame = agreed
      if tr.bad_steps >= cfg.max_bad_steps:
        logger.close()
        raise TrainingStopped(
            f"stopping: {tr.bad_steps} consecutive steps with a non-finite loss or "
            f"gradient (max_bad_steps={cfg.max_bad_steps}); parameters are those of the "
            "last finite step and earlier checkpoints are untouched")
      if agreed and tr.step < cfg.num_steps:
        _stop(tr, logger, agreed)
    stop.step = None  # the end: a signal now only skips the export
    if tr.bad_steps == 0 and tr.checkpointer.latest_step() != tr.step:
      tr.save_checkpoint(force=True)  # (a resumed, finished run keeps its checkpoint)
    tr.checkpointer.wait()
    if cfg.export_hf and stop.signame:
      say(f"{stop.signame}: export skipped; python experiments/export.py --checkpoint "
          f"{cfg.out_dir} writes it")
    elif cfg.export_hf:
      logger.event(f"exported the policy to {tr.export_hf()}")
  if tr.monitor.summary_line():  # the tail warnings, counted (only the first is printed)
    logger.event(tr.monitor.summary_line())
  return logger.close()


def _stop(tr, logger: MetricsLogger, signame: str):
  """Save the finished step (force: off the save_every interval too) and stop."""
  tr.save_checkpoint(force=True)
  tr.checkpointer.wait()
  logger.close()
  raise TrainingInterrupted(tr.step, signame, tr.cfg.out_dir)
