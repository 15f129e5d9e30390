"""Training metrics: a progress bar, one console line per step, a JSONL file, TensorBoard
scalars, optional Weights & Biases, and at the end a summary plus a PNG of reward and response
length over steps.

`metrics.jsonl` holds one record per step. A run that starts at step s (0 for a fresh run, the
checkpoint's step when resumed) first rewrites the file to the records of steps <= s, so the
steps it redoes replace their old lines instead of being appended twice; `samples.jsonl`
(completions logged every `sample_every` steps) is treated the same way, and TensorBoard
events after s are purged. `read_jsonl` returns the last record of each step.

TensorBoard tags are the metric names exactly as in metrics.jsonl (`val/avg@4`, not the
`val/avg_4` tensorboardX would make of it: its add_scalar replaces characters that TF 1 node
names could not hold, which TensorBoard tags can).

The progress bar names what runs (`phase("warm start")`, `phase("compiling")`, ...): the
warm start and the first compilation take most of a short run's first minute.

Weights & Biases (`loggers` containing "wandb") is optional: the package is imported only
then, the run id is kept in `wandb_run_id` so a resumed run continues the same wandb run, and
wandb's own settings (`WANDB_MODE=offline`, ...) apply.
"""

from __future__ import annotations

import json
import logging
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


def _truncate_jsonl(path: str, last_step: int, *, one_per_step: bool) -> list[dict[str, Any]]:
  """Keep the records of steps <= last_step (the last one per step if `one_per_step`);
  rewrite the file atomically when that drops anything. Returns the kept records."""
  if not os.path.exists(path):
    return []
  recs = []
  with open(path) as f:
    lines = [ln for ln in f if ln.strip()]
  for ln in lines:
    try:
      recs.append(json.loads(ln))
    except json.JSONDecodeError:  # a line cut by a crash: it belongs to a step being redone
      continue
  keep = [r for r in recs if isinstance(r, dict) and isinstance(r.get("step"), int)
          and r["step"] <= last_step]
  if one_per_step:
    keep = sorted({r["step"]: r for r in keep}.values(), key=lambda r: r["step"])
  if len(keep) != len(lines):
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(path + ".tmp", path)
  return keep


class MetricsLogger:
  def __init__(self, out_dir: str, *, total_steps: int, tensorboard: bool = True,
               start_step: int = 0, quiet: bool = False,
               loggers: tuple[str, ...] | None = None, run_config: dict | None = None,
               wandb_project: str = "sparrow_jax", writer: bool = True):
    """`loggers` (default: ("tensorboard",) if `tensorboard` else ()) names the backends
    beside the console and the JSONL files: "tensorboard", "wandb". `writer=False` (every
    process but 0 of a multi-host run): nothing is written or printed, the history is kept
    (`close` still returns the summary)."""
    self.out_dir = out_dir
    self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
    self.samples_path = os.path.join(out_dir, "samples.jsonl")
    self.writer = writer
    self.quiet = quiet or not writer
    loggers = tuple(loggers) if loggers is not None else (("tensorboard",) if tensorboard
                                                          else ())
    if not writer:  # (the summary of a non-writer covers the steps it ran)
      loggers = ()
      self.history: list[dict[str, Any]] = []
    else:
      os.makedirs(out_dir, exist_ok=True)
      # Steps after `start_step` are (re)done by this run: their old lines go.
      self.history: list[dict[str, Any]] = _truncate_jsonl(self.jsonl_path, start_step,
                                                           one_per_step=True)
      _truncate_jsonl(self.samples_path, start_step, one_per_step=False)
    self._tb = None
    if "tensorboard" in loggers:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=start_step + 1)
      except ImportError:  # optional dependency
        print("tensorboardX not installed: TensorBoard logging off", file=sys.stderr)
    self._wandb = None
    if "wandb" in loggers:
      self._wandb = _start_wandb(out_dir, wandb_project, run_config)
    self._bar = None
    self.current_phase: str | None = None
    if not self.quiet:
      try:
        from tqdm import tqdm
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, file=sys.stderr)
      except ImportError:
        pass
    self._log_route = _route_logs_around(self._bar) if self._bar is not None else None

  def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    rec = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self.history.append(rec)
    if not self.writer:
      return rec
    with open(self.jsonl_path, "a") as f:
      f.write(json.dumps(rec) + "\n")
    if self._tb is not None:
      _tb_scalars(self._tb, {k: v for k, v in rec.items() if k != "step" and
                             isinstance(v, (int, float)) and not isinstance(v, bool)}, step)
      self._tb.flush()
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in rec.items() if k != "step" and v is not None
                       and (isinstance(v, (int, float)) or isinstance(v, str))}, step=int(step))
    if not self.quiet:
      parts = [f"step {step}"]
      for k in _CONSOLE_KEYS:
        if isinstance(rec.get(k), float):
          parts.append(f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}="
                       f"{rec[k]:.4g}")
      parts += [f"{k}={v:.4g}" for k, v in rec.items()  # validation steps only
                if (k.startswith("val/avg@") or k == "val/alpha_p5") and isinstance(v, float)]
      line = "  ".join(parts)
      if self._bar is not None:
        self._bar.update(1)
        self._bar.write(line)
      else:
        print(line, flush=True)
    return rec

  def samples(self, step: int, rows: list[Mapping[str, Any]]) -> None:
    """A few completions of step `step` (dicts of prompt, response, reward, ...)."""
    if not self.writer:
      return
    with open(self.samples_path, "a") as f:
      for r in rows:
        f.write(json.dumps({"step": int(step), **r}) + "\n")
    if not rows:
      return
    cols = list(rows[0])
    if self._tb is not None:
      def cell(v):
        return str(v).replace("|", "\\|").replace("\n", "<br>")
      table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
      table += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
      self._tb.add_text("samples", "\n".join(table), step)
      self._tb.flush()
    if self._wandb is not None:
      import wandb
      self._wandb.log({"samples": wandb.Table(columns=cols,
                                              data=[[r.get(c) for c in cols] for r in rows])},
                      step=int(step))

  def phase(self, name: str) -> None:
    """Name what the run is doing now in the progress bar ("warm start", "compiling",
    "rollout/update"); without a bar (tqdm missing) it is printed as a line, once per
    change; quiet runs say nothing."""
    if name == self.current_phase:
      return
    self.current_phase = name
    if self._bar is not None:
      self._bar.set_description(f"train [{name}]")
    elif not self.quiet:
      print(f"[{name}]", file=sys.stderr, flush=True)

  def event(self, message: str) -> None:
    """A notable event (schedule switch, skipped step, warning) on the console."""
    if self._bar is not None:
      self._bar.write(message)
    elif not self.quiet:
      print(message, flush=True)

  def release_logs(self) -> None:
    """Give the package's log records back to their usual handlers (closing does this; a run
    that stops with an exception calls it directly)."""
    if self._log_route is not None:
      self._log_route()
      self._log_route = None

  def close(self) -> dict[str, Any]:
    self.release_logs()
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
    summary = summarize(self.history)
    if not self.writer:
      return summary
    with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    plot_history(self.history, os.path.join(self.out_dir, "training.png"))
    return summary


