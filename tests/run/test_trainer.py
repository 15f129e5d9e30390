"""Trainer: exact resume, non-finite steps, failing verifiers, bad input, HF export, dry run."""

import json
import re
import os

import jax
import numpy as np
import pytest

from tests.rl import reward_helpers  # noqa: F401  (registers the test verifiers)
from tests.run.resume_helpers import assert_same_metrics, full_and_interrupted
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.metrics import read_jsonl
from sparrow_jax.run.trainer import Trainer, TrainingStopped

import experiments.train as train_cli

SMALL = ["warmstart_steps=5", "prompts_per_step=4", "group_size=4", "num_slots=16",
         "tensorboard=false", "save_every=1"]


def _cfg(tmp, *extra):
  return get_train_config("tiny", SMALL + [f"out_dir={tmp}"] + list(extra))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("distill", [False, True])
def test_resume_continues_exactly(tmp_path, distill):
  full, part, resumed = full_and_interrupted(_cfg, tmp_path, 5, 3,
                                             f"distill={str(distill).lower()}")
  assert part.checkpointer.latest_step() == 3
  assert resumed.resume() == 3
  resumed.fit()
  assert_same_metrics(tmp_path, (4, 5))
  for x, y in zip(_leaves(full._state()), _leaves(resumed._state())):
    np.testing.assert_array_equal(x, y)


def test_non_finite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
  tr = Trainer(_cfg(tmp_path, "num_steps=6", "max_bad_steps=2", "distill=false"), quiet=True)
  real_score = tr.producer.score
  calls = {"n": 0}

  def score(examples, comps):
    calls["n"] += 1
    r, res = real_score(examples, comps)
    if calls["n"] >= 3:  # steps 3, 4: NaN rewards -> NaN advantages -> NaN loss
      r = np.full_like(r, np.nan)
    return r, res

  monkeypatch.setattr(tr.producer, "score", score)
  with pytest.raises(TrainingStopped, match="2 consecutive steps"):
    tr.fit()
  ckpt_steps = tr.checkpointer.all_steps()
  assert ckpt_steps == [1, 2]  # nothing written for the NaN steps, nothing lost
  saved, _ = tr.checkpointer.restore(2, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tr._state()))
  for x, y in zip(_leaves(saved["params"]), _leaves(tr.params)):
    np.testing.assert_array_equal(x, y)  # skipped updates left the parameters untouched
  recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert recs[3]["skipped_update"] is True and recs[4]["skipped_update"] is True


def test_crashing_verifier_gives_zero_reward_and_is_counted(tmp_path):
  name = "test_flaky_exact"  # registered by tests/rl/reward_helpers.py (module-level)
  tr = Trainer(_cfg(tmp_path, "num_steps=1", f"reward={name}", "distill=false"), quiet=True)
  tr.fit()
  rec = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
  assert rec["reward/verifier_errors"] > 0
  assert 0.0 <= rec["reward/mean"] <= 1.0


