"""ARRoL study on CPU: quality-head pruning vs random pruning vs no pruning, same seeds.

    python experiments/arrol_study.py --out docs/figures/arrol_tiny            # ~5-10 minutes
    python experiments/arrol_study.py --steps 20 --out /tmp/arrol_quick --keys num_steps=20

The task is the tiny preset (random-init Qwen3 + byte tokenizer, supervised warm start on
single-digit addition, then GRPO on block-sparse rollouts with DistillSparse): the response is
the answer digits then EOS, so the first generated token already says much about correctness
(`arrol_detect_len=1`), the setting where the paper finds early detection reliable. Three runs
differ only in `arrol` / `arrol_mode`; warm start, data order and sampling seeds are the same,
so their first `arrol_warmup_steps` steps are identical (no pruning during warm-up).

Reported per run over the steps after warm-up (the paper's Tables 4 and 5): E[rho_hat] and
E[rho_hat (1 - rho_hat)] over groups (rollouts with reward > 0 among the kept ones of a prompt),
head accuracy and AUC (scores taken before each head update: held out), kept fraction, tokens
generated, seconds of rollout / recompute / update / distill per step, mean reward; plus the
reward curves. Writes OUT.json, OUT.md (a markdown section) and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VARIANTS = {"none": ["arrol=false"], "head": ["arrol=true", "arrol_mode=head"],
            "random": ["arrol=true", "arrol_mode=random"]}
BASE = ["arrol_detect_len=1", "arrol_warmup_steps=10", "tensorboard=false", "save_every=0",
        "sample_every=0"]


def run_variant(name: str, keys: list[str], out_dir: str) -> list[dict]:
  from sparrow_jax.rl.config import get_train_config
  from sparrow_jax.rl.metrics import read_jsonl
  from sparrow_jax.rl.trainer import Trainer

  cfg = get_train_config("tiny", BASE + VARIANTS[name] + keys + [f"out_dir={out_dir}/{name}"])
  t0 = time.perf_counter()
  tr = Trainer(cfg, quiet=True)
  tr.fit()
  recs = read_jsonl(os.path.join(out_dir, name, "metrics.jsonl"))
  print(f"{name}: {len(recs)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
  return [recs[s] for s in sorted(recs)]


def _mean(recs, key):
  vals = [r[key] for r in recs if key in r and r[key] == r[key]]  # skip NaN
  return statistics.fmean(vals) if vals else float("nan")


def summarize(runs: dict[str, list[dict]], warmup: int) -> dict[str, dict]:
  out = {}
  for name, recs in runs.items():
    after = [r for r in recs if r["step"] > warmup] if recs and "step" in recs[0] else \
        recs[warmup:]
    row = {"steps_after_warmup": len(after),
           "reward_mean": _mean(after, "reward/mean"),
           "reward_last10": _mean(recs[-10:], "reward/mean"),
           "tokens_per_step": _mean(after, "rollout/tokens"),
           "rollout_s": _mean(after, "time/rollout_s"),
           "recompute_s": _mean(after, "time/recompute_s"),
           "update_s": _mean(after, "time/update_s"),
           "distill_s": _mean(after, "time/distill_s"),
           "step_s": _mean(after, "time/step_s")}
    row["kept_frac"] = _mean(after, "arrol/kept_frac") if name != "none" else 1.0
    for key in ("reward/rho_hat_mean", "reward/rho_hat_var", "arrol/head_acc",
                "arrol/head_auc"):
      row[key.split("/")[1]] = _mean(after, key)
    out[name] = row
  return out


def markdown(summary: dict, meta: dict) -> str:
  cols = [("reward_mean", "reward (after warm-up)"), ("reward_last10", "reward (last 10)"),
          ("kept_frac", "kept"), ("rho_hat_mean", "E[rho_hat]"),
          ("rho_hat_var", "E[rho_hat(1-rho_hat)]"), ("head_acc", "head acc"),
          ("head_auc", "head AUC"), ("tokens_per_step", "tokens/step"),
          ("rollout_s", "rollout s"), ("recompute_s", "recompute s"), ("update_s", "update s"),
          ("distill_s", "distill s"), ("step_s", "step s")]
  lines = [f"| run | {' | '.join(c[1] for c in cols)} |",
           "|---|" + "---|" * len(cols)]
  for name, row in summary.items():
    cells = []
    for key, _ in cols:
      v = row.get(key, float("nan"))
      cells.append("–" if v != v else (f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"))
    lines.append(f"| {name} | {' | '.join(cells)} |")
  return (f"Runs: {meta['steps']} steps of the tiny preset ({meta['date']}, jax "
          f"{meta['jax']}, {meta['cpus']} CPUs), arrol_detect_len=1, warm-up "
          f"{meta['warmup']} steps; means over the steps after warm-up.\n\n" + "\n".join(lines))


def plot(runs: dict[str, list[dict]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for name, recs in runs.items():
    steps = list(range(1, len(recs) + 1))
    axes[0].plot(steps, [r["reward/mean"] for r in recs], label=name)
    axes[1].plot(steps, [r["rollout/tokens"] for r in recs], label=name)
  axes[0].set(xlabel="step", ylabel="mean reward (scored rollouts)")
  axes[1].set(xlabel="step", ylabel="tokens generated")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="output prefix (OUT.json, OUT.md, OUT.png)")
  ap.add_argument("--variants", default="none,head,random")
  ap.add_argument("--keys", nargs="*", default=[], help="extra key=value config overrides")
  args = ap.parse_args(argv)
  import jax

  from sparrow_jax.rl.config import get_train_config
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [n for n in names if n not in VARIANTS]
  if bad:
    print(f"error: --variants {bad}: expected among {list(VARIANTS)}", file=sys.stderr)
    return 2
  cfg = get_train_config("tiny", BASE + args.keys)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  work = args.out + "_runs"
  runs = {n: run_variant(n, args.keys, work) for n in names}
  summary = summarize(runs, cfg.arrol_warmup_steps)
  meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "cpus": os.cpu_count(),
          "steps": cfg.num_steps, "warmup": cfg.arrol_warmup_steps, "keys": args.keys}
  with open(args.out + ".json", "w") as f:
    json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1, default=float)
  md = markdown(summary, meta)
  with open(args.out + ".md", "w") as f:
    f.write(md + "\n")
  plot(runs, args.out + ".png")
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
