"""The run: the training loop and what surrounds it (above `sparrow_jax.rl`, the algorithms).
docs/training_step.md draws the data path.

  trainer        `Trainer`: builds the pieces and composes one step, checkpoints, export
  producer       the rollout interface (`RolloutEngine`, `EngineRollout`) and `Producer`:
                 prompts -> rollouts -> rewards -> `TrainBatch`; async_producer for
                 max_staleness > 0
  batch, state   `TrainBatch` (the step's typed batch), `TrainState` (the pytree a checkpoint
                 saves)
  learner        programs, micro-batch driver, exact alpha; `StepRecord`
  stages, hooks  the learner's stages; periodic work with an `every`
  step_metrics   the step's metrics record
  loop           the training loop (warm start, steps, validation, samples, checkpoints,
                 signals); warmstart, setup, algorithm (config -> loss / distill / engine)
  builders       model, tokenizer, schedule, data, optimizer, preflight checks
  config         `TrainConfig`, presets, key=value overrides, config files, key docs
  runs           run folders: existing runs, resume configs, config changes
  checkpointing  orbax checkpoints (atomic, keep-last-K, damaged-step fallback)
  sharding       mesh, partition rules, batch sharding
  distributed    `jax.distributed`, collectives, agreed stop (completion_wire, watchdog)
  memory         the per-device memory plan; dry_run prints it, compile_plan checks it
  metrics        console / JSONL / TensorBoard / wandb logging, summary
  fit_hooks      signals, validation and samples around each step
  evaluate       k samples per prompt -> avg@k / pass@k / maj@k
"""
