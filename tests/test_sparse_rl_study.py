"""experiments/sparse_rl_study.py on the tiny preset: one sparse arm with DistillSparse trains
in a subprocess, is resumed with the same keys, is scored on a held-out set disjoint from
training, and its JSON carries what issue 20 asks for; --report turns the JSONs into the table."""

import itertools
import json
import numpy as np
import pytest

import experiments.sparse_rl_study as study
from sparrow_jax.run.builders import build_examples, build_schedule
from sparrow_jax.run.config import get_train_config

KEYS = ["warmstart_steps=0", "prompts_per_step=2", "group_size=2", "num_slots=8",
        "max_new_tokens=12", "save_every=1", "exact_alpha_rows=0"]


def test_held_out_problems_are_disjoint_from_every_seeds_training_prompts(tmp_path):
  path = str(tmp_path / "h.jsonl")
  n = study.write_heldout(path, "tiny", [0, 1], 30, [])
  rows = [json.loads(line) for line in open(path)]
  assert n == len(rows) == len({r["prompt"] for r in rows}) > 0
  for seed in (0, 1):
    train = {e.prompt for e in build_examples(get_train_config("tiny", [f"seed={seed}"]))}
    assert not train & {r["prompt"] for r in rows}
  assert all(str(eval(r["prompt"].rstrip("="))) == r["answer"] for r in rows)  # a+b= sums


def test_fixed_split_is_disjoint_and_every_arm_trains_on_it(tmp_path):
  train, held = study.write_split(str(tmp_path), "tiny", 60, 30, [])
  tr = [json.loads(line) for line in open(train)]
  ho = [json.loads(line) for line in open(held)]
  assert len(tr) == 60 and len(ho) == 30
  assert len({r["prompt"] for r in tr + ho}) == 90  # distinct, and no problem in both
  assert all(str(eval(r["prompt"].rstrip("="))) == r["answer"] for r in tr + ho)
  assert study.write_split(str(tmp_path / "again"), "tiny", 60, 30, []) and open(
      tmp_path / "again" / "heldout.jsonl").read() == open(held).read()  # one fixed split
  with pytest.raises(ValueError, match="100 distinct problems"):  # tiny: a+b, 1 digit
    study.write_split(str(tmp_path), "tiny", 80, 30, [])


def test_calibration_command_is_one_calibrate_py_accepts(tmp_path):
  import argparse
  import experiments.calibrate as calibrate
  args = argparse.Namespace(preset="tiny", keys=["max_new_tokens=12"], runs=str(tmp_path),
                            calib_prompts=5, calib_budgets="1,2")
  argv = study.calibration_command(args)
  parsed = calibrate.build_parser().parse_args(argv[1:])
  cfg = get_train_config("tiny", ["max_new_tokens=12"])
  assert (parsed.page_size, parsed.bin_size, parsed.max_new_tokens, parsed.tau) == (
      cfg.page_size, cfg.mismatch_bin_size, 12, cfg.tau)
  assert parsed.dense_layers == [0] and parsed.budgets == [1, 2]  # the preset's dense layer
  prompts = [json.loads(line)["prompt"] for line in open(parsed.prompts)]
  assert prompts == [e.prompt for e in build_examples(cfg)][:5]