class _BarHandler(logging.Handler):
  """Writes log records above the progress bar (a plain stderr write would glue the record to
  the bar's line)."""

  def __init__(self, bar):
    super().__init__()
    self.bar = bar
    self.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))

  def emit(self, record: logging.LogRecord) -> None:
    try:
      self.bar.write(self.format(record), file=sys.stderr)
    except Exception:  # logging must never break the run
      self.handleError(record)


def _route_logs_around(bar):
  """While the bar is up, the package's log records (the mismatch monitor's warning, ...) go
  through it; returns the function that undoes this."""
  log = logging.getLogger("sparrow_jax")
  propagate = log.propagate
  for old in [h for h in log.handlers if isinstance(h, _BarHandler)]:
    log.removeHandler(old)  # left by a run that died without closing its logger
    propagate = old.saved_propagate
  handler = _BarHandler(bar)  # (level NOTSET: what the logger's level lets through)
  handler.saved_propagate = propagate
  log.addHandler(handler)
  log.propagate = False

  def undo():
    if handler in log.handlers:
      log.removeHandler(handler)
      log.propagate = propagate
  return undo


def _tb_scalars(writer, values: Mapping[str, float], step: int) -> None:
  """Scalars under their own names (see the module docstring): the summary proto is written
  directly, since `add_scalar` would rename `val/avg@4` to `val/avg_4`."""
  from tensorboardX.proto.summary_pb2 import Summary
  summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v))
                           for k, v in values.items()])
  writer._get_file_writer().add_summary(summary, step)


def _start_wandb(out_dir: str, project: str, run_config: dict | None):
  """A wandb run for `out_dir`; the same run again when `out_dir` was logged before."""
  import wandb  # optional: only imported when asked for

  id_path = os.path.join(out_dir, "wandb_run_id")
  run_id = None
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip() or None
  run = wandb.init(project=project, name=os.path.basename(os.path.abspath(out_dir)),
                   dir=out_dir, config=run_config or {}, id=run_id, resume="allow")
  with open(id_path, "w") as f:
    f.write(str(run.id) + "\n")
  return run


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
      # Steps whose mismatch monitor found a position bin with p5 below tau (see rl/monitor).
      **({"steps_below_tau": sum(1 for h in rl if (h.get("mismatch/bins_below_tau") or 0) > 0)}
         if any("mismatch/bins_below_tau" in h for h in rl) else {}),
      # Groups whose rewards were all equal (no GRPO signal), over the run (run/signal_check).
      **({"zero_variance_groups": int(sum(h.get("reward/zero_variance_groups") or 0
                                          for h in rl))}
         if any("reward/zero_variance_groups" in h for h in rl) else {}),
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
