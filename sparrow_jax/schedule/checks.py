"""Sanity checks on a sparsity schedule's shape that do not make it invalid, only suspect.

Sparrow's premise is that the sparse actor drifts from the dense policy as the context grows,
so a calibrated schedule's per-bin budget grows (or stays) with position. A schedule whose
budget falls with position (`[8, 4, 2, 1]`) is legal but is probably a mistake: reversed, or
calibrated on too few tokens in its late bins. The trainer warns about it (by name and bins).
"""

from __future__ import annotations

from sparrow_jax.schedule.schedule import SparsitySchedule


def decreasing_bins(schedule: SparsitySchedule) -> list[int]:
  """The bins whose budget is below the previous bin's."""
  b = schedule.budgets
  return [i for i in range(1, len(b)) if b[i] < b[i - 1]]


def decreasing_budgets_warning(schedule: SparsitySchedule) -> str | None:
  """A one-line warning naming the schedule and the bins where its budget decreases, or
  None when it never does (dense schedules included)."""
  if schedule.is_dense:
    return None
  bins = decreasing_bins(schedule)
  if not bins:
    return None
  b, size = schedule.budgets, schedule.bin_size
  shown = ", ".join(f"bin {i} (positions {i * size}-{(i + 1) * size - 1}): {b[i - 1]} -> {b[i]}"
                    for i in bins[:4]) + (f", ... ({len(bins)} bins)" if len(bins) > 4 else "")
  return (f"schedule {schedule.name!r}: the page budget decreases with position at {shown} "
          f"(budgets {list(b)}); Sparrow's premise is a budget that grows with position (the "
          "mismatch grows with the context): check that the schedule is not reversed")