def test_margin_arm_calibrates_above_tau_into_its_own_directory(tmp_path, capsys):
  """tau_margin: calibrated at tau + --calib-margin into RUNS/calib_margin (the tau arm's
  RUNS/calib untouched), trained with that schedule at the preset's tau; unknown arms and a
  missing schedule are refused before any work."""
  import argparse
  import experiments.calibrate as calibrate
  args = argparse.Namespace(preset="tiny", keys=["max_new_tokens=12"], runs=str(tmp_path),
                            calib_prompts=5, calib_budgets="1,2", calib_margin=0.02,
                            tau_schedule="", tau_margin_schedule="")
  cfg = get_train_config("tiny", ["max_new_tokens=12"])
  tau_argv = study.calibration_command(args, "tau")
  margin_argv = study.calibration_command(args, "tau_margin")
  tau_p, margin_p = (calibrate.build_parser().parse_args(a[1:]) for a in (tau_argv, margin_argv))
  assert tau_p.tau == cfg.tau and margin_p.tau == pytest.approx(cfg.tau + 0.02)
  assert tau_p.out == str(tmp_path / "calib") and margin_p.out == str(tmp_path / "calib_margin")
  assert [a for a in tau_argv if a not in ("--tau", str(cfg.tau), tau_p.out)] == [
      a for a in margin_argv if a not in ("--tau", f"{cfg.tau + 0.02:g}", margin_p.out)]
  args.calib_margin = 0.5
  with pytest.raises(ValueError, match="not in"):
    study.calibration_command(args, "tau_margin")
  with pytest.raises(ValueError, match="--tau-margin-schedule"):
    study.arm_overrides("tau_margin", args)
  (tmp_path / "calib_margin").mkdir()
  (tmp_path / "calib_margin" / "schedule.json").write_text("{}")
  assert study.arm_overrides("tau_margin", args) == [
      f"schedule={tmp_path / 'calib_margin' / 'schedule.json'}", "distill=false"]
  assert study.main(["--preset", "tiny", "--arms", "dense,tau_marg", "--runs",
                     str(tmp_path / "r")]) == 2
  assert "unknown arm(s) tau_marg" in capsys.readouterr().err
  assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_arm_trains_resumes_and_reports(tmp_path, capsys, monkeypatch):
  runs, out = tmp_path / "runs", tmp_path / "out"
  # The arm's schedule as a JSON file (what the tau arm's calibration is): `constant:1` for
  # this preset's pages, written by the library, so the result records its budgets.
  sched = tmp_path / "sched.json"
  build_schedule(get_train_config("tiny", KEYS), "constant:1").to_json(sched)
  common = ["--preset", "tiny", "--arms", "aggressive_distill", "--aggressive", str(sched),
            "--seeds", "0", "--k", "2", "--heldout", "8", "--train-problems", "20",
            "--runs", str(runs), "--out", str(out), *KEYS]
  assert study.main(common + ["--steps", "1", "--train-only"]) == 0
  assert not out.exists() and (runs / "aggressive_distill_s0" / "metrics.jsonl").exists()
  # A longer --steps continues the same run with train.py --resume and the same keys
  # (train.py's resume itself is tested with the trainer; here only the call it gets).
  calls = []
  with monkeypatch.context() as m:
    m.setattr(study, "_python", lambda *argv, **kw: (calls.append(argv), (0, ""))[1])
    assert study.main(common + ["--steps", "2", "--train-only"]) == 0
  (argv,) = calls
  assert argv[0].endswith("train.py") and "--resume" in argv and "num_steps=2" in argv
  assert f"schedule={sched}" in argv and "distill=true" in argv and "seed=0" in argv
  assert f"data={runs / 'train.jsonl'}" in argv  # every arm trains on the fixed split
  assert study.main(common + ["--steps", "1"]) == 0  # trained already: scores only
  res = json.load(open(out / "aggressive_distill_s0.json"))
  assert res["steps"] == [1] and res["arm"] == "aggressive_distill" and res["seed"] == 0
  assert res["schedule"] == str(sched) and res["distill"] is True
  assert res["schedule_budgets"] == json.load(open(sched))["budgets"] and res["schedule_budgets"]
  for key in ("heldout_avg2_before", "heldout_avg2_after", "heldout_pass2_after"):
    assert 0.0 <= res[key] <= 1.0, key
  assert sorted(p.name for p in runs.glob("*_eval*.json")) == [  # keyed by the policy's step
      "aggressive_distill_s0_step1_eval_dense.json",
      "aggressive_distill_s0_step1_eval_sparse_lora.json", "start_eval.json"]
  assert 0.0 < res["p5_exact_min"] <= res["p5_exact_mean"] <= 1.0
  assert res["p5_bound_min"] <= res["p5_exact_min"] + 1e-4  # the monitor's bound is below
  # ... on the same rows' tokens too (rows=0: all of them), token by token
  assert res["p5_bound_exact_rows_mean"] <= res["p5_exact_mean"] + 1e-4
  assert res["exact_bound_gap_mean"] >= 0.0
  assert res["rollout_s_per_step"] > 0 and 0 < res["heldout_alpha_p5_after"] <= 1.0
  assert len(res["reward"]) == len(res["clip_ratio"]) == 1 and res["p5_exact_bins"]
  # TIS statistics per step with TIS off: sparse rollouts, so the ratios are off 1
  assert len(res["tis_ratio_mean"]) == 1 and res["tis_kl_mean"] > 0
  assert res["tis_ratio_p5"][0] < 1 < res["tis_ratio_p95"][0]
  assert 0.0 <= res["tis_frac_above_cap_mean"] <= 1.0
  capsys.readouterr()
  md = tmp_path / "study.md"
  (out / "tau_schedule.json").write_text('{"format": "a schedule, not an arm"}')  # skipped
  assert study.main(["--report", "--out", str(out), "--k", "2", "--report-md", str(md)]) == 0
  table = md.read_text()
  assert "| aggressive_distill | 0 | 1 | sched.json |" in table, table
  assert "KL(q, pi), mean |" in table and (out / "p5_bins.png").exists()
  # Bad arguments fail before any work.
  assert study.main(common + ["--arms", "tau"]) == 2
  assert "--calibrate" in capsys.readouterr().err


