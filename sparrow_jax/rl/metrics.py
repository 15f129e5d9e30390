"""Training metrics: a progress bar, one console line per step, a JSONL file, TensorBoard
scalars, and at the end a summary plus a PNG of reward and response length over steps.

The JSONL file is appended to (never truncated), so a resumed run continues the same file;
`read_jsonl` returns the last record of each step, which is what a resume comparison wants.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Mapping

import numpy as np

_CONSOLE_KEYS = ("reward/mean", "response/len_mean", "loss/policy", "grad_norm",
                 "mismatch/p5_overall", "distill/loss", "time/step_s")


def _scalar(v) -> float | int | str | None:
  if isinstance(v, (str, bool)) or v is None:
    return v
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return str(v)
  return f if math.isfinite(f) else str(f)


class MetricsLogger:
  def __init__(self, out_dir: str, *, total_steps: int, tensorboard: bool = True,
               start_step: int = 0, quiet: bool = False):
    os.makedirs(out_dir, exist_ok=True)
    self.out_dir = out_dir
    self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
    self.quiet = quiet
    self.history: list[dict[str, Any]] = []
    if start_step > 0 and os.path.exists(self.jsonl_path):  # resumed: keep the earlier steps
      self.history = [r for s, r in sorted(read_jsonl(self.jsonl_path).items())
                      if s <= start_step]
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(out_dir, "tb"))
      except ImportError:  # optional dependency
        print("tensorboardX not installed: TensorBoard logging off", file=sys.stderr)
    self._bar = None
    if not quiet:
      try:
        from tqdm import tqdm
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, file=sys.stderr)
      except ImportError:
        pass

  def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    rec = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self.history.append(rec)
    with open(self.jsonl_path, "a") as f:
      f.write(json.dumps(rec) + "\n")
    if self._tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    if not self.quiet:
      parts = [f"step {step}"]
      for k in _CONSOLE_KEYS:
        if isinstance(rec.get(k), float):
          parts.append(f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}="
                       f"{rec[k]:.4g}")
      line = "  ".join(parts)
      if self._bar is not None:
        self._bar.update(1)
        self._bar.write(line)
      else:
        print(line, flush=True)
    return rec

  def event(self, message: str) -> None:
    """A notable event (schedule switch, skipped step, warning) on the console."""
    if self._bar is not None:
      self._bar.write(message)
    elif not self.quiet:
      print(message, flush=True)

  def close(self) -> dict[str, Any]:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    summary = summarize(self.history)
    with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    plot_history(self.history, os.path.join(self.out_dir, "training.png"))
    return summary


def read_jsonl(path: str) -> dict[int, dict[str, Any]]:
  out: dict[int, dict[str, Any]] = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        rec = json.loads(line)
        out[int(rec["step"])] = rec
  return out


def summarize(history: list[Mapping[str, Any]], window: int = 3) -> dict[str, Any]:
  rl = [h for h in history if isinstance(h.get("reward/mean"), float)]
  if not rl:
    return {"steps": 0}
  first = [h["reward/mean"] for h in rl[:window]]
  last = [h["reward/mean"] for h in rl[-window:]]
  return {
      "steps": len(rl), "first_step": rl[0]["step"], "last_step": rl[-1]["step"],
      "reward_first_mean": float(np.mean(first)), "reward_last_mean": float(np.mean(last)),
      "reward_gain": float(np.mean(last) - np.mean(first)),
      "response_len_last": rl[-1].get("response/len_mean"),
      "generated_tokens": int(sum(h.get("rollout/tokens", 0) or 0 for h in rl)),
      "compilations_last": rl[-1].get("compilations"),
  }


def plot_history(history: list[Mapping[str, Any]], path: str) -> None:
  rl = [h for h in history if isinstance(h.get("reward/mean"), float)]
  if not rl:
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [h["step"] for h in rl]
  fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
  ax[0].plot(steps, [h["reward/mean"] for h in rl], marker="o")
  ax[0].set_xlabel("step")
  ax[0].set_ylabel("mean reward")
  ax[0].grid(alpha=0.3)
  ax[1].plot(steps, [h.get("response/len_mean", float("nan")) for h in rl], marker="o",
             color="tab:orange")
  ax[1].set_xlabel("step")
  ax[1].set_ylabel("mean response length (tokens)")
  ax[1].grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
