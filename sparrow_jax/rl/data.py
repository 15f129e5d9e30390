"""Prompt data for GRPO: local JSONL/Parquet prompt sets, chat templates, a resumable
deterministic batch iterator, and built-in synthetic verifiable tasks for CPU runs.

GRPO samples G completions for each of N prompts per step; this module supplies the N prompts
(`PromptDataset.next_batch`) and the ground-truth answers that the verifiers in `rewards.py`
score against. The trainer repeats each prompt G times itself.

Nothing here touches the network (DESIGN.md decision 10): prompt sets are local files, the chat
template comes from a tokenizer that is already loaded, and the synthetic tasks are generated
from a seed.

Names:
  PromptExample      one prompt (text or chat messages), its answer, an id and metadata.
  load_jsonl / load_parquet / load_prompts
                     local prompt sets with configurable field names (dotted paths reach into
                     nested records, e.g. verl's `reward_model.ground_truth`).
  apply_chat_template
                     the tokenizer's chat template when it has one, else the raw text.
  PromptDataset      deterministic shuffling by seed, epochs, batches of N prompts and an exact
                     resumable position (`state_dict` / `load_state_dict`).
  ArithmeticConfig / arithmetic_examples
                     multi-digit arithmetic, answer in `\\boxed{}` ("boxed") or the bare
                     `"37+48="` -> `"85"` form a tiny character-level model can learn ("raw").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

Message = Mapping[str, str]  # {"role": ..., "content": ...}
_DEFAULT_PROMPT_KEYS = ("prompt", "question")


@dataclasses.dataclass(frozen=True)
class PromptExample:
  """One prompt of a verifiable task.

  `prompt` is either plain text or a tuple of chat messages (`{"role", "content"}` dicts);
  `answer` is the ground truth the reward function compares against; `metadata` keeps the
  other fields of the source record (or, for synthetic tasks, the expression and a reference
  `solution` completion usable for a supervised warm-start).
  """

  prompt: str | tuple[Message, ...]
  answer: str
  id: str = ""
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def is_chat(self) -> bool:
    return not isinstance(self.prompt, str)


# ----------------------------------------------------------------------------- file loaders


def _get_path(record: Mapping[str, Any], key: str) -> tuple[bool, Any]:
  """Looks up `key` in `record`; a dotted key (`a.b`) walks nested dicts."""
  if key in record:
    return True, record[key]
  node: Any = record
  for part in key.split("."):
    if isinstance(node, Mapping) and part in node:
      node = node[part]
    else:
      return False, None
  return True, node


_ANSWER_NAMES = ("answer", "ground_truth", "solution", "target", "label", "final_answer")


def _dotted_paths(node: Mapping[str, Any], depth: int = 3) -> list[str]:
  """The paths to the leaf fields of a record, nested ones dotted (`reward_model.ground_truth`)."""
  out = []
  for k, v in node.items():
    if isinstance(v, Mapping) and v and depth > 1:
      out += [f"{k}.{p}" for p in _dotted_paths(v, depth - 1)]
    else:
      out.append(str(k))
  return out


def _missing_hint(record: Mapping[str, Any], key: str, flag: str) -> str:
  """"record has [...]" and, when a nested field looks like the one asked for, the dotted
  path to pass (`answer_key=reward_model.ground_truth` for verl's parquet)."""
  nested = [p for p in _dotted_paths(record) if "." in p]
  want = (key.split(".")[-1],) + (_ANSWER_NAMES if flag == "answer_key" else ())
  likely = [p for p in nested if p.split(".")[-1] in want]
  msg = f"record has {sorted(record)}"
  if nested:
    msg += f"; nested fields (dotted paths): {nested[:8]}"
  if likely:
    msg += f"; did you mean {flag}={likely[0]}?"
  return msg


def _to_prompt(value: Any, where: str, key: str) -> str | tuple[Message, ...]:
  if isinstance(value, str):
    return value
  if isinstance(value, (list, tuple)) and value:
    msgs = []
    for i, m in enumerate(value):
      if not (isinstance(m, Mapping) and "role" in m and "content" in m):
        raise ValueError(
            f"{where}: field {key!r} message {i} is {m!r}; expected a dict with 'role' and "
            f"'content'")
      msgs.append({"role": str(m["role"]), "content": str(m["content"])})
    return tuple(msgs)
  raise ValueError(
      f"{where}: field {key!r} is {value!r}; expected a string or a non-empty list of chat "
      f"messages")


def _to_answer(value: Any, where: str, key: str) -> str:
  if isinstance(value, (list, tuple)) and len(value) == 1:
    value = value[0]  # some sets store a single ground truth as a one-element list
  if isinstance(value, bool) or value is None or isinstance(value, (list, tuple, Mapping)):
    raise ValueError(f"{where}: field {key!r} is {value!r}; expected a string or a number")
  return str(value)


def _record_to_example(record: Any, where: str, default_id: str, prompt_key: str | None,
                       answer_key: str, id_key: str | None) -> PromptExample:
  if not isinstance(record, Mapping):
    raise ValueError(f"{where}: record is {type(record).__name__}; expected a JSON object")
  if prompt_key is None:
    for k in _DEFAULT_PROMPT_KEYS:
      found, value = _get_path(record, k)
      if found:
        prompt_key = k
        break
    else:
      raise ValueError(
          f"{where}: missing prompt field: tried keys {list(_DEFAULT_PROMPT_KEYS)}, record has "
          f"{sorted(record)}")
  else:
    found, value = _get_path(record, prompt_key)
    if not found:
      raise ValueError(f"{where}: missing field {prompt_key!r} (prompt_key); "
                       f"{_missing_hint(record, prompt_key, 'prompt_key')}")
  prompt = _to_prompt(value, where, prompt_key)
  found, ans = _get_path(record, answer_key)
  if not found:
    raise ValueError(f"{where}: missing field {answer_key!r} (answer_key); "
                     f"{_missing_hint(record, answer_key, 'answer_key')}")
  answer = _to_answer(ans, where, answer_key)
  ex_id = default_id
  if id_key is not None:
    found, v = _get_path(record, id_key)
    if not found:
      raise ValueError(f"{where}: missing field {id_key!r} (id_key); record has {sorted(record)}")
    ex_id = str(v)
  used = {prompt_key.split(".")[0], answer_key.split(".")[0]}
  if id_key is not None:
    used.add(id_key.split(".")[0])
  metadata = {k: v for k, v in record.items() if k not in used}
  return PromptExample(prompt=prompt, answer=answer, id=ex_id, metadata=metadata)


def load_jsonl(path: str | os.PathLike, *, prompt_key: str | None = None,
               answer_key: str = "answer", id_key: str | None = None) -> list[PromptExample]:
  """Reads one JSON object per line. Blank lines are skipped.

  `prompt_key=None` tries "prompt" then "question". A malformed line or a missing field raises
  a ValueError naming the file, the 1-based line number and the key. Ids default to
  "<file stem>:<line>".
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file; expected a local JSONL file")
  stem = os.path.splitext(os.path.basename(path))[0]
  examples = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); expected "
                         "one JSON object per line") from None
      examples.append(_record_to_example(record, where, f"{stem}:{lineno}", prompt_key,
                                         answer_key, id_key))
  if not examples:
    raise ValueError(f"{path}: no records (the file is empty or blank); expected one JSON "
                     "object per line")
  return examples


def load_parquet(path: str | os.PathLike, *, prompt_key: str | None = None,
                 answer_key: str = "answer", id_key: str | None = None) -> list[PromptExample]:
  """Reads a Parquet table; errors name the file and the 0-based row. Ids default to
  "<file stem>:<row>"."""
  import pyarrow.parquet as pq  # only needed for Parquet

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file; expected a local Parquet file")
  stem = os.path.splitext(os.path.basename(path))[0]
  rows = pq.read_table(path).to_pylist()
  if not rows:
    raise ValueError(f"{path}: no rows (the table is empty); expected at least one")
  return [
      _record_to_example(r, f"{path}: row {i}", f"{stem}:{i}", prompt_key, answer_key, id_key)
      for i, r in enumerate(rows)
  ]


def load_prompts(path: str | os.PathLike, **kwargs) -> list[PromptExample]:
  """Dispatches on the extension: `.jsonl`/`.json` -> `load_jsonl`, `.parquet` -> Parquet."""
  ext = os.path.splitext(os.fspath(path))[1].lower()
  if ext in (".jsonl", ".json"):
    return load_jsonl(path, **kwargs)
  if ext in (".parquet", ".pq"):
    return load_parquet(path, **kwargs)
  raise ValueError(f"{os.fspath(path)}: extension {ext!r} not understood; expected '.jsonl', "
                   "'.json' or '.parquet'")


# ----------------------------------------------------------------------------- chat template


def apply_chat_template(tokenizer: Any, prompt: str | Sequence[Message] | PromptExample, *,
                        add_generation_prompt: bool = True, system_prompt: str | None = None,
                        **template_kwargs) -> str:
  """Renders a prompt to the text the model is conditioned on.

  Uses `tokenizer.apply_chat_template` when the tokenizer has a chat template
  (`tokenizer.chat_template` set); otherwise returns the raw text (chat messages are joined by
  newlines). Extra keyword arguments go to the template (e.g. Qwen3's `enable_thinking`).
  Never downloads anything: the tokenizer is already in memory.
  """
  if isinstance(prompt, PromptExample):
    prompt = prompt.prompt
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  else:
    messages = [dict(m) for m in prompt]
  if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
    messages.insert(0, {"role": "system", "content": system_prompt})
  if tokenizer is not None and getattr(tokenizer, "chat_template", None):
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    if not isinstance(text, str):
      raise ValueError(f"apply_chat_template: tokenizer returned {type(text).__name__}; "
                       f"expected str (tokenize=False)")
    return text
  return "\n".join(m["content"] for m in messages)


# ----------------------------------------------------------------------------- dataset


class PromptDataset:
  """Batches of `batch_size` prompts, reshuffled each epoch, with an exact resumable position.

  The order of epoch e is `np.random.default_rng([seed, e]).permutation(len(examples))`, so it
  depends only on (seed, epoch) and never on how many batches were drawn before a restart.
  With `drop_last=True` the tail of an epoch that does not fill a batch is skipped (every
  batch has the static shape the jitted step wants). `num_epochs=None` iterates forever.
  """

  def __init__(self, examples: Sequence[PromptExample], *, batch_size: int, seed: int = 0,
               shuffle: bool = True, drop_last: bool = True, num_epochs: int | None = None):
    if not examples:
      raise ValueError("PromptDataset.examples is empty; expected at least one example")
    if not isinstance(batch_size, int) or batch_size <= 0:
      raise ValueError(f"PromptDataset.batch_size={batch_size!r}: expected a positive int")
    if drop_last and batch_size > len(examples):
      raise ValueError(
          f"PromptDataset.batch_size={batch_size} exceeds the {len(examples)} examples with "
          f"drop_last=True; expected batch_size <= {len(examples)}")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs <= 0):
      raise ValueError(f"PromptDataset.num_epochs={num_epochs!r}: expected None or a positive int")
    self.examples = list(examples)
    self.batch_size = batch_size
    self.seed = int(seed)
    self.shuffle = shuffle
    self.drop_last = drop_last
    self.num_epochs = num_epochs
    self.epoch = 0
    self.index = 0  # position inside the current epoch's order
    self._order_epoch = -1
    self._order = np.arange(0)

  def __len__(self) -> int:
    """Batches per epoch."""
    n, b = len(self.examples), self.batch_size
    return n // b if self.drop_last else -(-n // b)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      n = len(self.examples)
      self._order = (np.random.default_rng([self.seed, epoch]).permutation(n)
                     if self.shuffle else np.arange(n))
      self._order_epoch = epoch
    return self._order

  def next_batch(self) -> list[PromptExample]:
    """The next batch; raises StopIteration after `num_epochs` epochs."""
    n = len(self.examples)
    while True:
      if self.num_epochs is not None and self.epoch >= self.num_epochs:
        raise StopIteration
      remaining = n - self.index
      if remaining >= self.batch_size or (remaining > 0 and not self.drop_last):
        break
      self.epoch += 1
      self.index = 0
    order = self._epoch_order(self.epoch)
    take = order[self.index:self.index + self.batch_size]
    self.index += len(take)
    return [self.examples[i] for i in take]

  def __iter__(self) -> Iterator[list[PromptExample]]:
    return self

  def __next__(self) -> list[PromptExample]:
    return self.next_batch()

  def state_dict(self) -> dict[str, int]:
    """Plain ints, safe to store in a checkpoint's JSON metadata."""
    return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
            "num_examples": len(self.examples), "batch_size": self.batch_size}

  def load_state_dict(self, state: Mapping[str, int]) -> None:
    """Restores a position; the next batch is exactly the one that would have followed."""
    for key in ("epoch", "index", "seed", "num_examples", "batch_size"):
      if key not in state:
        raise ValueError(f"PromptDataset.load_state_dict: missing key {key!r}; expected the "
                         f"keys of state_dict()")
    expected = {"seed": self.seed, "num_examples": len(self.examples),
                "batch_size": self.batch_size}
    for key, want in expected.items():
      if int(state[key]) != want:
        raise ValueError(f"PromptDataset.load_state_dict: {key}={state[key]!r} but this dataset "
                         f"has {key}={want}; expected the same data and settings")
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index <= len(self.examples):
      raise ValueError(f"PromptDataset.load_state_dict: epoch={epoch}, index={index}; expected "
                       f"epoch >= 0 and 0 <= index <= {len(self.examples)}")
    self.epoch, self.index = epoch, index


# ----------------------------------------------------------------------------- synthetic tasks

_OPERATIONS = ("+", "-", "*")
_TEMPLATES = ("boxed", "raw", "padded")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
  """Difficulty of the synthetic arithmetic task.

  Operands have between `min_digits` and `max_digits` digits; `num_operands` operands are
  joined by operators drawn from `operations` (standard precedence: `*` before `+`/`-`).
  `template="boxed"` asks for the answer in `\\boxed{}` (scored by `math_verify` or
  `boxed_exact`); `template="raw"` is `"37+48="` -> `"85"` (scored by `exact_match`), the form a
  tiny character/byte-level model learns in a few hundred steps; `template="padded"` is `raw`
  with the expression left-aligned in a field of the longest expression's width (`"37+5 ="`):
  every character then sits at a fixed distance from where a tool call repeats it
  (`metadata["field"]`), which a tiny byte-level model copies easily (the `tiny_tools` task).
  """

  min_digits: int = 1
  max_digits: int = 2
  operations: tuple[str, ...] = ("+", "-")
  num_operands: int = 2
  allow_negative: bool = True
  template: str = "boxed"

  def __post_init__(self):
    if isinstance(self.operations, str):
      object.__setattr__(self, "operations", tuple(self.operations))
    object.__setattr__(self, "operations", tuple(self.operations))
    for f in ("min_digits", "max_digits", "num_operands"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"ArithmeticConfig.{f}={v!r}: expected a positive int")
    if self.min_digits > self.max_digits:
      raise ValueError(f"ArithmeticConfig.min_digits={self.min_digits} > max_digits="
                       f"{self.max_digits}; expected min_digits <= max_digits")
    if self.max_digits > 9:
      raise ValueError(f"ArithmeticConfig.max_digits={self.max_digits}: expected <= 9")
    if self.num_operands < 2:
      raise ValueError(f"ArithmeticConfig.num_operands={self.num_operands}: expected >= 2")
    if not self.operations or any(op not in _OPERATIONS for op in self.operations):
      raise ValueError(f"ArithmeticConfig.operations={self.operations!r}: expected a non-empty "
                       f"subset of {_OPERATIONS}")
    if self.template not in _TEMPLATES:
      raise ValueError(f"ArithmeticConfig.template={self.template!r}: expected one of "
                       f"{_TEMPLATES}")


def evaluate_expression(operands: Sequence[int], operators: Sequence[str]) -> int:
  """Integer value of `o0 op0 o1 op1 ...` with `*` binding tighter than `+` and `-`."""
  if len(operators) != len(operands) - 1:
    raise ValueError(f"evaluate_expression: {len(operands)} operands need "
                     f"{len(operands) - 1} operators, got {len(operators)}")
  terms, signs = [int(operands[0])], [1]
  for op, x in zip(operators, operands[1:]):
    if op == "*":
      terms[-1] *= int(x)
    elif op in ("+", "-"):
      terms.append(int(x))
      signs.append(1 if op == "+" else -1)
    else:
      raise ValueError(f"evaluate_expression: operator {op!r}; expected one of {_OPERATIONS}")
  return sum(s * t for s, t in zip(signs, terms))


def _sample_operand(rng: np.random.Generator, cfg: ArithmeticConfig) -> int:
  digits = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


def arithmetic_example(rng: np.random.Generator, cfg: ArithmeticConfig,
                       ex_id: str = "") -> PromptExample:
  """One arithmetic problem drawn from `rng` (a negative result is redrawn when
  `allow_negative=False`)."""
  for _ in range(1000):
    operands = [_sample_operand(rng, cfg) for _ in range(cfg.num_operands)]
    operators = [cfg.operations[int(i)]
                 for i in rng.integers(0, len(cfg.operations), cfg.num_operands - 1)]
    value = evaluate_expression(operands, operators)
    if cfg.allow_negative or value >= 0:
      break
  else:  # pragma: no cover - only with operations=("-",) and absurd operand counts
    raise ValueError(f"ArithmeticConfig={cfg}: could not draw a non-negative problem")
  expr = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(operators, operands[1:]))
  answer = str(value)
  if cfg.template == "boxed":
    prompt = f"Compute {expr}. Put the final answer in \\boxed{{}}."
    solution = f"\\boxed{{{answer}}}"
  else:
    field = expr
    if cfg.template == "padded":
      field = expr.ljust(cfg.num_operands * (cfg.max_digits + 1) - 1)
    prompt = f"{field}="
    solution = answer
  meta = {"task": "arithmetic", "expression": expr, "solution": solution}
  if cfg.template == "padded":
    meta["field"] = field
  return PromptExample(prompt=prompt, answer=answer, id=ex_id, metadata=meta)


def arithmetic_examples(num_examples: int, *, seed: int = 0,
                        config: ArithmeticConfig | None = None) -> list[PromptExample]:
  """`num_examples` problems, a pure function of (seed, config)."""
  if not isinstance(num_examples, int) or num_examples <= 0:
    raise ValueError(f"arithmetic_examples: num_examples={num_examples!r}; expected a positive "
                     f"int")
  cfg = config or ArithmeticConfig()
  rng = np.random.default_rng(seed)
  return [arithmetic_example(rng, cfg, ex_id=f"arith-{seed}-{i}") for i in range(num_examples)]