def test_bad_input_is_a_clear_error(tmp_path, capsys):
  with pytest.raises(FileNotFoundError, match="model_path"):
    Trainer(_cfg(tmp_path, "model_path=/nonexistent/model"), quiet=True)
  assert train_cli.main(["no_such_key=3"]) == 2
  assert "unknown config key 'no_such_key'" in capsys.readouterr().err
  assert train_cli.main(["lr=fast"]) == 2
  assert train_cli.main(["--config", "nope"]) == 2
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{not json\n')
  assert train_cli.main([f"data={bad}", f"out_dir={tmp_path / 'o'}"]) == 2
  err = capsys.readouterr().err
  assert "bad.jsonl" in err and "2" in err
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    Trainer(_cfg(tmp_path / "empty"), quiet=True).resume()


def test_exported_policy_loads_in_transformers_and_generate(tmp_path, capsys):
  import torch
  import transformers
  from flax import nnx

  import experiments.generate as gen_cli
  from sparrow_jax.models import load_pretrained, load_tokenizer
  from sparrow_jax.rl.tokenizers import ByteTokenizer

  tr = Trainer(_cfg(tmp_path, "num_steps=1", "distill=false", "export_hf=true"), quiet=True)
  tr.fit()  # export_hf=true: the policy and its tokenizer land in out_dir/hf
  path = str(tmp_path / "hf")
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "sparrow_tokenizer.json"} <= set(os.listdir(path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  tokens = np.random.default_rng(0).integers(0, 259, (2, 17))
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  ours = nnx.merge(tr.graphdef, tr.params)(jax.numpy.asarray(tokens, jax.numpy.int32))
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
  # The byte tokenizer: transformers reads tokenizer.json and encodes/decodes exactly as the
  # model was trained; our loader rebuilds the ByteTokenizer itself.
  hf_tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  byte = ByteTokenizer()
  for text in ["3+4=", "Compute 12+7.  Put it in \\boxed{}.", "héllo ☃ 😀", "<s>x</s>", ""]:
    assert hf_tok(text)["input_ids"] == byte.encode(text), text
    ids = byte.encode(text, add_bos=False) + [byte.eos_token_id]
    assert hf_tok.decode(ids, skip_special_tokens=True) == byte.decode(ids) == text
  assert isinstance(load_tokenizer(path), ByteTokenizer)
  # generate.py runs on the export.
  assert gen_cli.main(["--model-path", path, "--prompt", "3+4=", "--max-new-tokens", "3"]) == 0
  assert "--- prompt 0 (5 tokens)" in capsys.readouterr().out
  # export_dtype: a bfloat16 copy, written as such and loaded back (weights rounded).
  bf = tr.export_hf(str(tmp_path / "hf_bf16"), dtype="bfloat16")
  cfg = json.loads(open(os.path.join(bf, "config.json")).read())
  assert cfg["torch_dtype"] == "bfloat16"
  assert transformers.AutoModelForCausalLM.from_pretrained(bf).dtype == torch.bfloat16
  back = load_pretrained(bf, dtype="float32", param_dtype="bfloat16")
  np.testing.assert_array_equal(
      np.asarray(back.embed_VD.get_value(), np.float32),
      np.asarray(jax.numpy.asarray(tr.params["embed_VD"].get_value(), jax.numpy.bfloat16),
                 np.float32))


def test_restore_weights_reads_policy_and_lora_only(tmp_path):
  tr = Trainer(_cfg(tmp_path / "run", "num_steps=2", "distill=true"), quiet=True)
  tr.fit()
  # Another data set and batch size: only the weights are read, not the data position.
  other = get_train_config("tiny", [f"out_dir={tmp_path / 'run'}", "prompts_per_step=2",
                                    "num_examples=3", "tensorboard=false", "lora_rank=4"])
  ev = Trainer(other, quiet=True, with_dataset=False)
  assert ev.dataset is None and ev.examples == []
  assert ev.restore_weights() == 2
  for x, y in zip(_leaves({"p": tr.params, "l": tr.lora}), _leaves({"p": ev.params,
                                                                    "l": ev.lora})):
    np.testing.assert_array_equal(x, y)


def test_dry_run_prints_the_memory_table(capsys):
  from sparrow_jax.models.config import get_config
  assert train_cli.main(["--config", "qwen3_14b", "--dry-run", "--num-devices", "32"]) == 0
  out = capsys.readouterr().out
  for row in ("params", "optimizer", "kv_cache", "activations", "fits"):
    assert row in out
  n = get_config("qwen3_14b").num_params()
  assert f"{n / 1e9:.3f} B params" in out
  assert train_cli.main(["--config", "qwen3_14b", "--dry-run", "--num-devices", "1"]) == 1
  assert "does not fit" in capsys.readouterr().out


def test_dry_run_plans_the_checkpoint_it_loads(capsys, tmp_path):
  """model_path= decides the architecture the memory plan sizes (config.json, no weights
  read): a preset that names a 14B model, pointed at a tiny checkpoint, is planned as the
  tiny one, as the trainer will build it."""
  from sparrow_jax.models import save_pretrained
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.run.builders import model_config
  from sparrow_jax.run.config import get_train_config
  tiny = get_config("tiny", num_layers=1)
  save_pretrained(init_model(tiny), tmp_path / "ckpt")
  args = ["--config", "qwen3_14b", f"model_path={tmp_path / 'ckpt'}", "--dry-run",
          "--num-devices", "1"]
  assert train_cli.main(args) == 0
  out = capsys.readouterr().out
  assert f"dry run: {tmp_path / 'ckpt'} (config.json / GGUF metadata) (0.000 B params)" in out
  assert "fits." in out
  cfg = get_train_config("qwen3_14b", [f"model_path={tmp_path / 'ckpt'}"])
  assert model_config(cfg).replace(name="tiny") == tiny.replace(dtype=cfg.dtype,
                                                                param_dtype=cfg.param_dtype)
  # a checkpoint that is not on this machine: the preset's architecture
  cfg = cfg.replace(model_path=str(tmp_path / "elsewhere"))
  assert model_config(cfg) == get_config("qwen3_14b", dtype=cfg.dtype,
                                         param_dtype=cfg.param_dtype)


@pytest.mark.parametrize("devices", [1, 4])
def test_flagship_preset_fits_one_and_four_h200s(capsys, devices):
  """The main command's preset runs on the hardware it names (the paper's setup is 4 GPUs)."""
  assert train_cli.main(["--config", "qwen3_1p7b", "--dry-run", "--num-devices",
                         str(devices)]) == 0
  out = capsys.readouterr().out
  m = re.search(r"concurrent sequences per device: (\d+) at the mean length \d+ .*?, (\d+) at "
                r"the maximum 34816", out)
  assert m, out
  at_mean, at_max = int(m.group(1)), int(m.group(2))
  assert at_max >= 1 and at_mean >= at_max  # a whole 34K-token rollout fits, and more
  assert "KV pool:" in out and "fits." in out


def test_a_run_that_cannot_fit_this_machine_is_refused_before_the_model_loads(tmp_path,
                                                                            monkeypatch):
  """512 rollouts of 4K tokens in one micro-batch without remat: the update alone needs more
  than this machine's RAM; refused before any weight is built, naming the phase and knobs."""
  import sparrow_jax.run.trainer as trainer_lib

  def no_model(cfg):
    raise AssertionError("the model was built before the memory check")

  monkeypatch.setattr(trainer_lib, "build_model", no_model)
  cfg = _cfg(tmp_path, "prompts_per_step=64", "group_size=8", "max_new_tokens=4000",
             "num_examples=64",
             "remat=false", "num_slots=16")
  with pytest.raises(ValueError) as err:
    Trainer(cfg, quiet=True)
  msg = str(err.value)
  for needle in ("does not fit", "update", "max_tokens_per_micro_batch", "remat=true",
                 "host RAM available", "--dry-run"):
    assert needle in msg, (needle, msg)
  assert not (tmp_path / "metrics.jsonl").exists()


def test_kv_cache_dtype_reaches_the_engine_and_the_memory_plan(tmp_path):
  """`kv_cache_dtype=bfloat16` on a float32 model, with the CPU's fastest rollout setup (C++
  kernels, bf16 decode weights): the rollout engine's pool is bf16, the memory plan prices a
  page at half the K/V bytes (landmarks stay float32), a step trains on the rollouts; a dtype
  the cache cannot hold is refused by name."""
  import jax.numpy as jnp
  from sparrow_jax.run.dry_run import plan_for_model
  tr = Trainer(_cfg(tmp_path / "b", "num_steps=1", "kv_cache_dtype=bfloat16",
                    "attention_backend=cpu", "cpu_decode_weights=bfloat16"), quiet=True)
  assert all(k.dtype == jnp.bfloat16 for k in tr.engine._kv.k + tr.engine._kv.v)
  mc = tr.model_cfg
  assert mc.dtype == "float32"
  plan = lambda cfg: plan_for_model(cfg, mc, 1, device_bytes=24e9).kv_bytes_per_page
  assert tr.memory_plan.kv_bytes_per_page == plan(tr.cfg)
  kv_page = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * tr.cfg.page_size
  assert plan(_cfg(tmp_path / "a")) - plan(tr.cfg) == kv_page * 2  # float32 K/V -> bf16
  tr.fit()
  rec = read_jsonl(str(tmp_path / "b" / "metrics.jsonl"))[1]
  assert rec["rollout/tokens"] > 0 and np.isfinite(rec["loss/total"]), rec
  with pytest.raises(ValueError, match="kv_cache_dtype='float16'"):
    _cfg(tmp_path / "c", "kv_cache_dtype=float16")


def test_rollouts_past_the_calibrated_positions_are_warned_and_counted(tmp_path, caplog):
  """A calibrated schedule used where its calibration measured nothing: the trainer warns at
  start (naming the positions) and each step logs the share of generated tokens past it,
  counted from the step's own completions."""
  import logging
  from sparrow_jax.schedule.schedule import SparsitySchedule
  path = str(tmp_path / "calibrated.json")
  SparsitySchedule(name="calibrated", page_size=2, bin_size=4, budgets=(1, 1, 2),
                   dense_layers=(0,), tau=0.86, calibrated_to=8).to_json(path)
  with caplog.at_level(logging.WARNING, logger="sparrow_jax.run.trainer"):
    tr = Trainer(_cfg(tmp_path, "num_steps=1", f"schedule={path}"), quiet=True)
  assert any("below position 8" in r.getMessage() and "8-35" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  tr.fit()
  rec = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
  comps = tr.last_rollout[1]
  gen = sum(len(c.token_ids) for c in comps)
  past = sum(max(0, len(c.prompt_ids) + len(c.token_ids) - max(len(c.prompt_ids), 8))
             for c in comps)
  assert 0 < past < gen, (past, gen)  # the tiny task's responses straddle position 8
  assert rec["schedule/beyond_calibrated_frac"] == pytest.approx(past / gen)
