"""Config files and the key reference (issue 50): `--config` takes a YAML/JSON file (a run's
own config.json too) with key=value overrides on top; unknown keys in a file exit 2 naming the
file, line and key; every key has a meaning in docs/config.md and `--list-keys`."""

import dataclasses
import json

import pytest

import experiments.train as train_cli
from sparrow_jax.run import config_help
from sparrow_jax.run.config import PRESETS, TrainConfig, get_train_config

TINY = {"warmstart_steps": 5, "prompts_per_step": 4, "group_size": 4, "num_steps": 3,
        "tensorboard": False}


def test_yaml_file_with_overrides_on_top(tmp_path):
  path = tmp_path / "my.yaml"
  path.write_text("# a small run\npreset: smollm2_135m_study\nlr: 1e-5\nnum_steps: 7\n"
                  "dual_clip_c: null\ndense_layers: 0\ntis_cap: 2\nremat: no\n")
  cfg = get_train_config(str(path), ["num_steps=2"])
  study = PRESETS["smollm2_135m_study"]
  assert cfg == study.replace(lr=1e-5, num_steps=2, dual_clip_c=None, dense_layers="0",
                              tis_cap=2.0, remat=False)
  plain = tmp_path / "plain.yml"  # no preset: key -> tiny, as without --config
  plain.write_text("seed: 3\n")
  assert get_train_config(str(plain)) == PRESETS["tiny"].replace(seed=3)


def test_bad_files_name_file_line_and_key(tmp_path, capsys):
  path = tmp_path / "my.yaml"
  path.write_text("preset: tiny\nnum_steps: 2\nwarmstart_stpes: 5\n")
  assert train_cli.main(["--config", str(path)]) == 2
  err = capsys.readouterr().err
  assert f"{path}:3: unknown config key 'warmstart_stpes' (did you mean warmstart_steps?)" in err
  cases = {"preset: nope\n": "preset='nope': unknown training preset",
           "num_steps: many\n": ":1: num_steps='many': expected an integer",
           "lr: [1, 2]\n": ":1: lr=[1, 2]: expected float",
           "group_size: null\n": ":1: group_size: null is not allowed",
           "- 1\n- 2\n": "expected a mapping of config keys",
           "a: [\n": "not valid YAML/JSON",
           "temperature: 0\n": "temperature=0: greedy sampling"}
  for text, want in cases.items():
    path.write_text(text)
    with pytest.raises(ValueError, match=None) as e:
      get_train_config(str(path))
    assert want in str(e.value) and str(path) in str(e.value), (text, str(e.value))
  js = tmp_path / "c.json"
  js.write_text(json.dumps({"num_steps": 2, "lr_shedule": "cosine"}))
  assert train_cli.main(["--config", str(js)]) == 2
  assert "c.json:1: unknown config key 'lr_shedule' (did you mean lr_schedule?)" in \
      capsys.readouterr().err
  assert train_cli.main(["--config", str(tmp_path / "none.yaml")]) == 2
  assert "no such file" in capsys.readouterr().err
  assert not (tmp_path / "runs").exists()


def test_train_from_yaml_and_rerun_from_its_config_json(tmp_path, monkeypatch, capsys):
  """`train.py --config my.yaml num_steps=2` trains; the run's config.json given back to
  `--config` reproduces its settings (and `--list-keys` reads the file's values)."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "my.yaml").write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in TINY.items())
                                    + "out_dir: runs/a\n")
  assert train_cli.main(["--config", "my.yaml", "num_steps=2", "--quiet"]) == 0
  assert "summary: steps=2" in capsys.readouterr().out
  saved = json.loads((tmp_path / "runs" / "a" / "config.json").read_text())
  want = PRESETS["tiny"].replace(**{**TINY, "num_steps": 2, "out_dir": "runs/a"})
  assert saved == want.to_dict()
  again = get_train_config("runs/a/config.json", ["out_dir=runs/b"])
  assert again == want.replace(out_dir="runs/b")
  assert train_cli.main(["--config", "runs/a/config.json", "--list-keys"]) == 0
  out = capsys.readouterr().out
  assert any(ln.split() == ["num_steps", "int", "2"] for ln in out.splitlines())


def test_every_key_documented_and_docs_current():
  missing, stale = config_help.undocumented()
  assert not missing, f"TrainConfig keys without a meaning in run/config_docs.py: {missing}"
  assert not stale, f"config_docs.KEY_DOCS entries for keys that do not exist: {stale}"
  with open(config_help.DOCS_PATH, encoding="utf-8") as f:
    assert f.read() == config_help.reference_markdown(), (
        "docs/config.md is stale: python -m sparrow_jax.run.config_help --write")
  text = config_help.reference_markdown()
  for f in dataclasses.fields(TrainConfig):
    assert f"| `{f.name}` |" in text
  # a field added without documentation is caught
  extra = dataclasses.make_dataclass("Extra", [("brand_new_key", int, dataclasses.field(
      default=0))], bases=(TrainConfig,), frozen=True, kw_only=True)
  assert config_help.undocumented(extra)[0] == ["brand_new_key"]
  assert config_help.main(["--check"]) == 0


def test_refusals(capsys):
  for key, want in (("temperature=0", "temperature=0: greedy sampling"),
                    ("num_steps=0", "num_steps=0: expected at least 1")):
    assert train_cli.main([key]) == 2
    assert want in capsys.readouterr().err
  assert get_train_config("tiny", ["temperature=0.5"]).temperature == 0.5
