"""Re-running, resuming and interrupting a training run through experiments/train.py:
an existing out_dir is refused up front, --resume reads the saved config, config changes are
gated and recorded, metrics.jsonl keeps one record per step, Ctrl-C/SIGTERM save and exit 130,
and cheap config errors come before the model is built."""

import json
import os
import signal

import pytest

import experiments.train as train_cli
from sparrow_jax.run import runs
from sparrow_jax.run import trainer as trainer_lib
from sparrow_jax.run.config import get_train_config

SMALL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false"]


def _lines(path):
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


@pytest.fixture
def no_model(monkeypatch):
  """Building the model is the expensive part: any test using this fixture must fail first."""
  def build_model(cfg):
    raise AssertionError("the model was built")
  monkeypatch.setattr(trainer_lib, "build_model", build_model)


def test_existing_out_dir_is_refused_before_any_work(tmp_path, capsys, no_model):
  out = tmp_path / "run"
  (out / "checkpoints" / "4").mkdir(parents=True)
  (out / "metrics.jsonl").write_text('{"step": 1}\n')
  (out / "notes.txt").write_text("mine")
  assert train_cli.main(SMALL + [f"out_dir={out}"]) == 2
  err = capsys.readouterr().err
  assert str(out) in err and "--resume" in err and "--overwrite" in err
  assert "checkpoints (step 4)" in err and "metrics.jsonl" in err
  assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched
  # --overwrite goes on (and reaches the model build, here stubbed out to fail) only after
  # the config is valid; it removed the old run's outputs but not other files.
  with pytest.raises(AssertionError, match="model was built"):
    train_cli.main(SMALL + [f"out_dir={out}", "--overwrite"])
  assert "removed checkpoints, metrics.jsonl" in capsys.readouterr().err
  assert sorted(os.listdir(out)) == ["notes.txt"]
  assert train_cli.main(["--resume", "--overwrite", f"out_dir={out}"]) == 2


def test_bad_config_fails_before_the_model_is_built(tmp_path, capsys, no_model):
  cases = [("data=/no/such/file.jsonl", "does not exist"),
           ("reward=no_such_reward", "no_such_reward"),
           ("schedule=nonsense", "not understood"),
           ("val_data=/no/val.jsonl", "does not exist"),
           ("dense_layers=a,b", "dense_layers"),
           ("logger=tensorboard,nope", "logger")]
  for override, msg in cases:
    assert train_cli.main(SMALL + [f"out_dir={tmp_path / 'o'}", override]) == 2, override
    assert msg in capsys.readouterr().err, override
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
  assert train_cli.main(SMALL + [f"out_dir={tmp_path / 'o'}", f"data={bad}"]) == 2
  assert "bad.jsonl:2" in capsys.readouterr().err


def test_over_long_prompts_are_counted(tmp_path, capsys):
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                          for p in ["1+0="] * 5 + ["9" * 40 + "+1=", "8" * 50 + "+1="]))
  cfg = get_train_config("tiny", SMALL + [f"out_dir={tmp_path}", f"data={data}",
                                          "max_prompt_len=16"])
  tr = trainer_lib.Trainer(cfg, quiet=True)
  assert len(tr.examples) == 5 and tr.num_dropped_prompts == 2
  err = capsys.readouterr().err
  assert "dropped 2 of 7 prompts longer than max_prompt_len=16 tokens (longest 54" in err


def test_resume_reads_the_saved_config_and_gates_changes(tmp_path, capsys):
  out = tmp_path / "run"
  base = SMALL + [f"out_dir={out}", "distill=false", "save_every=1", "seed=3"]
  assert train_cli.main(base + ["num_steps=2", "--quiet"]) == 0
  saved = json.loads((out / "config.json").read_text())
  assert saved["seed"] == 3 and saved["group_size"] == 4 and saved["save_every"] == 1
  capsys.readouterr()
  # Changing what the run trains needs --allow-config-change; nothing is written before.
  before = (out / "metrics.jsonl").read_text()
  assert train_cli.main(["--resume", f"out_dir={out}", "group_size=8", "num_steps=3"]) == 2
  err = capsys.readouterr().err
  assert "group_size: 4 -> 8" in err and "--allow-config-change" in err
  assert (out / "metrics.jsonl").read_text() == before
  assert not (out / "config_changes.jsonl").exists()
  # --resume with only out_dir and a longer run: the saved seed/group_size/... are kept.
  assert train_cli.main(["--resume", f"out_dir={out}", "num_steps=3", "--quiet"]) == 0
  assert "num_steps 2 -> 3" in capsys.readouterr().err
  cfg = json.loads((out / "config.json").read_text())
  assert cfg == dict(saved, num_steps=3)
  (change,) = _lines(out / "config_changes.jsonl")
  assert change["resumed_step"] == 2 and change["changes"] == {"num_steps": [2, 3]}
  assert change["alters_run"] == []
  # A change with --allow-config-change is accepted and recorded as altering the run.
  assert train_cli.main(["--resume", f"out_dir={out}", "num_steps=4", "lr=0.002",
                         "--allow-config-change", "--quiet"]) == 0
  change = _lines(out / "config_changes.jsonl")[-1]
  assert change["changes"]["lr"] == [0.001, 0.002] and change["alters_run"] == ["lr"]
  assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_resumed_steps_replace_their_metrics_lines(tmp_path):
  out = tmp_path / "run"
  assert train_cli.main(SMALL + [f"out_dir={out}", "distill=false", "save_every=2",
                                 "num_steps=3", "--quiet"]) == 0
  # Pretend the process died after step 3 was logged but before its checkpoint: keep only
  # the step-2 checkpoint, and leave a torn line at the end of metrics.jsonl.
  (out / "checkpoints" / "3").rename(tmp_path / "gone")
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "reward/me')
  assert train_cli.main(["--resume", f"out_dir={out}", "--quiet"]) == 0
  recs = _lines(out / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3]  # step 3 redone once, no duplicate


