"""A user's first day (issue 50): `model_path=random` at a preset's shapes, labelled as random
weights; a schedule whose budget decreases with position is warned about by name and bins."""

import json
import logging

import experiments.train as train_cli
from sparrow_jax.run import builders
from sparrow_jax.run.config import PRESETS
from sparrow_jax.schedule import SparsitySchedule, parse_schedule
from sparrow_jax.schedule.checks import decreasing_bins, decreasing_budgets_warning


def test_random_weights_dry_run_says_so(capsys):
  assert train_cli.main(["--config", "qwen3_1p7b", "model_path=random", "--dry-run"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("dry run: qwen3_1p7b with RANDOM weights (model_path=random) (1.721 B")
  assert "fits." in out
  # without model_path, the error names the way out
  cfg = PRESETS["qwen3_1p7b"].replace(data="x.jsonl")
  try:
    builders.preflight(cfg, with_dataset=False)
    raise AssertionError("preflight accepted a qwen3 preset without weights")
  except ValueError as e:
    assert "model_path=random" in str(e)
  checked = builders.preflight(cfg.replace(model_path="random"), with_dataset=False)
  assert checked.schedule.name == "qwen3-1.7b-0.86"


def test_random_weights_keep_the_preset_shapes(capsys):
  cfg = PRESETS["tiny"].replace(model_path="random")
  model, tok = builders.build_model(cfg)
  assert "weights: RANDOM (model_path=random): tiny at its preset's shapes" in \
      capsys.readouterr().err
  assert model.cfg.vocab_size == builders.get_config("tiny").vocab_size == 512
  assert model.cfg.eos_token_ids == (tok.eos_token_id,)
  assert tok.decode([300, 301, tok._OFFSET + ord("7")]) == "7"  # ids past the bytes: nothing
  model, _ = builders.build_model(PRESETS["tiny"])  # the tiny default: the byte vocabulary
  assert model.cfg.vocab_size == tok.vocab_size
  assert builders.random_weights_note(PRESETS["tiny"]) is None


def test_decreasing_schedule_warns_by_name_and_bins(tmp_path, caplog):
  sched = SparsitySchedule(name="rev", page_size=2, bin_size=4, budgets=(8, 4, 2, 1),
                           dense_layers=(0,))
  assert decreasing_bins(sched) == [1, 2, 3]
  msg = decreasing_budgets_warning(sched)
  assert msg.startswith("schedule 'rev': the page budget decreases with position at bin 1 "
                        "(positions 4-7): 8 -> 4, bin 2")
  for name in ("qwen3-1.7b-0.86", "qwen3-14b-0.86", "constant:4", "dense"):
    assert decreasing_budgets_warning(parse_schedule(name)) is None, name
  path = tmp_path / "rev.json"
  path.write_text(json.dumps(sched.to_dict()))
  cfg = PRESETS["tiny"].replace(schedule=str(path))
  with caplog.at_level(logging.WARNING):
    builders.preflight(cfg, with_dataset=False)
  assert any("schedule 'rev': the page budget decreases" in r.getMessage()
             for r in caplog.records)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    builders.preflight(PRESETS["tiny"], with_dataset=False)
  assert not any("decreases" in r.getMessage() for r in caplog.records)
