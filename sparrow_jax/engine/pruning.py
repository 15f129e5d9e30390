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
reference). Its hidden state and head logit are recorded on device (`record_detection`) for
every token a step takes as input: by the decode loop, and by every prefill for the last
context token, the one that prefill takes as input instead of a decode step (for a sequence
readmitted after preemption that is its last generated token). The records are read back per
chunk into a `DetectionTable`, so preemption neither loses nor moves the detection point.
A sequence that finishes before L_detect is kept and is not a candidate; it still carries its
last recorded hidden state (the label of a finished rollout is what trains the head). Pruned sequences leave the engine at once: slot and pages are
freed at the end of the chunk in which their group was decided, and queued requests take them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Protocol, Sequence

import jax.numpy as jnp
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


def empty_record(batch: int, hidden_size: int):
  """Initial on-device record of `batch` rows: (logit, hidden, index) at the last stop token in
  the window, then the same at the latest window token (index -1: nothing recorded)."""
  one = (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, hidden_size), jnp.float32),
         jnp.full((batch,), -1, jnp.int32))
  return one * 2


def record_detection(rec, tok, pos, active, hidden, logit, det):
  """Update the record with the input tokens of one step (traced).

  tok int32 `[B]` the input token at position `pos` `[B]` (written into the cache by this
  step), `active` bool `[B]`, `hidden` float32 `[B, D]` its final-normed hidden state, `logit`
  `[B]` the head's logit of it; `det` = (head, det_stop_ids `[S]`, prompt_len `[B]`, det_end
  `[B]`, the position of generated token detect_len - 1)."""
  _, det_stop, prompt_len, det_end = det
  window = active & (pos >= prompt_len) & (pos <= det_end)  # [B]
  # The window's last token is the detection point only when no stop token came before it:
  # that fallback is the "latest" record (`DetectionTable.best`).
  at_stop = window & jnp.any(tok[:, None] == det_stop, axis=-1)
  idx = pos - prompt_len  # generated-token index of the input token
  new = []
  for j, upd in enumerate((at_stop, window)):
    lg, hs, ix = rec[3 * j:3 * j + 3]
    new += [jnp.where(upd, logit, lg), jnp.where(upd[:, None], hidden, hs),
            jnp.where(upd, idx, ix)]
  return tuple(new)


class DetectionTable:
  """What the engine recorded about every request's detection point (host arrays)."""

  def __init__(self, num_requests: int, hidden_size: int):
    n, d = num_requests, hidden_size
    self.logit = np.zeros((n,), np.float32)  # head logit at the detection point
    self.hidden = np.zeros((n, d), np.float32)  # final-normed hidden state there
    self.index = np.full((n,), -1, np.int64)  # generated-token index (-1: none yet)
    self.last_logit = np.zeros((n,), np.float32)  # the same at the latest token seen
    self.last_hidden = np.zeros((n, d), np.float32)
    self.last_index = np.full((n,), -1, np.int64)

  def update(self, seq_ids: np.ndarray, rec) -> None:
    """Take a step's or chunk's record of rows whose requests are `seq_ids` `[R]`."""
    logit, hidden, index, l_logit, l_hidden, l_index = (np.asarray(x) for x in rec)
    for got, dst in (((logit, hidden, index), (self.logit, self.hidden, self.index)),
                     ((l_logit, l_hidden, l_index),
                      (self.last_logit, self.last_hidden, self.last_index))):
      hit = got[2] >= 0
      ids = seq_ids[hit]
      for src, out in zip(got, dst):
        out[ids] = src[hit]

  def best(self, i: int):
    """(logit, hidden, index) of request i's detection point, else of the latest token seen
    (None, None, -1 when nothing was recorded)."""
    if self.index[i] >= 0:
      return float(self.logit[i]), self.hidden[i].copy(), int(self.index[i])
    if self.last_index[i] >= 0:
      return float(self.last_logit[i]), self.last_hidden[i].copy(), int(self.last_index[i])
    return None, None, -1


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
    return seq.num_tokens > self.detect_len

  def ready_groups(self, finished: set) -> list:
    """Undecided groups whose members all reached L_detect or finished."""
    out = []
    for key, seqs in self.members.items():
      if key in self.decided:
        continue
      if all(s.index in finished or self.reached(s) for s in seqs):
        out.append(key)
    return out
