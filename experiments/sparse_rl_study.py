"""Sparse-rollout RL on a real model (issue 20): dense rollouts vs a tau-calibrated schedule vs
an aggressive constant budget, with and without DistillSparse, same seeds and data order.

    python experiments/sparse_rl_study.py --precheck                 # start model's avg@4
    python experiments/sparse_rl_study.py --arms dense,aggressive --seeds 0,1   # run/resume
    python experiments/sparse_rl_study.py --calibrate                # the tau arm's schedule
    python experiments/sparse_rl_study.py --arms tau                 # ... used by default
    python experiments/sparse_rl_study.py --calibrate --arms tau_margin   # at tau + 0.02
    python experiments/sparse_rl_study.py --report                   # docs/sparse_rl_study.md

Model and task: the `smollm2_135m_study` preset (SmolLM2-135M-Instruct from the shipped GGUF,
boxed arithmetic with the chat template, responses of up to 256 tokens = 16 pages).

Arms (`ARMS`): `dense` (schedule=dense); `tau` (a schedule calibrated on this model at
tau=0.86: `--calibrate` runs experiments/calibrate.py on the first `--calib-prompts` training
prompts of seed 0 with the run's page size, bin size, dense layers and response length, into
RUNS/calib/schedule.json, which the arm then uses unless `--tau-schedule` names another);
`tau_margin` (the same calibration at tau + `--calib-margin`, default 0.02, into
RUNS/calib_margin: `--calibrate --arms tau_margin`; the arm trains and is judged at tau, so
the margin is headroom for bins the calibration left at tau exactly);
`aggressive` (`--aggressive`, default constant:2, whose p5 lies well under tau at these
lengths); `aggressive_distill` (the same with DistillSparse); and `CORRECTION_ARMS`, e.g.
`aggressive_sparse_rl`: a base arm plus rollout-correction keys (docs/rollout_correction.md).
Every arm of a seed trains from the same start on the same prompts in the same order (the data
order and request seeds follow the run seed).

Each (arm, seed) trains into RUNS/ARM_sSEED with `experiments/train.py` in a subprocess
(a checkpoint every 2 steps, the last 2 kept; a run that stopped is continued with --resume, so an
arm can be split across sessions), then its final policy is scored on the held-out problems
(`heldout.jsonl` in RUNS: `--heldout` problems drawn with another seed, none among the
training prompts of seeds 0-9 or of any seed given; checked again before each arm) with k=4
dense samples each; the sparse arms also report the exact alpha
tail of their own sparse actor on those rollouts. Per step the run logs reward, response
length and clip ratio, the monitor's top-k lower bound of p5 per position bin, the exact p5
per bin on the step's first `exact_alpha_rows` rollouts (`exact_alpha_every=1`: teacher-
forced, dense policy vs the sparse actor that sampled), TIS statistics and time per phase.

Results: OUT/ARM_sSEED.json with `arm`, `seed`, `heldout_avg4_before`, `heldout_avg4_after`,
`heldout_pass4_before/after`, `rollout_s_per_step` (median), `p5_exact_min`, `p5_exact_mean`,
`p5_bound_min` and the per-step series; `--report` turns every JSON of OUT into
docs/sparse_rl_study.md's table and figures. `--preset tiny` runs the same machinery on the
tiny preset in minutes (what the test does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from sparrow_jax.rl.corrections import PRESETS as CORRECTION_PRESETS  # noqa: E402

# Arms with a rollout correction (issue 48; docs/rollout_correction.md): a base arm plus one
# dict of correction keys, e.g. `aggressive_sparse_rl` = the aggressive schedule with
# Sparse-RL's correction. A new arm is one entry: name -> (base arm, {key: value}).
CORRECTION_ARMS: dict[str, tuple[str, dict]] = {
    f"{base}_{name}": (base, keys) for base in ("aggressive", "aggressive_distill")
    for name, keys in CORRECTION_PRESETS.items()}
ARMS = ("dense", "tau", "tau_margin", "aggressive", "aggressive_distill") + tuple(CORRECTION_ARMS)
# The calibrated arms: RUNS/<dir>/schedule.json unless the flag names another file.
CALIB_DIRS = {"tau": "calib", "tau_margin": "calib_margin"}
CALIB_FLAGS = {"tau": "--tau-schedule", "tau_margin": "--tau-margin-schedule"}
# Per-step logging the study reads; checkpoints often enough that a stopped arm loses little.
BASE = ["exact_alpha_every=1", "tensorboard=false", "sample_every=0", "save_every=2",
        "keep_last=2"]


def _key_value(key: str, value) -> str:
  return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


def arm_overrides(arm: str, args) -> list[str]:
  if arm in CORRECTION_ARMS:
    base, keys = CORRECTION_ARMS[arm]
    return arm_overrides(base, args) + [_key_value(k, v) for k, v in keys.items()]
  if arm == "dense":
    return ["schedule=dense", "distill=false"]
  if arm in CALIB_DIRS:
    flag = CALIB_FLAGS[arm]
    given = getattr(args, flag[2:].replace("-", "_"))
    path = given or os.path.join(args.runs, CALIB_DIRS[arm], "schedule.json")
    if not os.path.exists(path):
      raise ValueError(f"arm {arm!r} needs a schedule calibrated on this model: {path} does not "
                       f"exist (run --calibrate --arms {arm} first, or pass {flag} FILE)")
    return [f"schedule={path}", "distill=false"]  # trained and judged at the preset's tau
  if arm == "aggressive":
    return [f"schedule={args.aggressive}", "distill=false"]
  if arm == "aggressive_distill":
    return [f"schedule={args.aggressive}", "distill=true"]
  raise ValueError(f"arm {arm!r}: expected one of {', '.join(ARMS)}")


def write_heldout(path: str, preset: str, seeds: list[int], n: int, keys: list[str]) -> int:
  """`n` problems of the preset's task drawn with a seed no run uses, none of them among the
  training prompts of any of `seeds` (same arith settings); returns how many were written."""
  from sparrow_jax.rl import data as data_lib
  from sparrow_jax.run.builders import arithmetic_config, build_examples
  from sparrow_jax.run.config import get_train_config

  cfg = get_train_config(preset, keys)
  if not cfg.data.startswith("synthetic:"):
    raise ValueError(f"preset {preset!r} trains on data={cfg.data!r}: pass --heldout-file "
                     "with problems that are not in it")
  train = set()
  for s in seeds:
    train |= {e.prompt for e in build_examples(cfg.replace(seed=s))}
  acfg = arithmetic_config(cfg)
  out, seen = [], set()
  for e in data_lib.arithmetic_examples(20 * n + 100, seed=987_654_321, config=acfg):
    if e.prompt not in train and e.prompt not in seen:
      seen.add(e.prompt)
      out.append(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n")
      if len(out) == n:
        break
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.writelines(out)
  return len(out)


def write_split(runs: str, preset: str, n_train: int, n_heldout: int, keys: list[str]
                ) -> tuple[str, str]:
  """A fixed train / held-out split of the preset's synthetic task: the distinct problems of a
  large draw (seed no run uses) shuffled once, the first `n_heldout` held out, the next
  `n_train` the training set every arm and seed uses (seeds then change the data order and the
  sampling only). For tasks whose problem space is small (1-digit operands: 300 problems over
  + - *), where per-seed draws would cover it. Returns (train path, held-out path)."""
  import numpy as np
  from sparrow_jax.rl import data as data_lib
  from sparrow_jax.run.builders import arithmetic_config
  from sparrow_jax.run.config import get_train_config

  cfg = get_train_config(preset, keys)
  if not cfg.data.startswith("synthetic:"):
    raise ValueError(f"preset {preset!r} trains on data={cfg.data!r}: --train-problems needs "
                     "a synthetic task")
  acfg = arithmetic_config(cfg)
  pool = {}
  for e in data_lib.arithmetic_examples(20 * (n_train + n_heldout) + 2000, seed=987_654_321,
                                        config=acfg):
    pool.setdefault(e.prompt, e.answer)
  if len(pool) < n_train + n_heldout:
    raise ValueError(f"preset {preset!r}'s task has {len(pool)} distinct problems; "
                     f"--train-problems {n_train} + --heldout {n_heldout} need more")
  order = np.random.default_rng(123).permutation(sorted(pool))
  paths = (os.path.join(runs, "train.jsonl"), os.path.join(runs, "heldout.jsonl"))
  os.makedirs(runs, exist_ok=True)
  for path, part in zip(paths, (order[n_heldout:n_heldout + n_train], order[:n_heldout])):
    with open(path, "w") as f:
      f.writelines(json.dumps({"prompt": str(q), "answer": pool[q]}) + "\n" for q in part)
  return paths


def calibration_command(args, arm: str = "tau") -> list[str]:
  """experiments/calibrate.py's arguments for the `tau` arm's schedule (at the preset's tau)
  or the `tau_margin` arm's (at tau + `--calib-margin`, into RUNS/calib_margin): the run's
  model, page size, position bins, dense layers, response length, temperature and slots;
  prompts = the first `--calib-prompts` training prompts of seed 0, written into RUNS."""
  from sparrow_jax.run.builders import build_examples, build_schedule
  from sparrow_jax.run.config import get_train_config

  cfg = get_train_config(args.preset, list(args.keys) + ["seed=0"] + _data_keys(args))
  tau = cfg.tau + (args.calib_margin if arm == "tau_margin" else 0.0)
  if not 0.0 < tau <= 1.0:
    raise ValueError(f"--calib-margin {args.calib_margin}: tau + margin = {tau:g} is not in "
                     "(0, 1]")
  prompts = os.path.join(args.runs, "calib_prompts.jsonl")
  with open(prompts, "w") as f:
    for e in build_examples(cfg)[:args.calib_prompts]:
      f.write(json.dumps({"prompt": e.prompt}) + "\n")
  sched = build_schedule(cfg)  # the preset's sparse schedule: its dense layers and reserve
  argv = [os.path.join("experiments", "calibrate.py"), "--config", cfg.model,
          "--prompts", prompts, "--budgets", args.calib_budgets, "--tau", f"{tau:g}",
          "--bin-size", str(cfg.mismatch_bin_size), "--page-size", str(cfg.page_size),
          "--max-new-tokens", str(cfg.max_new_tokens), "--num-slots", str(cfg.num_slots),
          "--temperature", str(cfg.temperature), "--dense-layers",
          ",".join(str(i) for i in sched.dense_layers), "--out",
          os.path.join(args.runs, CALIB_DIRS[arm]), "--no-progress"]
  if cfg.model_path:
    argv += ["--model-path", cfg.model_path]
  if not cfg.chat_template:
    argv.append("--no-chat-template")
  return argv


def _python(*argv: str, log: str, capture: bool = False) -> tuple[int, str]:
  """Run a repository script with this interpreter; its output (stderr only when `capture`:
  stdout is then returned) is appended to `log`."""
  with open(log, "a") as f:
    f.write(f"\n$ {' '.join(argv)}\n")
    f.flush()
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, stderr=f,
                         stdout=subprocess.PIPE if capture else f, text=True)
    return res.returncode, res.stdout if capture else ""


def _eval(args, source: list[str], out_json: str, mode: str, log: str) -> dict:
  """experiments/eval.py on the held-out set (k samples each); the result cached in
  `out_json`."""
  if os.path.exists(out_json):
    with open(out_json) as f:
      return json.load(f)
  rc, out = _python(os.path.join("experiments", "eval.py"), *source, "--data",
                    os.path.abspath(args.heldout_path), "--k", str(args.k), "--mode", mode,
                    "--temperature", str(args.temperature),
                    "--json", log=log, capture=True)
  if rc != 0:
    raise RuntimeError(f"eval.py {' '.join(source)} --mode {mode} failed (exit {rc}); see {log}")
  res = json.loads(out)
  with open(out_json, "w") as f:
    json.dump(res, f, indent=1)
  return res


def _check_held_out(cfg, path: str) -> None:
  """The held-out set must share no problem with this run's training prompts."""
  from sparrow_jax.run.builders import build_examples
  with open(path) as f:
    held = {json.loads(line)["prompt"] for line in f if line.strip()}
  both = held & {e.prompt for e in build_examples(cfg)}
  if both:
    raise ValueError(f"{path} shares {len(both)} problems with seed {cfg.seed}'s training "
                     f"prompts (e.g. {sorted(both)[0]!r}); delete it to draw a new one")


def _done_steps(run_dir: str) -> int:
  from sparrow_jax.run.metrics import read_jsonl
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  return max((s for s in read_jsonl(path) if s > 0), default=0)


def _mean(values) -> float | None:
  vals = [v for v in values if v is not None and math.isfinite(v)]
  return statistics.fmean(vals) if vals else None


def summarize(recs: dict[int, dict], tau: float) -> dict:
  """Per-step series and the study's scalars from a run's metrics records."""
  steps = sorted(s for s in recs if s > 0)
  get = lambda key: [recs[s].get(key) for s in steps]
  bins = sorted({int(k.rsplit("_", 1)[1]) for s in steps for k in recs[s]
                 if k.startswith("mismatch/exact_p5_bin_")})
  exact = [v for v in get("mismatch/exact_p5") if v is not None and math.isfinite(v)]
  bound = [v for v in get("mismatch/p5_overall") if v is not None and math.isfinite(v)]
  roll = [v for v in get("time/rollout_s") if v is not None]
  out = {
      "steps": steps, "reward": get("reward/mean"), "len_mean": get("response/len_mean"),
      "clip_ratio": get("response/clip_ratio"), "p5_exact": get("mismatch/exact_p5"),
      "p5_bound": get("mismatch/p5_overall"),
      "p5_exact_bins": {b: get(f"mismatch/exact_p5_bin_{b}") for b in bins},
      "is_frac_truncated": get("loss/is_frac_truncated"),
      # importance ratios pi_dense / q_actor of the sampled tokens, logged with TIS off too
      "tis_ratio_mean": get("tis/ratio_mean"), "tis_ratio_p5": get("tis/ratio_p5"),
      "tis_ratio_p95": get("tis/ratio_p95"), "tis_frac_above_cap": get("tis/frac_above_cap"),
      "tis_kl": get("tis/kl_rollout_vs_policy"),
      "time": {k: get(f"time/{k}_s") for k in ("rollout", "recompute", "update", "distill",
                                                 "exact_alpha", "step")},
      "rollout_s_per_step": statistics.median(roll) if roll else None,
      "p5_exact_min": min(exact) if exact else None,
      "p5_exact_mean": _mean(exact),
      "p5_bound_min": min(bound) if bound else None,
      # the monitor's bound on the exact rows' tokens: p5 (min over bins) and mean gap
      "p5_bound_exact_rows": get("mismatch/bound_p5_exact_rows"),
      "p5_bound_exact_rows_mean": _mean(get("mismatch/bound_p5_exact_rows")),
      "exact_bound_gap_mean": _mean(get("mismatch/exact_bound_gap")),
      "steps_exact_below_tau": sum(v < tau for v in exact),
      "tis_frac_above_cap_mean": _mean(get("tis/frac_above_cap")),
      "tis_kl_mean": _mean(get("tis/kl_rollout_vs_policy")),
      # the rollout correction's per-step ESS / N and rejected token fraction (None without)
      "ess": get("rollout_corr/ess"), "rejected_frac": get("rollout_corr/rejected_token_frac"),
      "ess_mean": _mean(get("rollout_corr/ess")),
      "rejected_frac_mean": _mean(get("rollout_corr/rejected_token_frac")),
      "rejected_seq_frac": get("rollout_corr/rejected_seq_frac"),
      "rejected_seq_frac_mean": _mean(get("rollout_corr/rejected_seq_frac")),
      "is_weight_max": get("rollout_corr/is_weight_max"),
      # the teacher-forced sparse actor replaying the engine's sampled-token log-probs
      "replay_logp_maxdiff": get("mismatch/replay_logp_maxdiff"),
      "replay_frac_off": get("mismatch/replay_frac_off"),
      "replay_rows_off": get("mismatch/replay_rows_off"),
      "bound_above_exact_frac": get("mismatch/bound_above_exact_frac"),
  }
  return out


def run_arm(arm: str, seed: int, args) -> dict:
  """Train (or resume) one arm and seed, score it, write OUT/ARM_sSEED.json."""
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.metrics import read_jsonl

  run_dir = os.path.join(args.runs, f"{arm}_s{seed}")
  log = os.path.join(args.runs, f"{arm}_s{seed}.log")
  keys = BASE + list(args.keys) + arm_overrides(arm, args) + [
      f"seed={seed}", f"out_dir={run_dir}", f"num_steps={args.steps}"] + _data_keys(args)
  cfg = get_train_config(args.preset, keys)  # bad keys fail here, before any work
  _check_held_out(cfg, args.heldout_path)
  t0 = time.perf_counter()
  done = _done_steps(run_dir)
  if done < args.steps:
    resume = ["--resume"] if done else []
    print(f"{arm} seed {seed}: training steps {done + 1}-{args.steps} into {run_dir}"
          f"{' (resumed)' if done else ''}; log {log}", flush=True)
    rc, _ = _python(os.path.join("experiments", "train.py"), "--config", args.preset, *resume,
                    *keys, log=log)
    if rc != 0:
      raise RuntimeError(f"{arm} seed {seed}: train.py exited {rc}; see {log} (rerun to "
                         "resume from its last checkpoint)")
  train_s = time.perf_counter() - t0
  if args.train_only:
    print(f"{arm} seed {seed}: trained to step {args.steps} (--train-only: not scored)")
    return {}
  before = _before(args)
  tag = os.path.join(args.runs, f"{arm}_s{seed}_step{args.steps}")  # scores of that policy
  after = _eval(args, ["--checkpoint", run_dir], f"{tag}_eval_dense.json", "dense", log)
  res = {"arm": arm, "seed": seed, "preset": args.preset, "steps_run": args.steps,
         "schedule": cfg.schedule, "distill": cfg.distill, "tau": cfg.tau,
         f"heldout_avg{args.k}_before": before[f"eval/avg@{args.k}"],
         f"heldout_avg{args.k}_after": after[f"eval/avg@{args.k}"],
         f"heldout_pass{args.k}_before": before[f"eval/pass@{args.k}"],
         f"heldout_pass{args.k}_after": after[f"eval/pass@{args.k}"],
         "heldout_samples": before.get("eval/samples"), "train_wall_s_this_call": train_s}
  if cfg.schedule.endswith(".json"):  # which schedule it was, should the file move
    from sparrow_jax.run.builders import build_schedule  # parsed as train.py parses it
    res["schedule_budgets"] = list(build_schedule(cfg).budgets)
  if arm != "dense":
    mode = "sparse_lora" if cfg.distill else "sparse"
    sp = _eval(args, ["--checkpoint", run_dir], f"{tag}_eval_{mode}.json", mode, log)
    res["heldout_alpha_p5_after"] = sp.get("eval/alpha_p5")
    res[f"heldout_avg{args.k}_after_{mode}"] = sp[f"eval/avg@{args.k}"]
  res.update(summarize(read_jsonl(os.path.join(run_dir, "metrics.jsonl")), cfg.tau))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"{arm}_s{seed}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  print(f"{arm} seed {seed}: held-out avg@{args.k} {res[f'heldout_avg{args.k}_before']:.3f} -> "
        f"{res[f'heldout_avg{args.k}_after']:.3f}, rollout {res['rollout_s_per_step']} s/step, "
        f"exact p5 min {res['p5_exact_min']}; wrote {path}", flush=True)
  return res


