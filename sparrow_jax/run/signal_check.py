"""A run that cannot silently learn nothing (issue 50).

GRPO learns only from groups whose rewards differ: when every rollout of the first steps scores
0 (raw GSM8K answers `... #### 72` against `boxed_exact`; a reward that cannot read the model's
format), or every group's rewards are equal, every advantage is 0 and the run trains on
nothing while looking healthy. `ZeroSignalCheck` watches the first `first_k` steps and returns
one warning line, once, naming the reward function, one response and the expected answer it
was compared with; it also counts the zero-variance groups of the whole run for the summary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_SHOW = 160  # characters of a response / answer shown in the warning


def _clip(text: str, n: int = _SHOW) -> str:
  """`text` on one line, its END kept when long (the answer is usually at the end)."""
  one = " ".join(str(text).split())
  return one if len(one) <= n else "..." + one[-(n - 3):]


class ZeroSignalCheck:
  """Warns once when the first `first_k` steps carry no learning signal.

  Call `observe` once per step with that step's rewards `[B]` (grouped: `group_size`
  consecutive rollouts per prompt, or by `group_ids` when groups differ in size, e.g. after
  ARRoL's pruning), the response texts and the expected answer of each rollout. It returns
  the warning line at step `first_k` when every rollout so far scored 0 or every group so
  far had zero variance, else None (and None for every later step).
  `zero_variance_groups` / `groups` count over every observed step.
  """

  def __init__(self, reward_name: str, first_k: int = 5):
    if not isinstance(first_k, int) or first_k < 1:
      raise ValueError(f"ZeroSignalCheck.first_k={first_k!r}: expected a positive int")
    self.reward_name = reward_name
    self.first_k = first_k
    self.zero_variance_groups = 0
    self.groups = 0
    self.warned = False
    self._steps = 0
    self._all_zero = True
    self._all_flat = True
    self._example: tuple[str, str] | None = None

  @property
  def watching(self) -> bool:
    """Still within the first `first_k` steps and not yet warned: responses matter."""
    return not self.warned and self._steps < self.first_k

  def observe(self, step: int, rewards, group_size: int, response_texts: Sequence[str],
              expected_answers: Sequence[str], group_ids: Sequence | None = None
              ) -> str | None:
    r = np.asarray(rewards, np.float64).reshape(-1)
    if len(response_texts) != r.size or len(expected_answers) != r.size:
      raise ValueError(f"ZeroSignalCheck.observe: {r.size} rewards, {len(response_texts)} "
                       f"responses, {len(expected_answers)} answers; expected one each")
    if group_ids is not None:
      if len(group_ids) != r.size:
        raise ValueError(f"ZeroSignalCheck.observe: {len(group_ids)} group ids for {r.size} "
                         "rewards; expected one each")
      by_id: dict = {}
      for g, x in zip(group_ids, r):
        by_id.setdefault(g, []).append(x)
      spans = [(min(v), max(v)) for v in by_id.values()]
    elif group_size < 1 or r.size % group_size:
      raise ValueError(f"ZeroSignalCheck.observe: group_size={group_size} does not divide "
                       f"the {r.size} rewards")
    else:
      groups = r.reshape(-1, group_size)
      spans = list(zip(groups.min(axis=1), groups.max(axis=1)))
    if not r.size:
      return None
    flat = sum(lo == hi for lo, hi in spans)
    self.zero_variance_groups += flat
    self.groups += len(spans)
    self._steps += 1
    if self.warned or self._steps > self.first_k:
      return None
    self._all_zero &= bool(np.all(r == 0))
    self._all_flat &= flat == len(spans)
    if self._example is None or not self._example[0].strip():  # a non-empty one if any
      i = next((j for j, t in enumerate(response_texts) if str(t).strip()), 0)
      self._example = (str(response_texts[i]), str(expected_answers[i]))
    if self._steps < self.first_k or not (self._all_zero or self._all_flat):
      return None
    self.warned = True
    return self._message(step)

  def _message(self, step: int) -> str:
    response, answer = self._example or ("", "")
    what = ("every rollout scored 0" if self._all_zero else
            "every group's rewards were equal (zero variance)")
    return (f"no learning signal: in the first {self._steps} steps (to step {step}) "
            f"{what} with reward={self.reward_name}, so every advantage is 0 and GRPO learns "
            f"nothing. One response: {_clip(response)!r}; expected answer it was compared "
            f"with: {_clip(answer)!r}. Check that the answer field holds the bare final answer "
            "(GSM8K / MATH / verl data: experiments/prepare_data.py) and that the reward reads "
            "the model's answer format (reward=math_verify reads most).")

  def summary(self) -> dict[str, int]:
    """For the run's summary: zero-variance groups and groups seen."""
    return {"zero_variance_groups": self.zero_variance_groups, "groups": self.groups}


METRIC = "reward/zero_variance_groups"  # per step; the summary adds them up


def observe_step(check: ZeroSignalCheck, trainer, metrics: dict) -> str | None:
  """After one step of `trainer` (its `last_rollout`: the example of each completion, the
  completions, their rewards): feed `check`, put the step's zero-variance group count into
  `metrics` under METRIC, and return the warning line when it is due. Responses are decoded
  (as the verifier saw them) only while the check still watches the first steps."""
  if trainer.last_rollout is None:
    return None
  examples, comps, rewards = trainer.last_rollout
  before = check.zero_variance_groups
  texts = ([trainer.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
           if check.watching else [""] * len(comps))
  warning = check.observe(trainer.step, rewards, trainer.cfg.group_size, texts,
                          [e.answer for e in examples],
                          group_ids=[c.request_id[0] for c in comps])
  metrics[METRIC] = check.zero_variance_groups - before
  return warning
