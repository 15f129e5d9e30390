"""Every script's `--help` (issue 50): the examples keep their line continuations, defaults are
shown, and eval / generate / calibrate list the presets their --config takes."""

import pytest

import experiments.calibrate as calibrate_cli
import experiments.eval as eval_cli
import experiments.export as export_cli
import experiments.generate as gen_cli
import experiments.prepare_data as prep_cli
import experiments.train as train_cli


def _help(main, capsys) -> str:
  with pytest.raises(SystemExit) as e:
    main(["--help"])
  assert e.value.code == 0
  return capsys.readouterr().out


def test_examples_keep_their_line_breaks(capsys):
  for main in (train_cli.main, eval_cli.main, gen_cli.main, calibrate_cli.main, prep_cli.main):
    out = _help(main, capsys)
    cont = [ln for ln in out.splitlines() if ln.rstrip().endswith("\\")]
    assert cont, main.__module__  # each has a continued example
    lines = out.splitlines()
    for ln in cont:  # ... and the next line is its indented continuation
      nxt = lines[lines.index(ln) + 1]
      assert nxt.startswith("        "), (main.__module__, ln, nxt)
  assert "        --process-id $I" in _help(train_cli.main, capsys)


def test_defaults_and_presets_shown(capsys):
  out = " ".join(_help(eval_cli.main, capsys).split())
  assert "--k K samples per prompt (default: 4)" in out
  assert "(default: dense)" in out and "the sparse actor with its DistillSparse LoRA" in out
  assert "training presets (--config NAME, or a YAML/JSON config file):" in out
  assert " qwen3_1p7b Qwen3-1.7B" in out
  out = " ".join(_help(gen_cli.main, capsys).split())
  assert "--temperature TEMPERATURE 0 = greedy (default: 0.0)" in out
  assert "model presets (--config NAME): qwen3_0p6b" in out
  out = " ".join(_help(calibrate_cli.main, capsys).split())
  assert "target p5 acceptance rate (0, 1] (default: 0.86)" in out and "smollm2_135m" in out
  out = " ".join(_help(export_cli.main, capsys).split())
  assert "--dtype" in out and "usage: " in out
  out = " ".join(_help(prep_cli.main, capsys).split())
  assert "{gsm8k,math,verl}" in out and "(default: 0)" in out
