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
            "random": ["arrol=true", "arrol_mode=random"],
            "head_signed": ["arrol=true", "arrol_mode=head", "arrol_steer=signed"]}
EVAL_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arith_eval.jsonl")
BASE = ["arrol_detect_len=1", "arrol_warmup_steps=10", "tensorboard=false", "save_every=0",
        "sample_every=0"]


def run_variant(name: str, seed: int, keys: list[str], out_dir: str, k: int):
  """Train one variant, then evaluate the final policy on the held-out sums (dense rollouts,
  k samples per prompt). Returns (per-step records, held-out metrics)."""
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.evaluate import evaluate
  from sparrow_jax.run.metrics import read_jsonl
  from sparrow_jax.run.builders import build_examples, fit_prompts
  from sparrow_jax.run.trainer import Trainer

  run_dir = f"{out_dir}/{name}_s{seed}"
  cfg = get_train_config("tiny", BASE + VARIANTS[name] + keys + [f"seed={seed}",
                                                                 f"out_dir={run_dir}"])
  t0 = time.perf_counter()
  tr = Trainer(cfg, quiet=True)
  tr.fit()
  recs = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  held = fit_prompts(tr.tokenizer, build_examples(cfg.replace(data=EVAL_DATA)), cfg, "eval")
  ev = evaluate(tr, held, k=k, mode="dense", seed=1000 + seed)
  print(f"{name} seed {seed}: {len(recs)} steps in {time.perf_counter() - t0:.0f} s, held-out "
        f"avg@{k} {ev[f'eval/avg@{k}']:.3f}", flush=True)
  return [recs[s] for s in sorted(recs)], ev


def _vals(recs, key):
  return [r[key] for r in recs if key in r and r[key] == r[key]]  # skip NaN


def _mean(recs, key):
  vals = _vals(recs, key)
  return statistics.fmean(vals) if vals else float("nan")


def _median(recs, key):
  vals = _vals(recs, key)
  return statistics.median(vals) if vals else float("nan")


