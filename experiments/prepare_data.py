r"""Turn a public math data set into this project's prompt JSONL (`prompt`, `answer`), so the
reward compares a response with the bare final answer, not with a whole worked solution.

    python experiments/prepare_data.py gsm8k gsm8k_train.jsonl data/gsm8k.jsonl
    python experiments/prepare_data.py math  math500_test.jsonl data/math500.jsonl
    python experiments/prepare_data.py verl  ~/data/gsm8k/train.parquet data/gsm8k_verl.jsonl
    python experiments/train.py --config qwen3_1p7b model_path=/ckpt/Qwen3-1.7B \
        data=data/gsm8k.jsonl

INPUT is a JSONL (one JSON object per line) or Parquet file, as the data sets are downloaded
(nothing is fetched here). Formats:

  gsm8k  `question` and `answer`, the answer a worked solution ending `#### 72`: the ground
         truth is what follows the last `#### `, thousands separators removed (`1,234` ->
         `1234`), as verl's examples/data_preprocess/gsm8k.py does.
  math   MATH / MATH-500: `problem` and `solution`; the ground truth is the content of the
         solution's last `\boxed{}` (or the record's own `answer` field when the solution has
         none).
  verl   verl's parquet schema: `prompt` (chat messages), `reward_model.ground_truth`, and
         `data_source` (kept); the messages are kept as they are.

For gsm8k and math the prompt is the question followed by --instruction (default: ask for the
final answer in \boxed{}, which every reward here reads; '' = the question alone). Each output
line also keeps `data_source` and `id`. A record without the fields, or whose answer cannot be
extracted, stops the conversion with exit status 2, naming the file, the record and the field.
Train with `reward=math_verify` (the qwen3 presets' default) or `boxed_exact`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FORMATS = ("gsm8k", "math", "verl")
DEFAULT_INSTRUCTION = "Let's think step by step and put the final answer in \\boxed{}."


def read_records(path: str) -> list[tuple[str, dict]]:
  """(where, record) for each record of a JSONL or Parquet file; `where` is `file:line` or
  `file: row i` (0-based), as the prompt loaders name them."""
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file; expected a JSONL or Parquet file")
  ext = os.path.splitext(path)[1].lower()
  if ext in (".parquet", ".pq"):
    import pyarrow.parquet as pq
    return [(f"{path}: row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
  if ext not in (".jsonl", ".json"):
    raise ValueError(f"{path}: extension {ext!r} not understood; expected .jsonl or .parquet")
  out = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        out.append((f"{path}:{lineno}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                         "expected one JSON object per line") from None
  return out


def _field(record, key: str, where: str):
  if not isinstance(record, dict):
    raise ValueError(f"{where}: record is {type(record).__name__}; expected a JSON object")
  node = record
  for part in key.split("."):
    if not isinstance(node, dict) or part not in node:
      raise ValueError(f"{where}: missing field {key!r}; record has {sorted(record)}")
    node = node[part]
  return node


def gsm8k_answer(solution: str) -> str | None:
  """`... #### 1,234` -> `1234` (what follows the last `#### `, separators removed)."""
  if "####" not in solution:
    return None
  ans = solution.rsplit("####", 1)[1].strip().replace(",", "")
  return ans or None


def math_answer(solution: str) -> str | None:
  """The content of the solution's last `\\boxed{}` / `\\fbox{}`."""
  from sparrow_jax.rl.rewards import last_boxed
  ans = last_boxed(solution)
  return ans.strip() if ans and ans.strip() else None


def _with_instruction(question: str, instruction: str) -> str:
  return f"{question.strip()} {instruction}" if instruction else question.strip()


def convert(fmt: str, where: str, record: dict, index: int, instruction: str) -> dict:
  """One input record -> one output record (`prompt`, `answer`, `data_source`, `id`)."""
  if fmt == "gsm8k":
    question = _field(record, "question", where)
    solution = str(_field(record, "answer", where))
    answer = gsm8k_answer(solution)
    if answer is None:
      raise ValueError(f"{where}: field 'answer' has no '#### <final answer>' line; expected "
                       "a GSM8K solution (is this the 'math' or 'verl' format?)")
    return {"prompt": _with_instruction(str(question), instruction), "answer": answer,
            "data_source": "openai/gsm8k", "id": f"gsm8k:{index}"}
  if fmt == "math":
    problem = _field(record, "problem", where)
    solution = str(_field(record, "solution", where))
    answer = math_answer(solution)
    if answer is None and str(record.get("answer") or "").strip():
      answer = str(record["answer"]).strip()
    if answer is None:
      raise ValueError(f"{where}: field 'solution' has no \\boxed{{...}} answer (and the "
                       "record no 'answer'); expected a MATH solution")
    return {"prompt": _with_instruction(str(problem), instruction), "answer": answer,
            "data_source": str(record.get("data_source") or "math"),
            "id": str(record.get("unique_id") or f"math:{index}")}
  prompt = _field(record, "prompt", where)
  if isinstance(prompt, str):
    prompt = [{"role": "user", "content": prompt}]
  if not (isinstance(prompt, list) and prompt and all(
      isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
    raise ValueError(f"{where}: field 'prompt' is {prompt!r}; expected a list of chat "
                     "messages ({'role': ..., 'content': ...})")
  truth = _field(record, "reward_model.ground_truth", where)
  if isinstance(truth, list) and len(truth) == 1:
    truth = truth[0]
  if isinstance(truth, (bool, list, dict)) or truth is None or not str(truth).strip():
    raise ValueError(f"{where}: field 'reward_model.ground_truth' is {truth!r}; expected a "
                     "string or a number")
  extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
  return {"prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt],
          "answer": str(truth).strip(), "data_source": str(record.get("data_source") or "verl"),
          "id": f"{record.get('data_source') or 'verl'}:{extra.get('index', index)}"}


def prepare(fmt: str, src: str, dst: str, *, instruction: str = DEFAULT_INSTRUCTION,
            limit: int = 0) -> int:
  """Convert `src` into `dst` (JSONL); returns the number of records written."""
  if fmt not in FORMATS:
    raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
  records = read_records(src)
  if limit:
    records = records[:limit]
  if not records:
    raise ValueError(f"{src}: no records")
  out = [convert(fmt, where, r, i, instruction) for i, (where, r) in enumerate(records)]
  os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
  with open(dst, "w", encoding="utf-8") as f:
    for r in out:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  return len(out)


def main(argv=None) -> int:
  from experiments._cli import at_least, show_defaults
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("format", choices=FORMATS, help="the input's data set format")
  ap.add_argument("input", help="a .jsonl or .parquet file")
  ap.add_argument("output", help="the JSONL file to write (prompt, answer, data_source, id)")
  ap.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                  help="gsm8k/math: text appended to each question ('' = none)")
  ap.add_argument("--limit", type=at_least(int, 0), default=0,
                  help="convert only the first N records (0 = all)")
  show_defaults(ap)
  args = ap.parse_args(argv)
  try:
    n = prepare(args.format, args.input, args.output, instruction=args.instruction,
                limit=args.limit)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {n} records to {args.output} (prompt, answer); train with "
        f"data={args.output} reward=math_verify")
  return 0


if __name__ == "__main__":
  sys.exit(main())
