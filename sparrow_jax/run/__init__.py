"""The run: the training loop and what surrounds it (above `sparrow_jax.rl`, the algorithms).

  trainer       `Trainer`: the RL step as named stages over one step batch, the fit loop
  builders      model, tokenizer, schedule, data, optimizer, preflight checks
  config        `TrainConfig`, presets, key=value overrides
  runs          run folders: existing runs, resume configs, config changes
  checkpointing orbax checkpoints (atomic, keep-last-K, damaged-step fallback)
  sharding      mesh, partition rules, batch sharding, `jax.distributed`
  memory        the per-device memory plan; dry_run prints it
  metrics       console / JSONL / TensorBoard / wandb logging, summary
  fit_hooks     signals, validation and samples around each step
  evaluate      k samples per prompt -> avg@k / pass@k / maj@k
"""
