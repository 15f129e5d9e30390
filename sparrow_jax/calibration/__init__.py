"""Schedule calibration: runs the generation engine and the teacher-forced sparse forward to
measure the tail acceptance rate per (position bin, budget) and derive a schedule. It drives
the engine, so it sits above `sparrow_jax.engine` (and `sparrow_jax.schedule` stays below it)."""
