"""Advantage estimators by name (`adv_estimator`, verl's `algorithm.adv_estimator`).

Every estimator is `fn(rewards [B], group_ids [B], *, group_size, normalize_std) -> [B]
float32`: rows of one prompt share a group id; `group_size` is G when every group is whole
and contiguous (the batch without ARRoL's pruning), else None (ragged groups).

    grpo   (r_i - mean_group) / (std_group + eps), unbiased std; `normalize_std=false` is
           Dr.GRPO's r_i - mean_group. A group of equal rewards gets 0.
    rloo   REINFORCE leave-one-out: r_i - mean_{j != i, same group} r_j = n / (n - 1) *
           (r_i - mean_group); `normalize_std` does not apply. A group of one member gets 0.

A new estimator is one more registered function.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sparrow_jax.rl import grpo
from sparrow_jax.rl.registry import ADVANTAGES


def _groups(group_ids) -> list[list[int]]:
  groups: dict = {}
  for i, g in enumerate(group_ids):
    groups.setdefault(g, []).append(i)
  return list(groups.values())


@ADVANTAGES.register("grpo", "group-relative: (r - group mean) / group std (Dr.GRPO without "
                             "the std)")
def grpo_advantages(rewards, group_ids, *, group_size: int | None = None,
                    normalize_std: bool = True) -> np.ndarray:
  if group_size is not None:  # whole contiguous groups: the traced version
    return np.asarray(grpo.group_advantages(jnp.asarray(rewards), group_size,
                                            normalize_std=normalize_std), np.float32)
  return grpo.ragged_group_advantages(rewards, group_ids, normalize_std=normalize_std)


@ADVANTAGES.register("rloo", "REINFORCE leave-one-out: r - mean of the group's other rewards")
def rloo_advantages(rewards, group_ids, *, group_size: int | None = None,
                    normalize_std: bool = True) -> np.ndarray:
  del group_size, normalize_std  # (no std normalisation in RLOO)
  r = np.asarray(rewards, np.float64).reshape(-1)
  ids = list(group_ids)
  if len(ids) != r.size:
    raise ValueError(f"rloo_advantages: {r.size} rewards but {len(ids)} group ids")
  out = np.zeros_like(r)
  for idx in _groups(ids):
    n = len(idx)
    if n > 1:
      x = r[idx]
      out[idx] = x - (x.sum() - x) / (n - 1)
  return out.astype(np.float32)


def compute_advantages(name: str, rewards, group_ids, *, group_size: int | None,
                       normalize_std: bool) -> np.ndarray:
  """The advantages of estimator `name` (an unknown name names the known ones)."""
  return ADVANTAGES.get(name)(rewards, group_ids, group_size=group_size,
                              normalize_std=normalize_std)