def test_resume_config_rules(tmp_path):
  out = str(tmp_path / "r")
  with pytest.raises(FileNotFoundError, match="holds no run"):
    runs.resume_config(out, {})
  os.makedirs(out)
  cfg = get_train_config("tiny", [f"out_dir={out}"])
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f)
  res = runs.resume_config(out, {"num_steps": 80, "val_every": 5})
  assert res.cfg.num_steps == 80 and res.alters_run == ()
  with pytest.raises(ValueError, match="seed: 0 -> 1.*--allow-config-change"):
    runs.resume_config(out, {"seed": 1})
  cos = cfg.replace(lr_schedule="cosine")
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cos.to_dict(), f)
  with pytest.raises(ValueError, match="num_steps"):  # cosine decay spans num_steps
    runs.resume_config(out, {"num_steps": 80})
  moved = str(tmp_path / "moved")
  os.rename(out, moved)
  assert runs.resume_config(moved, {}, allow_change=True).cfg.out_dir == moved
  with open(os.path.join(moved, "config.json"), "w") as f:
    json.dump(dict(cfg.to_dict(), bogus=1), f)
  with pytest.raises(ValueError, match="unknown config keys \\['bogus'\\]"):
    runs.resume_config(moved, {})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_a_checkpoint_and_exits_130(tmp_path, capsys, monkeypatch, sig):
  out = tmp_path / "run"
  real_step = trainer_lib.Trainer.train_step
  # (SIG_IGN, not the default handler, where the tests run as a background job of a shell)
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

  def step_then_signal(self):
    metrics = real_step(self)
    if self.step == 2:
      os.kill(os.getpid(), sig)  # delivered to the handler before the loop goes on
    return metrics

  monkeypatch.setattr(trainer_lib.Trainer, "train_step", step_then_signal)
  # save_every=10 (the default) would not save step 2: the signal does.
  rc = train_cli.main(SMALL + [f"out_dir={out}", "distill=false", "num_steps=5", "--quiet"])
  assert rc == 130
  err = capsys.readouterr().err
  name = signal.Signals(sig).name
  assert f"{name}: stopped after step 2, checkpoint saved; resume with: python " \
         f"experiments/train.py --resume out_dir={out}" in err
  assert "Traceback" not in err and len(err.splitlines()) <= 3
  assert sorted(os.listdir(out / "checkpoints")) == ["2"]
  assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2]
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # restored
  monkeypatch.setattr(trainer_lib.Trainer, "train_step", real_step)
  assert train_cli.main(["--resume", f"out_dir={out}", "--quiet"]) == 0
  assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_signal_inside_the_stop_agreement_stops_the_run_one_step_later(tmp_path, capsys,
                                                                         monkeypatch):
  """Multi-host: a signal that lands while the processes agree on stopping (after this one
  sent its flag) must not be overwritten by the agreed "no stop": it is agreed at the next
  step's end. (It was lost, and a SIGTERMed 2-process job ran to its last step.) Simulated in
  one process: the agreement at step 2's end is made, then the signal arrives inside it."""
  out = tmp_path / "run"
  real = trainer_lib.distributed.agree_stop
  seen = []

  def agree_then_signal(signame, allgather=None):
    seen.append(signame)
    agreed = real(signame)
    if len(seen) == 3:  # warm start's agreement, step 1's, then step 2's
      os.kill(os.getpid(), signal.SIGTERM)  # handled before the agreement returns
    return agreed

  monkeypatch.setattr(trainer_lib.distributed, "agree_stop", agree_then_signal)
  rc = train_cli.main(SMALL + [f"out_dir={out}", "distill=false", "num_steps=5", "--quiet"])
  assert rc == 130
  assert seen == [None, None, None, "SIGTERM"]
  assert "SIGTERM: stopped after step 3, checkpoint saved" in capsys.readouterr().err
  assert sorted(os.listdir(out / "checkpoints")) == ["3"]
  assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2, 3]


def test_default_save_every_is_ten():
  cfg = get_train_config("tiny")
  assert cfg.save_every == 10 and get_train_config("qwen3_1p7b").save_every == 20


def test_ctrl_c_during_the_warm_start_keeps_it(tmp_path, capsys, monkeypatch):
  """Interrupted in the warm start: the warmed-up policy is saved as step 0 and a resume
  goes straight to GRPO step 1 (no second warm start)."""
  out = tmp_path / "run"
  real = trainer_lib.Trainer.warmstart
  calls = []

  def warm_then_signal(self, logger=None):
    calls.append(1)
    res = real(self, logger)
    os.kill(os.getpid(), signal.SIGINT)
    return res

  monkeypatch.setattr(trainer_lib.Trainer, "warmstart", warm_then_signal)
  assert train_cli.main(SMALL + [f"out_dir={out}", "distill=false", "num_steps=2",
                                 "--quiet"]) == 130
  assert "stopped after step 0" in capsys.readouterr().err
  assert sorted(os.listdir(out / "checkpoints")) == ["0"] and calls == [1]
  assert train_cli.main(["--resume", f"out_dir={out}", "--quiet"]) == 0
  assert calls == [1] and [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2]