def _data_keys(args) -> list[str]:
  """The fixed training set of --train-problems (an absolute path: train.py runs in ROOT)."""
  path = getattr(args, "train_path", "")
  return [f"data={os.path.abspath(path)}"] if path else []


def _before(args) -> dict:
  """Held-out score of the starting model (the preset's weights before any training: the
  same for every arm and seed; eval.py's sampling seeds are fixed), cached in RUNS."""
  return _eval(args, ["--config", args.preset, *args.keys, *_data_keys(args)],
               os.path.join(args.runs, "start_eval.json"), "dense",
               os.path.join(args.runs, "start.log"))


def _arm_rank(arm: str) -> int:
  """Tables list the arms in ARMS' order, unknown arms last."""
  return ARMS.index(arm) if arm in ARMS else len(ARMS)


def _sched_name(schedule: str) -> str:
  return os.path.basename(schedule) if schedule.endswith(".json") else schedule


def _sched_group(schedule: str) -> str:
  """The summary's schedule key: a spec (`dense`, `constant:2`) as is; every JSON schedule as
  one key, because in this study a JSON schedule is the tau arm's calibration, which may be
  read from its run directory (`RUNS/calib/schedule.json`) or from the committed copy
  (`--tau-schedule docs/figures/sparse_rl_study/tau_schedule.json`). The per-run table keeps
  each file's name, and a result records the JSON's budgets (`schedule_budgets`)."""
  return "<json>" if schedule.endswith(".json") else schedule


