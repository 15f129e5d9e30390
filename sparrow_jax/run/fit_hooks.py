"""What the training loop does around each RL step, beside the step itself.

  StopSignals         SIGINT/SIGTERM during `Trainer.fit`: the first signal lets the step in
                      flight finish, then the loop saves a checkpoint and stops
                      (TrainingInterrupted; the CLI exits 130 and says how to resume). A second
                      signal stops at once, without saving. Stopping mid-step is avoided on
                      purpose: the jitted update donates the old parameters, so a half-done
                      step has nothing consistent to save.
  validation_metrics  every `val_every` steps and at the last step: avg@k, pass@k (maj@k)
                      and the sparse actor's tail acceptance rate (p5 of alpha_t) on the
                      held-out `val_data` prompts, as `val/*` fields of that step's record.
                      Sampling seeds are fixed, so successive validations are comparable.
  sample_rows         every `sample_every` steps, a few (prompt, response, reward) of the
                      step's rollout for samples.jsonl / TensorBoard text / wandb.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.run.evaluate import evaluate


class StopSignals:
  """Context manager owning SIGINT/SIGTERM while training (main thread only; inert in other
  threads, where Python cannot install handlers). `signame` is set by the first signal."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, say: Callable[[str], None]):
    self.say = say
    self.signame: str | None = None
    self.step: int | None = None  # the step in flight, for the message
    self._old: dict = {}

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.signame is not None:
      self.__exit__()
      raise KeyboardInterrupt(f"second {name}: stopped without saving")
    self.signame = name
    what = (f"finishing step {self.step}, then saving a checkpoint"
            if self.step is not None else "saving a checkpoint")
    self.say(f"{name} received: {what} (send it again to stop at once without saving)")

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}


def validation_metrics(trainer) -> dict[str, Any]:
  """`val/*` metrics of `trainer` at its current step, or {} when no validation is due."""
  cfg = trainer.cfg
  if not trainer.val_examples:
    return {}
  step = trainer.step
  if not (step == cfg.num_steps or (cfg.val_every and step % cfg.val_every == 0)):
    return {}
  t0 = time.perf_counter()
  res = evaluate(trainer, trainer.val_examples, k=cfg.val_k, mode=trainer.rollout_mode(),
                 temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
  out = {"val/" + k.split("/", 1)[1]: v for k, v in res.items()
         if isinstance(v, (int, float)) and not isinstance(v, bool)}
  out["val/time_s"] = time.perf_counter() - t0
  return out


def prompt_text(example) -> str:
  """A prompt as one string (chat messages as `role: content` lines)."""
  if isinstance(example.prompt, str):
    return example.prompt
  return "\n".join(f"{m['role']}: {m['content']}" for m in example.prompt)


def response_text(tokenizer, ids) -> str:
  """A response as logged in samples.jsonl: with the byte tokenizer, bytes that form no UTF-8
  character show as `\\xNN` escapes (a lone U+FFFD says nothing about what was sampled);
  other tokenizers decode as usual."""
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.decode(ids, skip_special_tokens=True, errors="backslashreplace")
  return tokenizer.decode(ids, skip_special_tokens=True)


def sample_rows(trainer) -> list[dict[str, Any]]:
  """Up to `samples_per_log` completions of the latest rollout when one is due, else []."""
  cfg = trainer.cfg
  if not cfg.sample_every or trainer.step % cfg.sample_every or trainer.last_rollout is None:
    return []
  examples, comps, rewards = trainer.last_rollout
  # One completion of each of the first prompts before a second of any: variety first.
  order = sorted(range(len(comps)), key=lambda j: (comps[j].request_id[1],
                                                   comps[j].request_id[0]))
  rows = []
  for j in order[:cfg.samples_per_log]:
    e = examples[j]  # the prompt example of completion j
    rows.append({"prompt": prompt_text(e), "answer": e.answer,
                 "response": response_text(trainer.tokenizer, comps[j].token_ids),
                 "reward": float(rewards[j]), "finish": comps[j].finish_reason})
  return rows
