"""Dynamic sparsity schedules, mismatch (acceptance-rate) metrics and the cost model
(calibration drives the engine, so it lives above it in `sparrow_jax.calibration`)."""

from sparrow_jax.schedule.presets import (PRESETS, as_schedule, constant, dense, get_schedule,
                                          names, parse_schedule)
from sparrow_jax.schedule.schedule import (SparsitySchedule, budget_pages, max_budget,
                                           pages_attended, teacher_forced_budgets)

__all__ = ["PRESETS", "SparsitySchedule", "as_schedule", "budget_pages", "constant", "dense",
           "get_schedule", "max_budget", "names", "pages_attended", "parse_schedule",
           "teacher_forced_budgets"]