def _arm_groups(rows: list[dict]) -> list[tuple[tuple, list[dict], str]]:
  """(arm, schedule group), its rows by seed, and its schedules' names, in table order."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault((r["arm"], _sched_group(r["schedule"])), []).append(r)
  out = []
  for key in sorted(groups, key=lambda key: (_arm_rank(key[0]), key)):
    rs = sorted(groups[key], key=lambda r: r["seed"])
    out.append((key, rs, ", ".join(sorted({_sched_name(r["schedule"]) for r in rs}))))
  return out


def arm_summary(rows: list[dict], k: int) -> list[str]:
  """One line per arm and schedule over its seeds: held-out avg@k after as mean (min-max) and
  the spread max - min (what says whether arms separate), pass@k, the sparse actor's own
  avg@k and the exact p5 (both means over seeds; '-' where no seed has them)."""
  fmt = lambda v: "-" if v is None else f"{v:.3f}"
  out = [f"| arm | schedule | seeds | held-out avg@{k} after: mean (min-max) | spread | "
         f"pass@{k} after, mean | sparse actor's own avg@{k}, mean | exact p5 mean, mean | "
         "steps with exact p5 < tau |",
         "|---|---|---|---|---|---|---|---|---|"]
  for key, rs, names in _arm_groups(rows):
    after = [r[f"heldout_avg{k}_after"] for r in rs]
    own = _mean(r.get(f"heldout_avg{k}_after_sparse_lora", r.get(f"heldout_avg{k}_after_sparse"))
                for r in rs)
    below = sum(r["steps_exact_below_tau"] for r in rs)
    steps = sum(len(r["steps"]) for r in rs)
    measured = any(r.get("p5_exact_mean") is not None for r in rs)  # dense arms have none
    below_s = f"{below} of {steps}" if measured else "-"
    out.append(f"| {key[0]} | {names} | {', '.join(str(r['seed']) for r in rs)} | "
               f"{fmt(_mean(after))} ({fmt(min(after))}-{fmt(max(after))}) | "
               f"{fmt(max(after) - min(after))} | "
               f"{fmt(_mean(r[f'heldout_pass{k}_after'] for r in rs))} | {fmt(own)} | "
               f"{fmt(_mean(r.get('p5_exact_mean') for r in rs))} | {below_s} |")
  return out


def permutation_p(a: list[float], b: list[float]) -> tuple[float, float]:
  """Exact permutation test of mean(a) - mean(b) over every way to split the pooled scores
  into groups of len(a) and len(b): (one-sided p of a difference at least the observed one,
  two-sided p of an |difference| at least the observed one). Ties count as extreme, so the
  p-values are never below 1 / C(len(a) + len(b), len(a)): 3 vs 3 seeds cannot go under 1/20."""
  if not a or not b:
    raise ValueError(f"permutation_p: both groups need scores (got {len(a)} and {len(b)})")
  pool, n = list(a) + list(b), len(a)
  total = sum(pool)
  diff = lambda s: s / n - (total - s) / len(b)
  observed = diff(sum(a))
  eps = 1e-12 * max(1.0, max(abs(x) for x in pool))
  splits = [diff(sum(pool[i] for i in idx))
            for idx in itertools.combinations(range(len(pool)), n)]
  one = sum(d >= observed - eps for d in splits) / len(splits)
  two = sum(abs(d) >= abs(observed) - eps for d in splits) / len(splits)
  return one, two


def versus(rows: list[dict], k: int, base: str = "dense", arms=None,
           metric: str = "avg") -> list[str]:
  """Each arm and schedule (`arms`: those names only; default every arm but `base`) against
  the arm `base`: the per-seed differences of held-out `metric`@k (avg or pass) where both ran
  the seed (same seed = same data order), and the exact permutation test of the difference of
  their means over all their seeds. Empty without seeds of `base` or without arms to list."""
  key_of = f"heldout_{metric}{k}_after"
  ref = {r["seed"]: r[key_of] for r in rows if r["arm"] == base}
  listed = [r for r in rows if r["arm"] != base and (arms is None or r["arm"] in arms)]
  if not ref or not listed:
    return []
  out = [f"| arm | schedule | seeds | {metric}@{k} minus {base}'s, same seed: mean (min-max) | "
         f"seeds above {base}'s same seed | mean minus {base}'s mean (all seeds) | "
         "permutation p, one-sided / two-sided |",
         "|---|---|---|---|---|---|---|"]
  for key, rs, names in _arm_groups(listed):
    after = [r[key_of] for r in rs]
    paired = [r[key_of] - ref[r["seed"]] for r in rs if r["seed"] in ref]
    pair_s = (f"{statistics.fmean(paired):+.3f} ({min(paired):+.3f} to {max(paired):+.3f})"
              if paired else "-")
    above = f"{sum(d > 0 for d in paired)} of {len(paired)}" if paired else "-"
    one, two = permutation_p(after, list(ref.values()))
    out.append(f"| {key[0]} | {names} | {', '.join(str(r['seed']) for r in rs)} | {pair_s} | "
               f"{above} | {statistics.fmean(after) - statistics.fmean(ref.values()):+.3f} | "
               f"{one:.3f} / {two:.3f} |")
  return out


def vs_dense(rows: list[dict], k: int) -> list[str]:
  """Each arm and schedule against the dense arm (`versus` with base `dense`, avg@k)."""
  return versus(rows, k, "dense")


def cost_and_correction(rows: list[dict]) -> list[str]:
  """One line per arm and schedule over its seeds: the rollout's seconds per step (each run's
  median, then the mean over seeds: wall-clock on whatever shared this CPU) and the rollout
  correction's per-step ESS / N, rejected token and sequence fractions and largest IS weight
  (means over steps, then over seeds; '-' for arms without a correction)."""
  fmt = lambda v: "-" if v is None else f"{v:.3f}"
  out = ["| arm | schedule | seeds | rollout s/step | ESS / N, mean | rejected tokens, mean | "
         "rejected sequences, mean | largest IS weight, mean |",
         "|---|---|---|---|---|---|---|---|"]
  for key, rs, names in _arm_groups(rows):
    w_max = _mean(_mean(r.get("is_weight_max") or []) for r in rs)
    out.append(f"| {key[0]} | {names} | {', '.join(str(r['seed']) for r in rs)} | "
               f"{fmt(_mean(r.get('rollout_s_per_step') for r in rs))} | "
               f"{fmt(_mean(r.get('ess_mean') for r in rs))} | "
               f"{fmt(_mean(r.get('rejected_frac_mean') for r in rs))} | "
               f"{fmt(_mean(r.get('rejected_seq_frac_mean') for r in rs))} | {fmt(w_max)} |")
  return out


def report(args) -> int:
  """docs/sparse_rl_study.md's table (and the figures) from every JSON under OUT."""
  files = sorted(f for f in os.listdir(args.out) if f.endswith(".json")) if os.path.isdir(
      args.out) else []
  rows = []
  for f in files:
    with open(os.path.join(args.out, f)) as fh:
      rec = json.load(fh)
    if isinstance(rec, dict) and "arm" in rec:  # other JSONs (e.g. a schedule) live there too
      rows.append(rec)
  if not rows:
    print(f"error: no arm results under {args.out}; run some arms first", file=sys.stderr)
    return 2
  k = args.k
  lines = [f"| arm | seed | steps | schedule | held-out avg@{k} before | after | pass@{k} after | "
           "rollout s/step | exact p5 mean | exact p5 min | monitor bound min | "
           "bound on the exact rows, mean | rho > 2, mean | KL(q, pi), mean | ESS / N, mean | "
           "rejected tokens, mean |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"
  for r in sorted(rows, key=lambda r: (_arm_rank(r["arm"]), r["seed"])):
    sched = _sched_name(r["schedule"])
    lines.append(f"| {r['arm']} | {r['seed']} | {r['steps_run']} | {sched} | "
                 f"{fmt(r[f'heldout_avg{k}_before'])} | {fmt(r[f'heldout_avg{k}_after'])} | "
                 f"{fmt(r[f'heldout_pass{k}_after'])} | {fmt(r['rollout_s_per_step'], 1)} | "
                 f"{fmt(r['p5_exact_mean'])} | {fmt(r['p5_exact_min'])} | "
                 f"{fmt(r['p5_bound_min'])} | {fmt(r.get('p5_bound_exact_rows_mean'))} | "
                 f"{fmt(r.get('tis_frac_above_cap_mean'), 4)} | {fmt(r.get('tis_kl_mean'), 4)} | "
                 f"{fmt(r.get('ess_mean'))} | {fmt(r.get('rejected_frac_mean'), 4)} |")
  table = "\n".join(lines) + "\n\n" + "\n".join(arm_summary(rows, k)) + "\n"
  table += "\n" + "\n".join(cost_and_correction(rows)) + "\n"
  # every arm against dense; the corrected arms also against the uncorrected aggressive arms
  # they modify (with and without DistillSparse), on avg@k and on pass@k
  corrected = set(CORRECTION_ARMS)
  for base, arms in (("dense", None), ("aggressive", corrected),
                     ("aggressive_distill", corrected)):
    for metric in ("avg", "pass"):
      vs = versus(rows, k, base, arms, metric)
      if vs:
        table += "\n" + "\n".join(vs) + "\n"
  fig = _figures(rows, args.out)
  print(table)
  if args.report_md:
    with open(args.report_md, "w") as f:
      f.write("<!-- sparse_rl_study:table (experiments/sparse_rl_study.py --report) -->\n")
      f.write(table)
      if fig:
        f.write(f"\n![reward, length, exact p5 per step]({os.path.relpath(fig, os.path.dirname(os.path.abspath(args.report_md)))})\n")
    print(f"wrote {args.report_md}")
  return 0


def _figures(rows, out_dir: str) -> str | None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for i, r in enumerate(rows):  # one colour per run in every panel
    label, c = f"{r['arm']} s{r['seed']}", f"C{i % 10}"
    axes[0].plot(r["steps"], r["reward"], label=label, color=c)
    axes[1].plot(r["steps"], r["len_mean"], label=label, color=c)
    if any(v is not None for v in r["p5_exact"]):
      axes[2].plot(r["steps"], [math.nan if v is None else v for v in r["p5_exact"]],
                   label=label, color=c)
  for ax, title in zip(axes, ("reward", "response length", "exact p5 (min over bins)")):
    ax.set_title(title)
    ax.set_xlabel("step")
  axes[2].axhline(rows[0].get("tau", 0.86), color="k", ls="--", lw=0.8)
  axes[0].legend(fontsize=7)
  path = os.path.join(out_dir, "curves.png")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  # exact p5 per position bin over steps, one panel per arm that has it
  sparse = [r for r in rows if r.get("p5_exact_bins")]
  if sparse:
    cols = min(len(sparse), 4)  # a grid of 4 runs per row, however many seeds
    nrow = -(-len(sparse) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5 * cols, 4 * nrow), squeeze=False)
    for ax in axes.flat[len(sparse):]:
      ax.set_visible(False)
    for ax, r in zip(axes.flat, sparse):
      for b, series in sorted(r["p5_exact_bins"].items(), key=lambda kv: int(kv[0])):
        ax.plot(r["steps"], [math.nan if v is None else v for v in series], ".-", ms=3,
                label=f"bin {b}")  # markers: a bin seen in one step only is a point
      ax.axhline(r.get("tau", 0.86), color="k", ls="--", lw=0.8)
      ax.set_title(f"{r['arm']} s{r['seed']}: exact p5 per bin")
      ax.set_xlabel("step")
      ax.set_ylim(0, 1.02)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "p5_bins.png"), dpi=110)
    plt.close(fig)
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="smollm2_135m_study")
  ap.add_argument("--arms", default="dense,aggressive", help=f"comma-separated of {ARMS}")
  ap.add_argument("--seeds", default="0", help="comma-separated run seeds")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--aggressive", default="constant:2", help="the aggressive arms' schedule")
  ap.add_argument("--tau-schedule", default="",
                  help="the tau arm's schedule (default: RUNS/calib/schedule.json)")
  ap.add_argument("--tau-margin-schedule", default="",
                  help="the tau_margin arm's schedule (default: RUNS/calib_margin/schedule.json)")
  ap.add_argument("--calibrate", action="store_true",
                  help="calibrate the schedule of each of tau / tau_margin in --arms (tau "
                       "if neither) on this model and stop")
  ap.add_argument("--calib-margin", type=float, default=0.02,
                  help="the tau_margin arm's calibration target above tau (the arm trains "
                       "and is judged at tau)")
  ap.add_argument("--calib-prompts", type=int, default=24, help="prompts to calibrate on")
  ap.add_argument("--calib-budgets", default="2,4,8,16,32",
                  help="budgets the calibration scores (pages of the preset's page size)")
  ap.add_argument("--k", type=int, default=4, help="held-out samples per problem")
  ap.add_argument("--heldout", type=int, default=200, help="held-out problems")
  ap.add_argument("--train-problems", type=int, default=100,
                  help="a fixed train/held-out split of the task with this many training "
                       "problems, the same for every arm and seed (0: each seed draws the "
                       "preset's own num_examples, the held-out set avoids them all)")
  ap.add_argument("--runs", default="runs/sparse_rl_study", help="run directories")
  ap.add_argument("--out", default="docs/figures/sparse_rl_study", help="result JSONs")
  ap.add_argument("--report", action="store_true", help="write the table/figures and stop")
  ap.add_argument("--report-md", default="", help="with --report: also write this markdown")
  ap.add_argument("--train-only", action="store_true",
                  help="train (or resume) the arms, score nothing (a later call scores)")
  ap.add_argument("--precheck", action="store_true",
                  help="score the starting model on the held-out set and stop")
  ap.add_argument("keys", nargs="*", help="key=value overrides for every arm")
  args = ap.parse_args(argv)
  if args.report:
    return report(args)
  try:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
      raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)}; expected some of "
                       f"{', '.join(ARMS)}")
    if not (args.calibrate or args.precheck):
      for a in arms:
        arm_overrides(a, args)  # every arm's arguments checked before any work
    os.makedirs(args.runs, exist_ok=True)
    if not any(k.startswith("compile_cache_dir=") for k in args.keys):
      # every arm, resume and evaluation shares the programs it has compiled
      args.keys = list(args.keys) + [
          f"compile_cache_dir={os.path.abspath(os.path.join(args.runs, 'jax_cache'))}"]
    from sparrow_jax.run.config import get_train_config
    args.temperature = get_train_config(args.preset, list(args.keys)).temperature
    args.heldout_path = os.path.join(args.runs, "heldout.jsonl")
    args.train_path = ""
    if args.train_problems:
      args.train_path = os.path.join(args.runs, "train.jsonl")
      if not (os.path.exists(args.train_path) and os.path.exists(args.heldout_path)):
        write_split(args.runs, args.preset, args.train_problems, args.heldout, list(args.keys))
        print(f"fixed split: {args.train_problems} training problems -> {args.train_path}, "
              f"{args.heldout} held out -> {args.heldout_path}")
    elif not os.path.exists(args.heldout_path):
      n = write_heldout(args.heldout_path, args.preset, sorted(set(range(10)) | set(seeds)),
                        args.heldout, list(args.keys))
      print(f"held-out set: {n} problems -> {args.heldout_path}")
    if args.calibrate:
      for arm in [a for a in arms if a in CALIB_DIRS] or ["tau"]:
        argv = calibration_command(args, arm)
        log = os.path.join(args.runs, f"{CALIB_DIRS[arm]}.log")
        print(f"calibrating ({arm}): python {' '.join(argv)}  (log {log})", flush=True)
        rc, _ = _python(*argv, log=log)
        if rc != 0:
          raise RuntimeError(f"calibrate.py exited {rc}; see {log} (a rerun resumes)")
        print(f"schedule -> {os.path.join(args.runs, CALIB_DIRS[arm], 'schedule.json')}")
      return 0
    if args.precheck:
      ev = _before(args)
      print(f"start model: held-out avg@{args.k} {ev[f'eval/avg@{args.k}']:.3f}, "
            f"pass@{args.k} {ev[f'eval/pass@{args.k}']:.3f} (the study wants 0.2-0.6)")
      return 0
    for s in seeds:
      for a in arms:
        run_arm(a, s, args)
  except (ValueError, RuntimeError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
