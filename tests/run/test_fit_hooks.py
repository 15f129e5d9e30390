"""Around each RL step: completions logged every N steps (JSONL, TensorBoard text, wandb),
validation on held-out prompts (avg@k, pass@k, tail alpha), optional wandb through a fake
module, and metrics.jsonl rewritten to one record per step when a run restarts."""

import json
import sys
import types

import pytest

from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.metrics import MetricsLogger, read_jsonl
from sparrow_jax.run.trainer import Trainer

SMALL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16"]


class _FakeRun:
  def __init__(self, calls, **kw):
    self.calls, self.id = calls, kw.get("id") or "run-1"
    calls.append(("init", kw))

  def log(self, data, step=None):
    self.calls.append(("log", step, data))

  def finish(self):
    self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
  calls = []
  mod = types.ModuleType("wandb")
  mod.init = lambda **kw: _FakeRun(calls, **kw)
  mod.Table = lambda columns, data: ("table", tuple(columns), [tuple(r) for r in data])
  monkeypatch.setitem(sys.modules, "wandb", mod)
  return calls


def test_samples_validation_and_wandb(tmp_path, fake_wandb):
  val = tmp_path / "val.jsonl"
  val.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                         for a, b in [(1, 2), (3, 4), (5, 1)]))
  out = tmp_path / "run"
  cfg = get_train_config("tiny", SMALL + [
      f"out_dir={out}", "num_steps=3", f"val_data={val}", "val_every=2", "val_k=2",
      "sample_every=2", "samples_per_log=3", "logger=tensorboard,wandb",
      "wandb_project=proj"])
  tr = Trainer(cfg, quiet=True)
  tr.fit()
  recs = read_jsonl(str(out / "metrics.jsonl"))
  # validation at step 2 (val_every) and step 3 (the last): avg@k, pass@k, tail alpha
  assert "val/avg@2" not in recs[1]
  for s in (2, 3):
    r = recs[s]
    assert r["val/prompts"] == 3.0 and 0 <= r["val/avg@2"] <= r["val/pass@2"] <= 1
    assert 0.0 <= r["val/alpha_p5"] <= 1.0
  # samples every 2 steps: 3 rows of step 2, one from each of three prompts first
  rows = [json.loads(x) for x in (out / "samples.jsonl").open()]
  assert [r["step"] for r in rows] == [2, 2, 2]
  assert len({r["prompt"] for r in rows}) == 3
  ex = {e.prompt: e.answer for e in tr.examples}
  for r in rows:
    assert ex[r["prompt"]] == r["answer"] and r["reward"] in (0.0, 1.0)
    assert set(r) == {"step", "prompt", "answer", "response", "reward", "finish"}
  tb = b"".join(p.read_bytes() for p in (out / "tb").iterdir())
  assert b"samples" in tb and rows[0]["prompt"].encode() in tb
  # wandb: one run (config, project, dir), every step's scalars, the sample table, finish
  init = [c for c in fake_wandb if c[0] == "init"]
  assert len(init) == 1 and init[0][1]["project"] == "proj"
  assert init[0][1]["config"]["val_k"] == 2 and init[0][1]["dir"] == str(out)
  logs = [c for c in fake_wandb if c[0] == "log"]
  steps = [c[1] for c in logs if "reward/mean" in c[2]]
  assert steps == [1, 2, 3]
  assert logs[1][2]["reward/mean"] == pytest.approx(recs[2]["reward/mean"])
  table = [c for c in logs if "samples" in c[2]]
  assert len(table) == 1 and table[0][1] == 2 and len(table[0][2]["samples"][2]) == 3
  assert fake_wandb[-1] == ("finish",)
  assert (out / "wandb_run_id").read_text().strip() == "run-1"


def test_wandb_is_optional(tmp_path, monkeypatch, capsys):
  import experiments.train as train_cli
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  assert train_cli.main(SMALL + [f"out_dir={tmp_path}", "logger=tensorboard,wandb"]) == 2
  assert "logger=wandb needs the wandb package" in capsys.readouterr().err
  assert get_train_config("tiny").loggers == ("tensorboard",)
  assert get_train_config("tiny", ["tensorboard=false"]).loggers == ()
  assert get_train_config("tiny", ["logger=none"]).loggers == ()


def test_restart_keeps_one_record_per_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [{"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 2, "v": 22}, {"step": 3, "v": 3}]
  path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "v"')
  (tmp_path / "samples.jsonl").write_text('{"step": 2, "p": 1}\n{"step": 3, "p": 2}\n')
  log = MetricsLogger(str(tmp_path), total_steps=5, tensorboard=False, start_step=2,
                      quiet=True)
  assert [r["v"] for r in log.history] == [1, 22]
  assert [json.loads(x)["v"] for x in path.open()] == [1, 22]
  assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").open()] == [2]
  log.log(3, {"v": 33.0})
  log.close()
  assert [json.loads(x)["v"] for x in path.open()] == [1, 22, 33.0]
  MetricsLogger(str(tmp_path), total_steps=5, tensorboard=False, quiet=True).close()
  assert path.read_text() == ""  # a fresh start redoes every step
