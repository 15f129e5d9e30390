"""Online rollout pruning inside the engine (ARRoL's backend half): the hook protocol and the
per-group bookkeeping.

A `PruneHook` (the trainer's ARRoL pruner implements it) gives the engine

  detect_len    L_detect, in generated tokens;
  stop_ids      token ids that end a sentence or a line: the hidden state after such a token
                is a candidate detection point;
  head_params   the quality head's parameters (evaluated inside the decode step on the
                final-normed hidden state the step already computes), or None when the hook
                needs no score (random pruning);
  decide()      called once per prompt group, when every member has either reached
                L_detect or finished: keep/prune flags for the members that reached it.

Detection point of a sequence: the last generated token among the first `detect_len` that is a
stop token, else generated token `detect_len - 1` (`rl.arrol.detection_position` is the host
reference). Its hidden state and head logit are recorded on device while decoding and read back
per chunk, so preemption loses nothing. A sequence that finishes before L_detect is kept and is
not a candidate; it still carries its last recorded hidden state (the label of a finished
rollout is what trains the head). Pruned sequences leave the engine at once: slot and pages are
freed at the end of the chunk in which their group was decided, and queued requests take them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass
class PruneCandidate:
  """A group member that reached the detection length."""

  request_id: Any
  logit: float | None  # head logit at the detection point (None without a head)
  num_generated: int  # tokens generated when the group was decided


class PruneHook(Protocol):
  detect_len: int
  stop_ids: frozenset
  head_params: Any

  def decide(self, group: Hashable, candidates: Sequence[PruneCandidate]) -> Sequence[bool]:
    ...


@dataclasses.dataclass
class Detection:
  """What the engine recorded about one sequence's detection point."""

  logit: float | None = None  # head logit at the detection point
  hidden: np.ndarray | None = None  # [D] final-normed hidden state there
  index: int = -1  # generated-token index of the detection point (-1: none yet)
  last_logit: float | None = None  # the same at the latest generated token seen (fallback)
  last_hidden: np.ndarray | None = None
  last_index: int = -1

  def best(self):
    """(logit, hidden, index) of the detection point, else of the latest token seen."""
    if self.index >= 0:
      return self.logit, self.hidden, self.index
    return self.last_logit, self.last_hidden, self.last_index


class GroupTracker:
  """Which groups are complete (every member detected or finished) and their decisions."""

  def __init__(self, seqs, detect_len: int):
    self.detect_len = detect_len
    self.members: dict[Hashable, list] = {}
    for s in seqs:
      key = s.req.group if getattr(s.req, "group", None) is not None else ("_solo", s.index)
      self.members.setdefault(key, []).append(s)
    self.decided: set = set()

  def reached(self, seq) -> bool:
    """The hidden state of generated token detect_len - 1 has been computed (a decode step
    took it as input and sampled the next token)."""
    return len(seq.tokens) > self.detect_len

  def ready_groups(self, finished: set) -> list:
    """Undecided groups whose members all reached L_detect or finished."""
    out = []
    for key, seqs in self.members.items():
      if key in self.decided:
        continue
      if all(s.index in finished or self.reached(s) for s in seqs):
        out.append(key)
    return out
