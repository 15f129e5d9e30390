"""What a newcomer meets first on the command line (issue 21): `--help` with the presets and
key groups, `--list-keys`, a suggestion for a misspelt key, bad arguments refused before any
model loads, the eval legend, and logged byte responses that show their bytes."""

import dataclasses

import pytest

import experiments.eval as eval_cli
import experiments.generate as gen_cli
import experiments.train as train_cli
from sparrow_jax.run import config_help
from sparrow_jax.run.config import PRESETS, TrainConfig, get_train_config


def test_every_key_in_one_group_and_every_preset_described():
  grouped = [k for _, keys in config_help.KEY_GROUPS for k in keys]
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  assert sorted(grouped) == sorted(fields), (set(fields) ^ set(grouped))  # once each
  assert set(config_help.PRESET_HELP) == set(PRESETS)
  assert all(0 < len(v) <= 90 for v in config_help.PRESET_HELP.values())  # one line each


def test_help_lists_presets_and_key_groups(capsys):
  with pytest.raises(SystemExit) as e:
    train_cli.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for name in PRESETS:
    assert f"\n  {name} " in out, name
  assert "policy update: num_steps lr" in out and "DistillSparse: distill lora_rank" in out
  assert "--list-keys" in out and "no progress bar" in out  # --quiet has its help text


def test_list_keys_has_types_and_preset_defaults(capsys):
  assert train_cli.main(["--list-keys"]) == 0
  out = capsys.readouterr().out
  rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()
          if ln.startswith("  ") and not ln.startswith("   ")}  # (meanings: 6 spaces)
  assert rows["num_steps"] == ["int", "60"]  # the tiny preset's default
  assert rows["model_path"] == ["str", "or", "null", "null"]
  assert rows["distill"] == ["bool", "true"] and rows["lr"] == ["float", "0.001"]
  assert len(rows) == len(dataclasses.fields(TrainConfig))
  assert train_cli.main(["--config", "qwen3_1p7b", "--list-keys"]) == 0
  assert "  schedule" in (out := capsys.readouterr().out) and "qwen3-1.7b-0.86" in out
  assert train_cli.main(["--config", "nope", "--list-keys"]) == 2
  lines = out.splitlines()  # each key's meaning on the lines under it
  i = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["warmstart_steps"])
  assert lines[i + 1].startswith("      Supervised steps") and "before RL" in lines[i + 1]


def test_unknown_key_suggests_the_close_one(capsys):
  assert train_cli.main(["num_step=3"]) == 2
  err = capsys.readouterr().err
  assert "unknown config key 'num_step' (did you mean num_steps?)" in err
  assert "--list-keys" in err and len(err) < 300  # not the ~1,900 characters of every key
  with pytest.raises(ValueError, match=r"'zzz_qqq'; `python"):  # nothing close: no guess
    get_train_config("tiny", ["zzz_qqq=1"])


def test_generate_refuses_bad_arguments_before_loading(monkeypatch, capsys):
  """`--max-new-tokens -1` used to load the model for 15 s and then name
  SamplingParams.max_new_tokens; now argparse names the flag before anything loads."""
  import sparrow_jax.models as models
  import sparrow_jax.models.decoder as decoder

  def no_load(*a, **k):
    raise AssertionError("a model was loaded before the arguments were checked")

  monkeypatch.setattr(models, "load_pretrained", no_load)
  monkeypatch.setattr(decoder, "init_model", no_load)
  for flag, value, what in (("--max-new-tokens", "-1", "positive int"),
                            ("--top-p", "1.5", "(0, 1]"), ("--temperature", "-0.1", ">= 0"),
                            ("--page-size", "3", "power of two"), ("--top-k", "-2", ">= 0")):
    with pytest.raises(SystemExit) as e:
      gen_cli.main(["--prompt", "x", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: '{value}'" in err and what in err, err
    assert "SamplingParams" not in err
  assert gen_cli.main(["--prompt", "x", "--schedule", "nope"]) == 2  # before loading too
  assert "not understood" in capsys.readouterr().err
  assert gen_cli.main(["--prompt", "x", "--model-path", "/no/such.gguf"]) == 2
  assert "/no/such.gguf: no such file" in capsys.readouterr().err


def test_eval_legend_explains_the_two_at_1_figures():
  assert "avg@1 (and maj@1) read only the FIRST sample" in eval_cli.LEGEND
  assert "pass@1 is estimated from ALL k samples" in eval_cli.LEGEND


def test_logged_byte_responses_show_their_bytes():
  from sparrow_jax.rl.tokenizers import ByteTokenizer
  from sparrow_jax.run.fit_hooks import response_text

  tok = ByteTokenizer()
  cut = tok.encode("7€", add_bos=False)[:-1]  # '€' is 3 bytes: cut after 2
  assert tok.decode(cut) == "7\ufffd"  # scoring keeps the usual decode
  assert response_text(tok, cut) == "7\\xe2\\x82"
  assert response_text(tok, tok.encode("3+4=7", add_bos=False)) == "3+4=7"