def test_arm_summary_groups_seeds_by_arm_and_schedule():
  def row(arm, seed, after, sched="constant:2", p5=None, below=0, own=None, steps=3):
    r = {"arm": arm, "seed": seed, "schedule": sched, "heldout_avg4_after": after,
         "heldout_pass4_after": after + 0.1, "p5_exact_mean": p5,
         "steps_exact_below_tau": below, "steps": list(range(1, steps + 1))}
    if own is not None:
      r["heldout_avg4_after_sparse"] = own
    return r
  rows = [row("aggressive", 1, 0.5, p5=0.3, below=3, own=0.4),
          row("dense", 0, 0.7, sched="dense"), row("dense", 1, 0.6, sched="dense"),
          row("aggressive", 0, 0.8, p5=0.5, below=2, own=0.6),
          row("aggressive", 2, 0.6, sched="constant:8", p5=0.9, below=0, own=0.55),
          row("tau", 0, 0.65, sched="/x/runs/calib/schedule.json", p5=0.93, below=1),
          # the same calibration read from the committed copy: one tau line, both names
          row("tau", 1, 0.75, sched="docs/figures/tau_schedule.json", p5=0.91, below=2)]
  lines = study.arm_summary(rows, 4)
  assert len(lines) == 2 + 4, lines  # dense, tau, aggressive x 2 schedules
  body = lines[2:]
  assert body[0] == ("| dense | dense | 0, 1 | 0.650 (0.600-0.700) | 0.100 | 0.750 | - | - "
                     "| - |")
  assert body[1].startswith("| tau | schedule.json, tau_schedule.json | 0, 1 | "
                            "0.700 (0.650-0.750) | 0.100 |"), body[1]
  assert body[1].endswith("| 0.920 | 3 of 6 |")
  # seeds sorted, means over seeds, tau misses summed over every seed's steps
  assert body[2] == ("| aggressive | constant:2 | 0, 1 | 0.650 (0.500-0.800) | 0.300 | 0.750 "
                     "| 0.500 | 0.400 | 5 of 6 |")
  assert body[3].startswith("| aggressive | constant:8 | 2 | 0.600 (0.600-0.600) |")


def test_permutation_p_is_exact_and_counts_ties():
  # 3 vs 3, every score of a above every score of b: 1 of C(6, 3) = 20 splits is as extreme
  one, two = study.permutation_p([0.70, 0.71, 0.72], [0.60, 0.62, 0.64])
  assert (one, two) == (1 / 20, 2 / 20)
  # the reverse direction: every split's difference is at least the observed (lowest) one
  assert study.permutation_p([0.60, 0.62, 0.64], [0.70, 0.71, 0.72]) == (1.0, 2 / 20)
  # float64 brute force on an unbalanced case with a tie
  a, b = [0.5, 0.7], [0.5, 0.6, 0.4]
  pool, obs = a + b, np.mean(a) - np.mean(b)
  d = [np.mean([pool[i] for i in c]) - np.mean([pool[i] for i in range(5) if i not in c])
       for c in itertools.combinations(range(5), 2)]
  one, two = study.permutation_p(a, b)
  assert one == pytest.approx(np.mean([x >= obs - 1e-12 for x in d]))
  assert two == pytest.approx(np.mean([abs(x) >= abs(obs) - 1e-12 for x in d]))
  with pytest.raises(ValueError, match="both groups"):
    study.permutation_p([], [0.5])


