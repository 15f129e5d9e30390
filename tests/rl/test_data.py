"""Tests for sparrow_jax.rl.data: loaders, chat templates, the resumable dataset, arithmetic."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_jax.rl import data as D
from sparrow_jax.rl import rewards as R


def _write_jsonl(path, lines):
  path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
  return path


# ----------------------------------------------------------------------------- JSONL


def test_load_jsonl_default_keys_chat_and_metadata(tmp_path):
  p = _write_jsonl(tmp_path / "set.jsonl", [
      {"prompt": "What is 1+1?", "answer": 2, "level": 3},
      "",  # blank lines are skipped, line numbers still count
      {"question": "What is 2+2?", "answer": "4"},
      {"prompt": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "3+3?"}], "answer": ["6"]},
  ])
  ex = D.load_jsonl(p)
  assert [e.answer for e in ex] == ["2", "4", "6"]
  assert ex[0].prompt == "What is 1+1?" and ex[0].metadata == {"level": 3}
  assert ex[0].id == "set:1" and ex[1].id == "set:3"
  assert ex[1].prompt == "What is 2+2?" and not ex[1].is_chat
  assert ex[2].is_chat and ex[2].prompt[1] == {"role": "user", "content": "3+3?"}


def test_load_jsonl_custom_and_dotted_keys(tmp_path):
  p = _write_jsonl(tmp_path / "verl.jsonl", [
      {"problem": "x?", "reward_model": {"ground_truth": "7"}, "uid": "a1", "extra": 1}])
  (ex,) = D.load_jsonl(p, prompt_key="problem", answer_key="reward_model.ground_truth",
                       id_key="uid")
  assert (ex.prompt, ex.answer, ex.id, dict(ex.metadata)) == ("x?", "7", "a1", {"extra": 1})


def test_load_jsonl_malformed_line_names_file_and_line(tmp_path):
  p = _write_jsonl(tmp_path / "bad.jsonl", [
      {"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, '{"prompt": "c", "ans'])
  with pytest.raises(ValueError, match=re.escape(f"{p}:3: malformed JSON")) as e:
    D.load_jsonl(p)
  assert "line 3" not in str(e.value)  # file:line names the line once


def test_load_jsonl_missing_field_names_file_line_and_key(tmp_path):
  p = _write_jsonl(tmp_path / "miss.jsonl", [{"prompt": "a", "answer": "1"},
                                             {"prompt": "b", "solution": "2"}])
  with pytest.raises(ValueError, match=re.escape(f"{p}:2") + r".*'answer'"):
    D.load_jsonl(p)
  with pytest.raises(ValueError, match=re.escape(f"{p}:1") + r".*'query'"):
    D.load_jsonl(p, prompt_key="query")
  q = _write_jsonl(tmp_path / "noprompt.jsonl", [{"text": "a", "answer": "1"}])
  with pytest.raises(ValueError, match=re.escape(f"{q}:1") + r".*'prompt', 'question'"):
    D.load_jsonl(q)


def test_load_jsonl_bad_values_and_paths(tmp_path):
  p = _write_jsonl(tmp_path / "v.jsonl", [{"prompt": 5, "answer": "1"}])
  with pytest.raises(ValueError, match=r"field 'prompt' is 5"):
    D.load_jsonl(p)
  p = _write_jsonl(tmp_path / "w.jsonl", [[1, 2]])
  with pytest.raises(ValueError, match="expected a JSON object"):
    D.load_jsonl(p)
  with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'absent.jsonl'}: no such file")):
    D.load_jsonl(tmp_path / "absent.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n\n")
  empty = re.escape(f"{tmp_path / 'empty.jsonl'}: no records")
  with pytest.raises(ValueError, match="^" + empty):
    D.load_jsonl(tmp_path / "empty.jsonl")  # the file, not an internal function, leads


# ----------------------------------------------------------------------------- Parquet


def test_load_parquet_and_dispatch(tmp_path):
  p = tmp_path / "set.parquet"
  pq.write_table(pa.Table.from_pylist([
      {"question": "q0", "answer": "10", "src": "s"},
      {"question": "q1", "answer": "11", "src": "t"}]), p)
  ex = D.load_prompts(p)
  assert [(e.prompt, e.answer, e.id) for e in ex] == [("q0", "10", "set:0"), ("q1", "11", "set:1")]
  assert ex[1].metadata == {"src": "t"}
  with pytest.raises(ValueError, match=re.escape(str(p)) + r": row 0.*'gt'"):
    D.load_parquet(p, answer_key="gt")
  with pytest.raises(ValueError, match=r"extension '.csv'"):
    D.load_prompts(tmp_path / "set.csv")


def test_load_parquet_verl_chat_format(tmp_path):
  p = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist([{
      "prompt": [{"role": "user", "content": "2+5?"}],
      "reward_model": {"ground_truth": "7", "style": "rule"}}]), p)
  (ex,) = D.load_parquet(p, answer_key="reward_model.ground_truth")
  assert ex.prompt == ({"role": "user", "content": "2+5?"},) and ex.answer == "7"


# ----------------------------------------------------------------------------- chat template


def _tokenizer(template):
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast

  tok = PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
  tok.chat_template = template
  return tok


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_apply_chat_template_with_and_without_template():
  tok = _tokenizer(TEMPLATE)
  assert D.apply_chat_template(tok, "Compute 1+2.") == "<|user|>Compute 1+2.\n<|assistant|>"
  msgs = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"})
  assert D.apply_chat_template(tok, msgs) == "<|system|>S\n<|user|>U\n<|assistant|>"
  assert (D.apply_chat_template(tok, "Q", system_prompt="S", add_generation_prompt=False)
          == "<|system|>S\n<|user|>Q\n")
  ex = D.PromptExample(prompt="P", answer="1")
  assert D.apply_chat_template(tok, ex) == "<|user|>P\n<|assistant|>"
  # No template: the raw text (a byte-level model sees exactly the prompt).
  raw = _tokenizer(None)
  assert D.apply_chat_template(raw, "37+48=") == "37+48="
  assert D.apply_chat_template(None, msgs) == "S\nU"


# ----------------------------------------------------------------------------- dataset


def _examples(n):
  return [D.PromptExample(prompt=f"p{i}", answer=str(i), id=str(i)) for i in range(n)]


def _ids(batch):
  return [e.id for e in batch]


def test_dataset_deterministic_epochs_and_drop_last():
  ds = D.PromptDataset(_examples(10), batch_size=4, seed=7)
  assert len(ds) == 2
  e0 = [_ids(ds.next_batch()) for _ in range(2)]
  e1 = [_ids(ds.next_batch()) for _ in range(2)]
  assert ds.epoch == 1
  # same seed, same order; the 2-example tail of each epoch is dropped
  again = D.PromptDataset(_examples(10), batch_size=4, seed=7)
  assert [_ids(again.next_batch()) for _ in range(4)] == e0 + e1
  assert len(set(sum(e0, []))) == 8 and e0 != e1
  other = D.PromptDataset(_examples(10), batch_size=4, seed=8)
  assert [_ids(other.next_batch()) for _ in range(2)] != e0


def test_dataset_num_epochs_no_drop_last_no_shuffle():
  ds = D.PromptDataset(_examples(5), batch_size=2, shuffle=False, drop_last=False, num_epochs=2)
  assert len(ds) == 3
  batches = [_ids(b) for b in ds]
  assert batches == [["0", "1"], ["2", "3"], ["4"]] * 2


def test_dataset_resume_is_exact():
  full = D.PromptDataset(_examples(9), batch_size=2, seed=3)
  expected = [_ids(full.next_batch()) for _ in range(11)]
  part = D.PromptDataset(_examples(9), batch_size=2, seed=3)
  for _ in range(5):
    part.next_batch()
  state = json.loads(json.dumps(part.state_dict()))  # survives a JSON round trip
  resumed = D.PromptDataset(_examples(9), batch_size=2, seed=3)
  resumed.load_state_dict(state)
  assert [_ids(resumed.next_batch()) for _ in range(6)] == expected[5:]


def test_dataset_errors():
  with pytest.raises(ValueError, match="batch_size=0"):
    D.PromptDataset(_examples(3), batch_size=0)
  with pytest.raises(ValueError, match="batch_size=4 exceeds the 3 examples"):
    D.PromptDataset(_examples(3), batch_size=4)
  with pytest.raises(ValueError, match="examples is empty"):
    D.PromptDataset([], batch_size=1)
  ds = D.PromptDataset(_examples(4), batch_size=2, seed=1)
  bad = dict(ds.state_dict(), seed=2)
  with pytest.raises(ValueError, match="seed=2 but this dataset has seed=1"):
    ds.load_state_dict(bad)
  with pytest.raises(ValueError, match="missing key 'index'"):
    ds.load_state_dict({"epoch": 0})


# ----------------------------------------------------------------------------- arithmetic


def test_arithmetic_boxed_deterministic_and_correct():
  cfg = D.ArithmeticConfig(min_digits=2, max_digits=3, operations=("+", "-", "*"),
                           num_operands=3)
  a = D.arithmetic_examples(50, seed=11, config=cfg)
  assert a == D.arithmetic_examples(50, seed=11, config=cfg)
  assert a != D.arithmetic_examples(50, seed=12, config=cfg)
  for ex in a:
    expr = ex.metadata["expression"]
    assert ex.prompt == f"Compute {expr}. Put the final answer in \\boxed{{}}."
    assert re.fullmatch(r"\d{2,3}([-+*]\d{2,3}){2}", expr), expr
    assert int(ex.answer) == eval(expr)  # independent check of precedence  # noqa: S307
    assert R.boxed_exact(ex.metadata["solution"], ex.answer) == 1.0
  assert {op for ex in a for op in "+-*" if op in ex.metadata["expression"]} == {"+", "-", "*"}


def test_arithmetic_raw_form_and_non_negative():
  cfg = D.ArithmeticConfig(max_digits=2, operations=("-",), allow_negative=False,
                           template="raw")
  ex = D.arithmetic_examples(40, seed=0, config=cfg)
  for e in ex:
    assert e.prompt == e.metadata["expression"] + "="
    assert int(e.answer) >= 0 and e.metadata["solution"] == e.answer
    assert R.exact_match(e.metadata["solution"], e.answer) == 1.0
  default = D.arithmetic_examples(3, seed=0)[0]
  assert re.fullmatch(r"Compute \d{1,2}[-+]\d{1,2}\. Put the final answer in \\boxed\{\}\.",
                      default.prompt)


def test_evaluate_expression_and_config_errors():
  assert D.evaluate_expression([2, 3, 4], ["+", "*"]) == 14
  assert D.evaluate_expression([37, 48], ["+"]) == 85
  assert D.evaluate_expression([5, 2, 3, 4], ["-", "*", "+"]) == 3
  with pytest.raises(ValueError, match="operations=\\('/',\\)"):
    D.ArithmeticConfig(operations=("/",))
  with pytest.raises(ValueError, match="min_digits=3 > max_digits=2"):
    D.ArithmeticConfig(min_digits=3, max_digits=2)
  with pytest.raises(ValueError, match="template='chat'"):
    D.ArithmeticConfig(template="chat")
  with pytest.raises(ValueError, match="num_operands=1"):
    D.ArithmeticConfig(num_operands=1)
