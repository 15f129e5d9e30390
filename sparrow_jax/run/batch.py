"""The typed batch of one RL step: what the producer hands the learner, filled stage by stage.

A `TrainBatch` is made by `make_batch` from scored completions (row j = completion j) and holds
host arrays with named, typed fields. The learner's stages fill the fields that start as None
(old log-probs, the monitor's dense top-k, reference log-probs, advantages, the GRPO loss
mask); nothing is added under any other name. `arrays(*keys)` hands the micro-batch driver
(`run/microbatch.py`) a plain dict view of the fields it needs.

Shapes: B rows (completions), T = the longest prompt + response, k = `monitor_topk`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from sparrow_jax.schedule.schedule import SparsitySchedule


@dataclasses.dataclass
class GenerationInfo:
  """What generating the batch took, over every completion scored (refill rounds included)."""

  completions: list  # every scored completion of the step (refill rounds too)
  rewards: np.ndarray  # [N] their rewards
  rounds: int  # rollout rounds (1 + dynamic-sampling refills)
  rollout_s: float
  reward_s: float
  engine: dict  # engine counters summed over rounds (high-water marks: max)
  pruned: list  # completions ARRoL pruned (no reward)
  num_errors: int  # verifier errors
  num_timeouts: int  # verifiers killed at reward_timeout_s
  prune_hook: Any = None  # the engine's ARRoL hook of this rollout (its metrics)
  agent: dict = dataclasses.field(default_factory=dict)  # agent/* metrics (multi-turn)


@dataclasses.dataclass(slots=True)  # (slots: a field not declared here cannot be added)
class TrainBatch:
  step: int
  completions: list  # [B] engine Completions, row j = completions[j]
  examples: list  # [B] the prompt example of each row
  rewards: np.ndarray  # [B] float32
  group_ids: list  # [B] prompt index of each row (GRPO groups)
  tokens: np.ndarray  # [B, T] int32 prompt + response, 0-padded
  lengths: np.ndarray  # [B] int32 prompt + response length
  prompt_lens: np.ndarray  # [B] int32
  mask: np.ndarray  # [B, T] float32: 1 on the policy's own response tokens
  versions: np.ndarray  # [B, T] int32 policy version that sampled each token (-1 elsewhere)
  rollout_logp: np.ndarray  # [B, T] float32 the actor's log-prob of each sampled token
  rollout_topk_ids: np.ndarray  # [B, T, k] int32 the actor's top-k at each position
  rollout_topk_logp: np.ndarray  # [B, T, k] float32 (-1e9 where absent)
  schedule: SparsitySchedule | None = None  # the schedule that generated the rollouts
  lora: Any = None  # the sparse actor's LoRA that generated them (None: no LoRA); valid
  #                   until the DistillSparse stage updates it in place
  policy_version: int = 0  # the version of the policy the rollouts started from
  info: GenerationInfo | None = None
  # filled by the learner's stages
  old_logp: np.ndarray | None = None  # [B, T] dense policy at the step's start (recompute)
  dense_topk_ids: np.ndarray | None = None  # [B, T, k] its top-k (the monitor's)
  dense_topk_logp: np.ndarray | None = None  # [B, T, k]
  ref_logp: np.ndarray | None = None  # [B, T] KL reference (kl_coef > 0)
  advantages: np.ndarray | None = None  # [B] float32
  loss_mask: np.ndarray | None = None  # [B, T] mask less dynamic sampling's dropped groups
  zero_var: np.ndarray | None = None  # [groups] bool: all rewards equal (fixed-size groups)

  @property
  def rows(self) -> int:
    return int(self.tokens.shape[0])

  def arrays(self, *keys: str) -> dict[str, np.ndarray]:
    """{name: array} of the named fields that are set (all array fields when no key is
    given): the micro-batch driver's input."""
    names = keys or _ARRAY_FIELDS
    out = {}
    for k in names:
      if k not in _ARRAY_FIELDS:
        raise KeyError(f"TrainBatch has no array field {k!r}; expected one of {_ARRAY_FIELDS}")
      v = getattr(self, k)
      if v is not None:
        out[k] = v
    return out

  def rows_of(self, rows: slice) -> "TrainBatch":
    """The batch restricted to `rows` (array fields sliced, the rest shared)."""
    kw = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name in _ROW_FIELDS and v is not None:
        v = v[rows]
      kw[f.name] = v
    return TrainBatch(**kw)


_ARRAY_FIELDS = ("tokens", "lengths", "prompt_lens", "mask", "versions", "rollout_logp",
                 "rollout_topk_ids", "rollout_topk_logp", "old_logp", "dense_topk_ids",
                 "dense_topk_logp", "ref_logp", "advantages", "loss_mask")
_ROW_FIELDS = set(_ARRAY_FIELDS) | {"rewards"}


def make_batch(completions: Sequence, *, max_new_tokens: int, topk: int, step: int = 0,
               examples: Sequence | None = None, rewards=None, version: int = 0,
               schedule: SparsitySchedule | None = None, lora=None,
               info: GenerationInfo | None = None) -> TrainBatch:
  """Pad prompt+response into [B, T] host arrays (T = the longest row). The loss mask is the
  completion's own (`Completion.loss_mask`: environment tokens 0), all ones over the
  response when it has none; each token's policy version is the completion's
  (`Completion.versions`), else `version`. The micro-batch driver cuts each micro-batch to
  its own length bucket."""
  lens = [len(c.prompt_ids) + len(c.token_ids) for c in completions]
  b, t = len(lens), max(lens)
  tokens = np.zeros((b, t), np.int32)
  mask = np.zeros((b, t), np.float32)
  versions = np.full((b, t), -1, np.int32)
  rollout_logp = np.zeros((b, t), np.float32)
  r_ids = np.zeros((b, t, topk), np.int32)
  r_lp = np.full((b, t, topk), -1e9, np.float32)
  prompt_lens = np.ones((b,), np.int32)
  for j, c in enumerate(completions):
    p, n = len(c.prompt_ids), len(c.token_ids)
    if n > max_new_tokens:  # the programs' LM-head window would miss tokens
      raise ValueError(f"completion {c.request_id}: {n} response tokens > max_new_tokens="
                       f"{max_new_tokens}")
    tokens[j, :p] = c.prompt_ids
    tokens[j, p:p + n] = c.token_ids
    mask[j, p:p + n] = 1 if c.loss_mask is None else np.asarray(c.loss_mask, np.float32)
    versions[j, p:p + n] = version if c.versions is None else np.asarray(c.versions)
    rollout_logp[j, p:p + n] = c.logprobs
    if c.topk_ids is not None:
      r_ids[j, p:p + n] = c.topk_ids
      r_lp[j, p:p + n] = c.topk_logprobs
    prompt_lens[j] = p
  return TrainBatch(
      step=step, completions=list(completions),
      examples=list(examples) if examples is not None else [],
      rewards=(np.zeros((b,), np.float32) if rewards is None
               else np.asarray(rewards, np.float32)),
      group_ids=[c.request_id[0] for c in completions] if b and isinstance(
          completions[0].request_id, tuple) else [],
      tokens=tokens, lengths=np.asarray(lens, np.int32), prompt_lens=prompt_lens, mask=mask,
      versions=versions, rollout_logp=rollout_logp, rollout_topk_ids=r_ids,
      rollout_topk_logp=r_lp, schedule=schedule, lora=lora, policy_version=version, info=info)
