"""Calibration trajectories: prompt + generated tokens of the sparse actor, sampled with the
generation engine and written as they finish, so an interrupted calibration resumes.

`generate_trajectories` samples `num_samples` completions per prompt at the actor's budget
(`CalibrationConfig.actor_budget`; 0 = dense decode). With a `journal` (the calibration's
`trajectories.partial.jsonl`) every finished trajectory is appended as one JSON line at once:
after a kill, `read_journal` gives back what was done and only the rest is generated. The
calibration then stores all of them as `trajectories.npz` (`Trajectories.save`) and drops the
journal.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import numpy as np

from sparrow_jax.models import attention as attn_lib

JOURNAL = "trajectories.partial.jsonl"  # one line per finished trajectory while generating


def _atomic_savez(path: str, **arrays) -> None:
  tmp = path + ".partial.npz"
  np.savez(tmp, **arrays)
  os.replace(tmp, path)


@dataclasses.dataclass
class Trajectories:
  """Prompt + generated tokens of N sequences, right-padded with 0."""

  tokens: np.ndarray  # [N, Tmax] int32
  lengths: np.ndarray  # [N] int32 prompt + generated
  prompt_lengths: np.ndarray  # [N] int32
  prompt_index: np.ndarray  # [N] int32 which prompt each sequence answers
  finish_reasons: list[str]
  logprobs: np.ndarray  # [N, Tmax] float32 actor log-prob of each generated token (else 0)

  @property
  def num(self) -> int:
    return int(self.lengths.shape[0])

  @property
  def num_generated(self) -> int:
    return int((self.lengths - self.prompt_lengths).sum())

  def generated(self, i: int) -> np.ndarray:
    return self.tokens[i, self.prompt_lengths[i]:self.lengths[i]]

  def save(self, path: str) -> None:
    _atomic_savez(path, tokens=self.tokens, lengths=self.lengths,
                  prompt_lengths=self.prompt_lengths, prompt_index=self.prompt_index,
                  finish_reasons=np.asarray(self.finish_reasons, dtype=str),
                  logprobs=self.logprobs)

  @classmethod
  def load(cls, path: str) -> "Trajectories":
    with np.load(path) as z:
      return cls(tokens=z["tokens"], lengths=z["lengths"], prompt_lengths=z["prompt_lengths"],
                 prompt_index=z["prompt_index"], logprobs=z["logprobs"],
                 finish_reasons=[str(s) for s in z["finish_reasons"]])


def read_journal(path: str, num: int) -> dict[int, tuple[list[int], list[float], str]]:
  """Finished trajectories of an interrupted generation: {request index: (generated token ids,
  their log-probs, finish reason)} from the JSONL journal at `path` (absent: {}). A line cut
  short by the interruption is ignored (that trajectory is generated again)."""
  done: dict[int, tuple[list[int], list[float], str]] = {}
  if not os.path.isfile(path):
    return done
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
        i, toks, lps, fin = int(rec["i"]), rec["tokens"], rec["logprobs"], str(rec["finish"])
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        continue  # the last line of a killed run
      if 0 <= i < num and len(toks) == len(lps):
        done[i] = ([int(t) for t in toks], [float(x) for x in lps], fin)
  return done


def generate_trajectories(model, prompt_ids: Sequence[Sequence[int]], cfg,  # CalibrationConfig
                          *, progress: bool = True, journal: str | None = None,
                          log: Callable[[str], None] | None = None) -> Trajectories:
  """Sample `num_samples` completions per prompt with the sparse actor at `cfg.actor_budget`.

  `journal`: a JSONL file that gets one line per trajectory as soon as it finishes; the
  trajectories already in it (an interrupted run with the same settings) are not generated
  again. Each request's seed depends only on its index, so the resumed set is the one an
  uninterrupted run samples (up to floating-point differences of a different batch mix).
  """
  from tqdm.auto import tqdm

  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams

  if not prompt_ids:
    raise ValueError("generate_trajectories: no prompts")
  reqs = []
  for i, ids in enumerate(prompt_ids):
    for s in range(cfg.num_samples):
      sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                          max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos,
                          seed=(cfg.seed * 1_000_003 + len(reqs)) & 0x7FFFFFFF)
      reqs.append(Request(list(ids), sp, (i, s)))
  longest = max(len(r.prompt_ids) for r in reqs)
  max_len = -(-(longest + cfg.max_new_tokens + 1) // cfg.page_size) * cfg.page_size
  if max_len > model.cfg.max_position_embeddings:
    raise ValueError(f"max_new_tokens={cfg.max_new_tokens} + longest prompt {longest} exceeds "
                     f"the model's max_position_embeddings={model.cfg.max_position_embeddings}")
  done = read_journal(journal, len(reqs)) if journal else {}
  todo = [j for j in range(len(reqs)) if j not in done]
  if done and log is not None:
    log(f"resuming generation: {len(done)} of {len(reqs)} trajectories already in {journal}")
  if todo:
    k = cfg.actor_budget
    attention = cfg.attention(k) if k > 0 else attn_lib.Dense()
    slots = min(cfg.num_slots, len(todo))
    engine = GenerationEngine(
        model, EngineConfig(num_slots=slots, max_seq_len=max_len, page_size=cfg.page_size,
                            decode_chunk=cfg.decode_chunk),
        attention=attention, schedule=k if k > 0 else None)
    steps = -(-len(todo) // slots) * -(-cfg.max_new_tokens // cfg.decode_chunk)
    bar = tqdm(total=steps, desc=f"generate (actor {k or 'dense'} pages)", unit="chunk",
               disable=not progress)
    out = open(journal, "a") if journal else None
    try:
      def finished(i_todo: int, c) -> None:  # written (and flushed) as each one finishes
        j = todo[i_todo]
        done[j] = ([int(t) for t in c.token_ids], [float(x) for x in c.logprobs],
                   c.finish_reason)
        if out is not None:
          out.write(json.dumps({"i": j, "tokens": done[j][0], "logprobs": done[j][1],
                                "finish": done[j][2]}) + "\n")
          out.flush()

      engine.generate([reqs[j] for j in todo], progress=lambda d, t: bar.update(1),
                      on_finish=finished)
    finally:
      bar.close()
      if out is not None:
        out.close()
  n = len(reqs)
  lengths = np.asarray([len(reqs[j].prompt_ids) + len(done[j][0]) for j in range(n)], np.int32)
  tokens = np.zeros((n, int(lengths.max())), np.int32)
  logprobs = np.zeros((n, int(lengths.max())), np.float32)
  for j in range(n):
    p = len(reqs[j].prompt_ids)
    tokens[j, :p] = reqs[j].prompt_ids
    tokens[j, p:lengths[j]] = done[j][0]
    logprobs[j, p:lengths[j]] = done[j][1]
  return Trajectories(tokens=tokens, lengths=lengths,
                      prompt_lengths=np.asarray([len(r.prompt_ids) for r in reqs], np.int32),
                      prompt_index=np.asarray([r.request_id[0] for r in reqs], np.int32),
                      finish_reasons=[done[j][2] for j in range(n)], logprobs=logprobs)
