"""End-to-end calibration on a random 4-layer tiny model (CLI + library), resume, errors.

Setup: 4 prompts x 2 samples, 110 generated tokens each (actor: the largest budget), page size
4 (a sequence spans ~35 pages), budgets 1/2/4 pages (+1 bos +2 recent), layer 0 dense, bins of
80 tokens (two bins).

How tau is chosen (from the measured table, so the test stays meaningful for any seed): the
candidates are the midpoints between consecutive distinct p5 values of the table; among those
whose schedule uses more than the smallest budget somewhere and is feasible in both bins, take
the one farthest from every table value (largest margin). The written schedule must then hold
the re-measured p5 >= tau in every bin where some budget reached it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import traceback

import numpy as np
import pytest

from sparrow_jax.rl.logprobs import token_logprobs
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets
from sparrow_jax.calibration import calibrate as cal
from sparrow_jax.schedule.schedule import SparsitySchedule, schedule_from_p5

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("calibrate_cli",
                                               os.path.join(_ROOT, "experiments", "calibrate.py"))
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

BUDGETS = (1, 2, 4)
BIN = 80
PROMPTS = ["Tell me a story about a cat.", "Explain how rain forms in the clouds.",
           "List ten fruits.", "Why is the sky blue?"]


def _argv(out, prompts, tau, budgets=BUDGETS, extra=()):
  return ["--config", "tiny", "--set", "num_layers=4", "--dense-layers", "0",
          "--prompts", str(prompts), "--budgets", ",".join(map(str, budgets)),
          "--page-size", "4", "--bin-size", str(BIN), "--max-new-tokens", "110",
          "--num-samples", "2", "--ignore-eos", "--min-count", "10", "--tau", str(tau),
          "--out", str(out), "--no-progress", *extra]


def _read_table(path):
  with open(path) as f:
    rows = list(csv.DictReader(f))
  budgets = sorted({int(r["budget"]) for r in rows})
  nb = max(int(r["bin"]) for r in rows) + 1
  p5 = np.full((nb, len(budgets)), np.nan)
  count = np.zeros((nb, len(budgets)), int)
  for r in rows:
    i, j = int(r["bin"]), budgets.index(int(r["budget"]))
    p5[i, j], count[i, j] = float(r["p5"]), int(r["count"])
  return rows, budgets, p5, count


def _max_margin_tau(p5, budgets):
  vals = np.unique(p5[np.isfinite(p5)])
  best = None
  for lo, hi in zip(vals[:-1], vals[1:]):
    tau = float(lo + hi) / 2
    sched, feasible = schedule_from_p5(p5, budgets, tau=tau, bin_size=BIN, page_size=4)
    if max(sched.budgets) > budgets[0] and feasible.all():
      margin = float(np.nanmin(np.abs(p5 - tau)))
      if best is None or margin > best[0]:
        best = (margin, tau)
  assert best is not None, f"no tau gives a non-trivial schedule for table {p5}"
  return best[1]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
  p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
  p.write_text("\n".join(PROMPTS) + "\n")
  return p


def _run_interrupted(fn) -> None:
  """Call `fn`, which must stop with the simulated Ctrl-C, and release what the interrupted
  run held right away: the KeyboardInterrupt's traceback holds every frame of the calibration
  (model, engine, jitted closures). Cleared here, none of it is left for the session's final
  garbage collection, where the suite reported a stray KeyboardInterrupt (issue 12, item 15;
  not reproduced on the 2-core dev machine, so this is the likely cause, not a proven one)."""
  try:
    fn()
  except KeyboardInterrupt as e:
    traceback.clear_frames(e.__traceback__)
  else:
    pytest.fail("the simulated Ctrl-C did not stop the run")


def test_calibration_end_to_end_resume_and_schedule(tmp_path, prompts_file, monkeypatch):
  out = tmp_path / "calib"
  calls = []
  real_measure = cal.TeacherForced.measure

  def counting(self, traj, dense_path, table, **kw):
    calls.append(tuple(as_schedule(table).budgets))
    if calls[-1] == (4,) and interrupt[0]:
      raise KeyboardInterrupt  # simulated Ctrl-C while budget 4 is being measured
    return real_measure(self, traj, dense_path, table, **kw)

  monkeypatch.setattr(cal.TeacherForced, "measure", counting)

  # 1. Interrupted run: budgets 1 and 2 finish and are cached; budget 4 is not.
  interrupt = [True]
  _run_interrupted(lambda: cli.run(_argv(out, prompts_file, tau=0.999)))
  assert calls == [(1,), (2,), (4,)]
  assert (out / "alpha_budget_1.npz").is_file() and (out / "alpha_budget_2.npz").is_file()
  assert not (out / "alpha_budget_4.npz").exists()
  mtimes = {k: os.stat(out / f"alpha_budget_{k}.npz").st_mtime_ns for k in (1, 2)}
  mtimes["traj"] = os.stat(out / "trajectories.npz").st_mtime_ns

  # 2. Resume: only budget 4 (and the schedule check) is computed.
  interrupt[0] = False
  calls.clear()
  rc, res = cli.run(_argv(out, prompts_file, tau=0.999))
  assert rc == 0
  assert calls[0] == (4,) and all(len(c) == res.num_bins for c in calls[1:])
  assert {"trajectories", "dense", "budget_1", "budget_2"} <= set(res.reused)
  assert "budget_4" in res.computed and "trajectories" not in res.computed
  for k in (1, 2):
    assert os.stat(out / f"alpha_budget_{k}.npz").st_mtime_ns == mtimes[k]
  assert os.stat(out / "trajectories.npz").st_mtime_ns == mtimes["traj"]
  traj = res.trajectories
  assert traj.num == 8 and set(traj.finish_reasons) == {"length"}
  assert np.all(traj.lengths - traj.prompt_lengths == 110)

  # 3. The table: two bins, every budget, counts = generated tokens, p5 <= mean, monotone-ish.
  rows, budgets, p5, count = _read_table(out / "alpha_table.csv")
  assert budgets == list(BUDGETS) and p5.shape == (2, 3)
  assert set(rows[0]) == set(cal.TABLE_FIELDS)
  np.testing.assert_array_equal(count.sum(0), traj.num_generated)
  for r in rows:
    assert 0.0 <= float(r["p1"]) <= float(r["p5"]) <= float(r["p10"]) <= float(r["p50"]) <= 1.0
    assert float(r["p5"]) <= float(r["mean"]) + 1e-9
  assert p5[-1, -1] > p5[-1, 0], f"more pages should match the dense policy better: {p5}"

  # 4. tau from the table (module docstring), rerun: nothing but the schedule check computed.
  tau = _max_margin_tau(p5, budgets)
  calls.clear()
  rc, res = cli.run(_argv(out, prompts_file, tau=tau))
  assert rc == 0 and all(len(c) == res.num_bins for c in calls)
  assert not [c for c in res.computed if c.startswith(("budget", "traj", "dense"))]
  sched = SparsitySchedule.from_json(out / "schedule.json")
  assert sched.tau == pytest.approx(tau) and sched.page_size == 4 and sched.bin_size == BIN
  assert sched.dense_layers == (0,) and sched.reserved == 3
  # Both bins held tokens: the table was measured below position 2 * BIN.
  assert np.isfinite(p5).any(axis=1).all() and sched.calibrated_to == 2 * BIN
  assert list(sched.budgets) == sorted(sched.budgets), "schedule must be non-decreasing"
  assert max(sched.budgets) > min(BUDGETS), "tau was picked so that some bin needs more"
  want, feasible = schedule_from_p5(p5, budgets, tau=tau, bin_size=BIN, page_size=4)
  assert feasible.all()
  first = res.history[0]["budgets"]
  assert first == list(want.budgets), "table choice: smallest budget with p5 >= tau per bin"
  assert list(sched.budgets) == res.history[-1]["budgets"]
  assert all(a >= b for a, b in zip(sched.budgets, first))
  for i, b in enumerate(sched.budgets):  # the smallest table budget, unless verification bumped
    assert b == want.budgets[i] or i in sum((h["short_bins"] for h in res.history), [])

  # 5. Re-measure independently with the written schedule (dense pass recomputed too).
  model, _, _ = cal.build_model("tiny", overrides={"num_layers": 4})
  tf = cal.TeacherForced(model, res.config, max_budget=max(BUDGETS))
  dense_path = str(tmp_path / "dense_again.npy")
  tf.dense_hidden(traj, dense_path, progress=False)
  np.testing.assert_allclose(np.load(dense_path), np.load(out / "dense_hidden.npy"), atol=1e-5)
  again = tf.measure(traj, dense_path, sched, progress=False).stats(BIN, 2)
  for i in range(2):
    assert again.count[i] >= 10
    assert again.p5[i] >= tau, f"bin {i}: re-measured p5 {again.p5[i]:.5f} < tau {tau:.5f}"
  np.testing.assert_allclose(again.p5, res.schedule_stats.p5, atol=1e-6)

  # 6. Outputs: PNG, summary, schedule CSV.
  png = (out / "p5_vs_position.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  summary = json.loads((out / "summary.json").read_text())
  assert summary["schedule"]["budgets"] == list(sched.budgets)
  with open(out / "schedule_alpha.csv") as f:
    srows = list(csv.DictReader(f))
  assert [int(r["budget"]) for r in srows] == list(sched.budgets)


def test_interrupted_generation_resumes_per_trajectory(tmp_path, prompts_file, monkeypatch):
  """Killed during generation (here: after its 3rd finished trajectory), a calibration keeps
  what it sampled in the journal; the rerun generates only the other 5 and keeps the 3 as
  they were (a line cut short by the kill is ignored)."""
  from sparrow_jax.engine.engine import GenerationEngine

  out = tmp_path / "calib"
  extra = ("--num-slots", "4", "--no-verify")  # two waves of 4 sequences
  argv = [a if a != "110" else "24" for a in _argv(out, prompts_file, 0.9, (1, 2), extra)]
  submitted = []
  real_generate = GenerationEngine.generate

  def generate(self, reqs, **kw):
    submitted.append([r.sampling.seed for r in reqs])
    inner = kw.get("on_finish")
    if stop_after[0] is not None and inner is not None:
      def on_finish(i, c):
        inner(i, c)
        if sum(1 for _ in open(out / cal.JOURNAL)) >= stop_after[0]:
          raise KeyboardInterrupt  # simulated Ctrl-C mid-generation
      kw["on_finish"] = on_finish
    return real_generate(self, reqs, **kw)

  monkeypatch.setattr(GenerationEngine, "generate", generate)
  stop_after = [3]
  _run_interrupted(lambda: cli.run(argv))
  lines = (out / cal.JOURNAL).read_text().splitlines()
  assert len(lines) == 3 and not (out / "trajectories.npz").exists()
  kept = {json.loads(ln)["i"]: json.loads(ln) for ln in lines}
  with open(out / cal.JOURNAL, "a") as f:
    f.write('{"i": 7, "tokens": [5, 6')  # the line the kill cut short
  stop_after[0] = None
  submitted.clear()

  def stop_after_generation(*a, **k):  # the teacher-forced passes are tested above
    raise KeyboardInterrupt

  monkeypatch.setattr(cal, "TeacherForced", stop_after_generation)
  _run_interrupted(lambda: cli.run(argv))
  all_seeds = [(0 * 1_000_003 + j) & 0x7FFFFFFF for j in range(8)]
  assert len(submitted) == 1 and sorted(submitted[0]) == sorted(
      s for j, s in enumerate(all_seeds) if j not in kept)  # only the missing ones
  traj = cal.Trajectories.load(out / "trajectories.npz")
  assert traj.num == 8 and np.all(traj.lengths - traj.prompt_lengths == 24)
  for j, rec in kept.items():  # the journal's trajectories, unchanged
    np.testing.assert_array_equal(traj.generated(j), rec["tokens"])
    np.testing.assert_array_equal(traj.logprobs[j, traj.prompt_lengths[j]:traj.lengths[j]],
                                  np.asarray(rec["logprobs"], np.float32))
  assert not (out / cal.JOURNAL).exists()  # all in trajectories.npz now


def test_alpha_alignment_with_the_rollout(tmp_path, prompts_file):
  """Positions line up: the teacher-forced sparse actor reproduces the engine's log-probs of
  the sampled tokens, the first generated token (dense prefill) has alpha = 1, and a budget
  covering every page gives alpha = 1 everywhere."""
  cfg = cal.CalibrationConfig(budgets=(1, 64), gen_budget=1, page_size=4, dense_layers=(0,),
                              max_new_tokens=40, num_samples=1, ignore_eos=True, bin_size=BIN)
  model, tok, _ = cal.build_model("tiny", overrides={"num_layers": 4})
  ids = cal.encode_prompts(tok, PROMPTS[:2])
  traj = cal.generate_trajectories(model, ids, cfg, progress=False)  # actor: 1 page
  tp = -(-int(traj.lengths.max()) // 4) * 4
  tokens = np.zeros((traj.num, tp), np.int32)
  tokens[:, :traj.tokens.shape[1]] = traj.tokens
  stats = token_logprobs(model, tokens, lengths=traj.lengths, attention=cfg.attention(1),
                         budgets=teacher_forced_budgets(as_schedule(1), tp, traj.num),
                         prompt_lengths=traj.prompt_lengths)
  logp = np.asarray(stats.logp)
  for i in range(traj.num):
    p0, n = traj.prompt_lengths[i], traj.lengths[i]
    np.testing.assert_allclose(logp[i, p0:n], traj.logprobs[i, p0:n], atol=2e-4)

  tf = cal.TeacherForced(model, cfg, max_budget=64)
  dense_path = str(tmp_path / "dense.npy")
  tf.dense_hidden(traj, dense_path, progress=False)
  s1 = tf.measure(traj, dense_path, 1, progress=False)
  assert s1.alpha.shape == (traj.num_generated,)
  first = s1.position == traj.prompt_lengths[s1.sequence]  # predicted by the dense prefill
  np.testing.assert_allclose(s1.alpha[first], 1.0, atol=1e-6)
  assert s1.alpha[~first].min() < 0.99, "one page of 4 tokens must change the actor"
  s64 = tf.measure(traj, dense_path, 64, progress=False)  # 64 + 3 pages >= every sequence
  np.testing.assert_allclose(s64.alpha, 1.0, atol=1e-5)


def test_load_prompts_formats_and_errors(tmp_path):
  j = tmp_path / "p.jsonl"
  j.write_text('{"prompt": "a"}\n\n"b"\n{"question": [{"role": "user", "content": "c"}]}\n')
  got = cal.load_prompts(j)
  assert got[:2] == ["a", "b"] and got[2][0]["content"] == "c"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"answer": "x"}\n')
  with pytest.raises(ValueError, match="line 1.*'prompt'"):
    cal.load_prompts(bad)
  with pytest.raises(ValueError, match="does not exist"):
    cal.load_prompts(tmp_path / "missing.txt")
  with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
    (tmp_path / "p.csv").write_text("x\n")
    cal.load_prompts(tmp_path / "p.csv")


def test_cli_errors_exit_2(tmp_path, prompts_file, capsys):
  with pytest.raises(SystemExit) as e:
    cli.run(_argv(tmp_path / "o", prompts_file, 0.9, budgets=(0, 2)))
  assert e.value.code == 2 and "--budgets" in capsys.readouterr().err
  rc, _ = cli.run(_argv(tmp_path / "o", prompts_file, 0.9, extra=("--page-size", "3")))
  assert rc == 2 and "--page-size" in capsys.readouterr().err
  rc, _ = cli.run(_argv(tmp_path / "o", tmp_path / "none.txt", 0.9))
  assert rc == 2 and "none.txt" in capsys.readouterr().err
  rc, _ = cli.run(_argv(tmp_path / "o", prompts_file, 0.9, extra=("--dense-layers", "0,9")))
  assert rc == 2 and "--dense-layers" in capsys.readouterr().err
  rc, _ = cli.run(["--config", "qwen3_0p6b", "--prompts", str(prompts_file), "--budgets", "4",
                   "--out", str(tmp_path / "o")])
  assert rc == 2 and "--model-path" in capsys.readouterr().err
  # A directory made with other generation settings is refused, not overwritten.
  out = tmp_path / "o2"
  out.mkdir()
  (out / "manifest.json").write_text(json.dumps({"seed": 123}))
  rc, _ = cli.run(_argv(out, prompts_file, 0.9))
  assert rc == 2 and "other settings" in capsys.readouterr().err
  assert json.loads((out / "manifest.json").read_text()) == {"seed": 123}


def test_plot_labels_follow_their_bins_when_a_bin_is_empty(tmp_path, monkeypatch):
  """Bin 1 has no tokens: its point is dropped, and bin 2's point keeps bin 2's budget (the
  labels were zipped with the filtered points, so they shifted)."""
  import types

  import matplotlib.axes

  nan = float("nan")
  stats = types.SimpleNamespace(centre=np.array([40.0, 120.0, 200.0]),
                                p5=np.array([0.95, nan, 0.90]), count=np.array([30, 0, 25]))
  res = types.SimpleNamespace(
      config=types.SimpleNamespace(tau=0.86, bin_size=80, page_size=4, actor_budget=4),
      budgets=(1, 2, 4), stats={k: stats for k in (1, 2, 4)},
      p5=np.array([[0.95, 0.96, 0.97], [nan, nan, nan], [0.70, 0.80, 0.90]]),
      schedule=SparsitySchedule(budgets=(1, 2, 4), bin_size=80, page_size=4),
      schedule_stats=stats, num_bins=3)
  labels = []
  real = matplotlib.axes.Axes.annotate
  monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                      lambda self, text, xy, **kw: labels.append((text, tuple(xy)))
                      or real(self, text, xy, **kw))
  cal.plot_p5(res, str(tmp_path / "re_measured.png"))
  assert labels == [("1", (40.0, 0.95)), ("4", (200.0, 0.90))]
  labels.clear()
  res.schedule_stats = None  # from the table: the chosen budget's column, per bin
  cal.plot_p5(res, str(tmp_path / "table.png"))
  assert labels == [("1", (40.0, 0.95)), ("4", (200.0, 0.90))]