def summarize(runs: dict, evals: dict, warmup: int, k: int) -> dict[str, dict]:
  """Per variant, averaged over seeds: means over the steps after warm-up (timings: medians,
  so that the steps that compile a new batch shape do not dominate)."""
  out = {}
  for name, per_seed in runs.items():
    rows = []
    for seed, recs in per_seed.items():
      after = recs[warmup:]
      row = {"reward_mean": _mean(after, "reward/mean"),
             "heldout_avg": evals[name][seed][f"eval/avg@{k}"],
             "heldout_pass": evals[name][seed][f"eval/pass@{k}"],
             "tokens_per_step": _mean(after, "rollout/tokens"),
             "kept_frac": _mean(after, "arrol/kept_frac") if name != "none" else 1.0}
      for key in ("time/rollout_s", "time/recompute_s", "time/update_s", "time/distill_s",
                  "time/step_s"):
        row[key.split("/")[1]] = _median(after, key)
      for key in ("reward/rho_hat_mean", "reward/rho_hat_var", "arrol/head_acc",
                  "arrol/head_auc"):
        row[key.split("/")[1]] = _mean(after, key)
      rows.append(row)
    out[name] = {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
    out[name]["per_seed_heldout_avg"] = [r["heldout_avg"] for r in rows]
  return out


def simulate_rules(groups: int = 4000, size: int = 8, seed: int = 0) -> dict:
  """The survival rules on synthetic groups with accurate q (q_i ~ Beta, y_i ~ Bernoulli(q_i)),
  kappa = rho = 0.5, lambda = 0.5, p in [0.25, 0.75]: (E[rho_hat], E[rho_hat (1 - rho_hat)]) of
  the kept rollouts for random pruning, the paper's rule and the signed rule."""
  import numpy as np

  from sparrow_jax.rl.arrol_math import survival_probabilities
  rng = np.random.default_rng(seed)
  out = {}
  for name, (a, b) in {"easy Beta(2.5,0.8)": (2.5, 0.8), "hard Beta(0.8,2.5)": (0.8, 2.5),
                       "balanced Beta(0.3,0.3)": (0.3, 0.3)}.items():
    row = {}
    for rule in ("random", "paper", "signed"):
      rho = []
      for _ in range(groups):
        q = rng.beta(a, b, size)
        y = rng.random(size) < q
        p = (np.full(size, 0.5) if rule == "random" else survival_probabilities(
            q, keep_rate=0.5, target=0.5, lam=0.5, p_min=0.25, p_max=0.75, steer=rule)[0])
        keep = rng.random(size) < p
        if keep.any():
          rho.append(y[keep].mean())
      rho = np.asarray(rho)
      row[rule] = (float(rho.mean()), float((rho * (1 - rho)).mean()))
    out[name] = row
  return out


def markdown(summary: dict, meta: dict) -> str:
  cols = [("heldout_avg", f"held-out avg@{meta['k']}"),
          ("heldout_pass", f"held-out pass@{meta['k']}"),
          ("reward_mean", "train reward (kept)"),
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
  return (f"Runs: {meta['steps']} steps of the tiny preset, seeds {meta['seeds']} "
          f"({meta['date']}, jax {meta['jax']}, {meta['cpus']} CPUs), arrol_detect_len=1, "
          f"warm-up {meta['warmup']} steps; means over the steps after warm-up and over seeds "
          f"(timings: per-step medians, in seconds); held-out: the final policy on "
          f"experiments/data/arith_eval.jsonl, dense rollouts, {meta['k']} samples per "
          f"prompt.\n\n" + "\n".join(lines))


def plot(runs: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for name, per_seed in runs.items():
    recs = next(iter(per_seed.values()))  # the first seed
    steps = list(range(1, len(recs) + 1))
    axes[0].plot(steps, [r["reward/mean"] for r in recs], label=name)
    axes[1].plot(steps, [r.get("reward/rho_hat_var", float("nan")) for r in recs], label=name)
  axes[0].set(xlabel="step", ylabel="mean reward (scored rollouts)")
  axes[1].set(xlabel="step", ylabel="E[rho_hat (1 - rho_hat)]")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="output prefix (OUT.json, OUT.md, OUT.png)")
  ap.add_argument("--variants", default="none,head,random,head_signed")
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--k", type=int, default=4, help="held-out samples per prompt")
  ap.add_argument("--keys", nargs="*", default=[], help="extra key=value config overrides")
  ap.add_argument("--work", default="runs/arrol_study", help="run folders (checkpoints)")
  args = ap.parse_args(argv)
  import jax

  from sparrow_jax.run.config import get_train_config
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [n for n in names if n not in VARIANTS]
  if bad:
    print(f"error: --variants {bad}: expected among {list(VARIANTS)}", file=sys.stderr)
    return 2
  cfg = get_train_config("tiny", BASE + args.keys)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  work = args.work
  seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
  runs, evals = {n: {} for n in names}, {n: {} for n in names}
  for seed in seeds:
    for n in names:
      runs[n][seed], evals[n][seed] = run_variant(n, seed, args.keys, work, args.k)
  summary = summarize(runs, evals, cfg.arrol_warmup_steps, args.k)
  meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "cpus": os.cpu_count(),
          "steps": cfg.num_steps, "warmup": cfg.arrol_warmup_steps, "keys": args.keys,
          "seeds": seeds, "k": args.k}
  sim = simulate_rules()
  with open(args.out + ".json", "w") as f:
    keep = ("reward/mean", "reward/rho_hat_mean", "reward/rho_hat_var", "rollout/tokens",
            "arrol/kept_frac", "arrol/head_acc", "arrol/head_auc", "arrol/delta",
            "time/rollout_s", "time/recompute_s", "time/update_s", "time/step_s")
    curves = {n: {sd: [{k: r[k] for k in keep if k in r} for r in recs]
                  for sd, recs in per.items()} for n, per in runs.items()}
    json.dump({"meta": meta, "summary": summary, "evals": evals, "curves": curves,
               "simulated_rules": sim}, f, indent=1, default=float)
  md = markdown(summary, meta) + "\n\nSurvival rules on synthetic groups (accurate q, 8 per " \
      "group, 4,000 groups), (E[rho_hat], E[rho_hat(1-rho_hat)]):\n\n| groups | random | " \
      "paper | signed |\n|---|---|---|---|\n" + "\n".join(
          f"| {g} | " + " | ".join(f"{r[k][0]:.3f}, {r[k][1]:.3f}" for k in
                                   ("random", "paper", "signed")) + " |"
          for g, r in sim.items())
  with open(args.out + ".md", "w") as f:
    f.write(md + "\n")
  plot(runs, args.out + ".png")
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