def test_vs_dense_pairs_seeds_and_tests_all_of_them():
  row = lambda arm, seed, after, sched: {"arm": arm, "seed": seed, "schedule": sched,
                                        "heldout_avg4_after": after}
  rows = [row("dense", 0, 0.60, "dense"), row("dense", 1, 0.64, "dense"),
          row("dense", 2, 0.62, "dense"),
          row("tau", 0, 0.70, "a/schedule.json"), row("tau", 2, 0.72, "b/tau_schedule.json"),
          row("tau", 1, 0.71, "b/tau_schedule.json"),
          row("aggressive", 1, 0.50, "constant:2"), row("aggressive", 3, 0.66, "constant:2")]
  lines = study.vs_dense(rows, 4)
  assert len(lines) == 2 + 2, lines
  # tau: seeds 0-2 pair with dense's 0-2 (+0.10, +0.07, +0.10); 3 vs 3 all above: p 1/20
  assert lines[2] == ("| tau | schedule.json, tau_schedule.json | 0, 1, 2 | +0.090 (+0.070 to "
                      "+0.100) | 3 of 3 | +0.090 | 0.050 / 0.100 |"), lines[2]
  # aggressive: only seed 1 has a dense run of the same seed; the test uses both seeds
  assert lines[3].startswith("| aggressive | constant:2 | 1, 3 | -0.140 (-0.140 to -0.140) "
                             "| 0 of 1 | -0.040 | "), lines[3]
  assert study.vs_dense([r for r in rows if r["arm"] != "dense"], 4) == []


def test_versus_compares_corrected_arms_with_their_base_on_avg_and_pass():
  row = lambda arm, seed, avg, pas: {"arm": arm, "seed": seed, "schedule": "constant:2",
                                     "heldout_avg4_after": avg, "heldout_pass4_after": pas}
  rows = [row("dense", 0, 0.70, 0.80), row("aggressive", 0, 0.60, 0.75),
          row("aggressive", 1, 0.64, 0.70), row("aggressive_token_tis", 0, 0.66, 0.74),
          row("aggressive_token_tis", 1, 0.68, 0.78), row("aggressive_distill", 0, 0.65, 0.8)]
  lines = study.versus(rows, 4, "aggressive", {"aggressive_token_tis"})
  assert len(lines) == 3 and "avg@4 minus aggressive's" in lines[0], lines
  # same seeds: +0.06, +0.04; 2 vs 2 with both above: 1 of C(4, 2) = 6 splits one-sided
  assert lines[2] == ("| aggressive_token_tis | constant:2 | 0, 1 | +0.050 (+0.040 to +0.060) "
                      "| 2 of 2 | +0.050 | 0.167 / 0.333 |"), lines[2]
  # pass@4: -0.01 and +0.08
  (line,) = study.versus(rows, 4, "aggressive", {"aggressive_token_tis"}, "pass")[2:]
  assert line.startswith("| aggressive_token_tis | constant:2 | 0, 1 | +0.035 (-0.010 to "
                         "+0.080) | 1 of 2 | +0.035 |"), line
  # no listed arm, or no seed of the base: nothing
  assert study.versus(rows, 4, "aggressive", {"aggressive_icepop"}) == []
  assert study.versus(rows, 4, "tau", {"aggressive_token_tis"}) == []
  assert study.vs_dense(rows, 4) == study.versus(rows, 4, "dense")


def test_cost_and_correction_means_over_steps_then_seeds():
  rows = [{"arm": "dense", "seed": 0, "schedule": "dense", "rollout_s_per_step": 4.0},
          {"arm": "aggressive_geo_rs_token_tis", "seed": 0, "schedule": "constant:2",
           "rollout_s_per_step": 6.0, "ess_mean": 0.8, "rejected_frac_mean": 0.4,
           "rejected_seq_frac_mean": 0.3, "is_weight_max": [2.0, 4.0]},
          {"arm": "aggressive_geo_rs_token_tis", "seed": 1, "schedule": "constant:2",
           "rollout_s_per_step": 8.0, "ess_mean": 0.9, "rejected_frac_mean": 0.2,
           "rejected_seq_frac_mean": 0.1, "is_weight_max": [1.0, None]}]
  lines = study.cost_and_correction(rows)
  assert lines[2] == "| dense | dense | 0 | 4.000 | - | - | - | - |", lines[2]
  assert lines[3] == ("| aggressive_geo_rs_token_tis | constant:2 | 0, 1 | 7.000 | 0.850 | "
                      "0.300 | 0.200 | 2.000 |"), lines[3]
