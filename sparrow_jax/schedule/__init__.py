"""Dynamic sparsity schedules, mismatch (acceptance-rate) metrics, calibration and cost model."""

from sparrow_jax.schedule.presets import PRESETS, constant, dense, get_schedule, names
from sparrow_jax.schedule.schedule import (SparsitySchedule, budget_pages, max_budget,
                                           pages_attended, parse_schedule)

__all__ = ["PRESETS", "SparsitySchedule", "budget_pages", "constant", "dense", "get_schedule",
           "max_budget", "names", "pages_attended", "parse_schedule"]
