"""experiments/prepare_data.py (issue 50): GSM8K, MATH and verl-parquet fixtures, written here,
become prompt JSONL whose answers the project's reward path scores: a hand-written SmolLM2
response containing the right answer earns a nonzero reward (raw GSM8K answers earn 0)."""

import json
import types

import pytest

import experiments.prepare_data as prep
from sparrow_jax.rl.data import load_prompts

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day for 1.234 days... how many pens?",
     "answer": "It sells 1,000 * 1.234 = 1,234 pens.\n#### 1,234"},
    {"question": "Tom has 3 apples and eats 5. How many does he owe?",
     "answer": "3 - 5 = -2\n#### -2"},
    {"question": "What is 10 + 5?", "answer": "10 + 5 = 15\n#### 15"},
]
MATH = [
    {"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
     "solution": "We add: $\\frac{1}{4}+\\frac{1}{4} = \\boxed{\\frac{1}{2}}$.",
     "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Compute $2^{10}$.", "solution": "First $2^5=\\boxed{32}$; so $2^{10} = "
                                                 "\\boxed{1024}$."},
    {"problem": "Solve $x+1=3$.", "solution": "$x = \\boxed{2}$", "unique_id": "test/1.json"},
    {"problem": "Area of a unit square?", "solution": "It is one.", "answer": "1"},
]


def _verl_rows():
  rows = []
  for i, (q, a) in enumerate([("What is 6 times 7?", "42"), ("What is 9 minus 4?", "5"),
                              ("What is 2 plus 2?", "4"), ("What is 8 / 2?", "4")]):
    rows.append({"data_source": "openai/gsm8k",
                 "prompt": [{"role": "user", "content": q + " Let's think step by step."}],
                 "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": a},
                 "extra_info": {"split": "train", "index": i}})
  return rows


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _write_parquet(path, records):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(records), str(path))
  return str(path)


def test_answers_extracted_per_format(tmp_path):
  src = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
  assert prep.main(["gsm8k", src, str(tmp_path / "g.jsonl")]) == 0
  g = load_prompts(tmp_path / "g.jsonl")
  assert [e.answer for e in g] == ["72", "1234", "-2", "15"]
  assert g[0].prompt.startswith("Natalia sold clips") and g[0].prompt.endswith("\\boxed{}.")
  assert g[0].metadata["data_source"] == "openai/gsm8k"

  src = _write_jsonl(tmp_path / "math.jsonl", MATH)
  assert prep.main(["math", src, str(tmp_path / "m.jsonl"), "--instruction", ""]) == 0
  m = load_prompts(tmp_path / "m.jsonl")
  assert [e.answer for e in m] == ["\\frac{1}{2}", "1024", "2", "1"]  # the LAST box
  assert m[1].prompt == "Compute $2^{10}$." and m[2].metadata["id"] == "test/1.json"

  src = _write_parquet(tmp_path / "train.parquet", _verl_rows())
  assert prep.main(["verl", src, str(tmp_path / "v.jsonl")]) == 0
  v = load_prompts(tmp_path / "v.jsonl")
  assert [e.answer for e in v] == ["42", "5", "4", "4"]
  assert v[0].is_chat and v[0].prompt[0]["content"].startswith("What is 6 times 7?")
  # the verl parquet itself loads with the dotted answer key, and without it the error says so
  assert load_prompts(src, answer_key="reward_model.ground_truth")[0].answer == "42"
  with pytest.raises(ValueError, match=r"did you mean answer_key=reward_model\.ground_truth"):
    load_prompts(src)


def test_bad_inputs_exit_2_naming_record_and_field(tmp_path, capsys):
  src = _write_jsonl(tmp_path / "m.jsonl", MATH)  # MATH given as gsm8k
  assert prep.main(["gsm8k", src, str(tmp_path / "o.jsonl")]) == 2
  assert "m.jsonl:1: missing field 'question'" in capsys.readouterr().err
  src = _write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
  assert prep.main(["gsm8k", src, str(tmp_path / "o.jsonl")]) == 2
  assert "g.jsonl:1: field 'answer' has no '#### <final answer>'" in capsys.readouterr().err
  src = _write_jsonl(tmp_path / "n.jsonl", [{"problem": "p", "solution": "no box"}])
  assert prep.main(["math", src, str(tmp_path / "o.jsonl")]) == 2
  assert "no \\boxed{...} answer" in capsys.readouterr().err
  assert prep.main(["verl", str(tmp_path / "nope.parquet"), str(tmp_path / "o.jsonl")]) == 2
  assert "no such file" in capsys.readouterr().err
  assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("reward", ["boxed_exact", "math_verify"])
def test_smollm2_run_scores_prepared_data(tmp_path, reward):
  """A one-step SmolLM2 run's set-up on each prepared file (preflight: data, reward; the
  real tokenizer; prompts within max_prompt_len), then a hand-written response as SmolLM2
  tokens scored by the run's reward path (Producer.score) against the example's answer."""
  from sparrow_jax.models import load_tokenizer
  from sparrow_jax.run.builders import fit_prompts, preflight, smollm2_gguf_path
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.producer import Producer

  gsm = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
  math = _write_jsonl(tmp_path / "math.jsonl", MATH)
  verl = _write_parquet(tmp_path / "v.parquet", _verl_rows())
  for fmt, src in (("gsm8k", gsm), ("math", math), ("verl", verl)):
    prep.prepare(fmt, src, str(tmp_path / f"{fmt}_out.jsonl"))
  tok = load_tokenizer(smollm2_gguf_path())
  right = {"gsm8k": "48 + 24 = 72 clips, so the answer is $\\boxed{72}$.",
           "math": "Two quarters make a half: $\\boxed{\\frac{1}{2}}$.",
           "verl": "6 times 7 is 42. \\boxed{42}"}
  for fmt in ("gsm8k", "math", "verl"):
    cfg = get_train_config("smollm2_135m", [f"data={tmp_path / f'{fmt}_out.jsonl'}",
                                            f"reward={reward}", "num_steps=1",
                                            f"out_dir={tmp_path / 'run'}"])
    checked = preflight(cfg)
    assert len(fit_prompts(tok, checked.examples, cfg)) == len(checked.examples)
    ex = checked.examples[0]
    # the run's reward path: Producer.score decodes the response tokens, pairs each with its
    # prompt's answer and asks the run's verifier pool
    producer = Producer(cfg.replace(reward_workers=1), tok, None, None)
    comps = [types.SimpleNamespace(token_ids=tok(t)["input_ids"], request_id=(0, j),
                                   loss_mask=None)
             for j, t in enumerate((right[fmt], "I think it is \\boxed{13}."))]
    try:
      rewards, _ = producer.score([ex], comps)
    finally:
      producer.close()
    assert rewards[0] > 0 and rewards[1] == 0, (fmt, ex.answer, rewards)
  if reward == "boxed_exact":  # what the issue saw: the raw GSM8K answer scores 0
    assert checked.reward_fn(right["gsm8k"], GSM8K[0]["answer"]) == 0.0
