"""Tool-call formats: how a policy's turn asks for a tool, and how the tool responses are
written back into the context (the environment's tokens).

    Qwen3Format  Qwen3's own format. The assistant writes
                   <tool_call>\\n{"name": "calculator", "arguments": {"expression": "..."}}
                   \\n</tool_call><|im_end|>
                 and the environment appends what Qwen3's chat template renders for the tool
                 messages and the next generation prompt:
                   \\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
                   <|im_start|>assistant\\n
                 (one <tool_response> block per call, in call order, in one user turn). The
                 turn ends at <|im_end|> (the model's EOS).
    PlainFormat  a plain tag format for byte-tokenizer models: the call is `<tool NAME TEXT>`
                 (TEXT fills the tool's main argument, e.g. the calculator's expression; it
                 cannot contain `>`), the response `<result TEXT>`. A turn that ends at its
                 stop character `>` without completing a call goes on (`turn_complete`).

`parse(text)` of a policy turn returns a `ParsedTurn`: the well-formed calls and an error
message for every malformed one (bad JSON, no name, an unclosed tag); the agent loop answers
a malformed call with that message as its tool response. A turn with neither is final.
Nothing here imports the project.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """Calls of one policy turn in order; `items` holds a `ToolCall` or an error string (a
  malformed call) per call block."""

  items: tuple = ()

  @property
  def calls(self) -> list[ToolCall]:
    return [x for x in self.items if isinstance(x, ToolCall)]

  @property
  def errors(self) -> list[str]:
    return [x for x in self.items if isinstance(x, str)]

  @property
  def final(self) -> bool:
    """No call at all: the turn is the trajectory's answer."""
    return not self.items


class Qwen3Format:
  """Qwen3's `<tool_call>{json}</tool_call>` calls and chat-template tool responses."""

  name = "qwen3"
  _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

  def __init__(self, *, end_of_turn: str = "<|im_end|>", think_prefix: str = ""):
    # think_prefix: what the template adds after "<|im_start|>assistant\n" (Qwen3 with
    # enable_thinking=False adds "<think>\n\n</think>\n\n").
    self.end_of_turn = end_of_turn
    self.think_prefix = think_prefix

  stop_strings: tuple[str, ...] = ()  # the turn ends at the model's EOS (<|im_end|>)

  def turn_complete(self, text: str) -> bool:
    return True

  def parse(self, text: str) -> ParsedTurn:
    items = []
    for m in self._CALL.finditer(text):
      body, closed = m.group(1).strip(), bool(m.group(2))
      if not closed:
        items.append("Error: the tool call is not closed with </tool_call>")
        continue
      items.append(_json_call(body))
    return ParsedTurn(tuple(items))

  def render_call(self, call: ToolCall) -> str:
    return ("<tool_call>\n" + json.dumps({"name": call.name, "arguments": dict(call.arguments)},
                                         ensure_ascii=False) + "\n</tool_call>")

  def render_responses(self, turn_text: str, responses: Sequence[str]) -> str:
    """The environment's text after a policy turn `turn_text` that made calls with these
    `responses` (the turn's own end-of-turn token is the policy's when it wrote it)."""
    head = "" if turn_text.endswith(self.end_of_turn) else self.end_of_turn
    body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in responses)
    return (f"{head}\n<|im_start|>user{body}{self.end_of_turn}\n<|im_start|>assistant\n"
            f"{self.think_prefix}")

  def final_text(self, text: str) -> str:
    """The answer part of a trajectory's decoded response: what follows the last tool
    response."""
    return text.rsplit("<|im_start|>assistant\n", 1)[-1]


def _json_call(body: str) -> ToolCall | str:
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos})"
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return 'Error: a tool call is a JSON object {"name": ..., "arguments": {...}}'
  args = obj.get("arguments", {})
  if isinstance(args, str):  # some models write the arguments object as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      return f"Error: the arguments of {obj['name']} are not a JSON object"
  if not isinstance(args, dict):
    return f"Error: the arguments of {obj['name']} are not a JSON object"
  return ToolCall(obj["name"], args)


class PlainFormat:
  """`<tool NAME TEXT>` calls and `<result TEXT>` responses, for byte-level models.

  `pad_to` > 0 (`tool_format=plain_padded`): each response is left-aligned in a field of
  `pad_to` characters (spaces after it), so that a response's i-th character sits at the same
  distance from the i-th character of an answer that repeats it, whatever the response's
  length: a tiny byte-level model then copies with one fixed-offset attention pattern."""

  name = "plain"

  def __init__(self, main_args: Mapping[str, str] | None = None, *, open_tag: str = "<tool ",
               close: str = ">", result_open: str = "<result ", result_close: str = ">",
               pad_to: int = 0):
    # main_args: tool name -> the argument the call's text fills (default "input").
    self.main_args = dict(main_args or {})
    self.pad_to = pad_to
    self.open_tag, self.close = open_tag, close
    self.result_open, self.result_close = result_open, result_close
    self.stop_strings = (close,)

  def turn_complete(self, text: str) -> bool:
    """A turn stopped at `>` is complete when that `>` closes a call (else the policy wrote
    a `>` of its own and goes on)."""
    if not text.endswith(self.close):
      return True
    return text.rfind(self.open_tag) > text[:-len(self.close)].rfind(self.close)

  def parse(self, text: str) -> ParsedTurn:
    items = []
    pos = 0
    while True:
      i = text.find(self.open_tag, pos)
      if i < 0:
        break
      j = text.find(self.close, i + len(self.open_tag))
      if j < 0:
        items.append(f"Error: the tool call is not closed with {self.close!r}")
        break
      body = text[i + len(self.open_tag):j].strip()
      name, _, arg = body.partition(" ")
      if not name:
        items.append("Error: the tool call names no tool")
      else:
        items.append(ToolCall(name, {self.main_args.get(name, "input"): arg.strip()}))
      pos = j + len(self.close)
    return ParsedTurn(tuple(items))

  def render_call(self, call: ToolCall) -> str:
    arg = call.arguments.get(self.main_args.get(call.name, "input"), "")
    return f"{self.open_tag}{call.name} {arg}{self.close}"

  def render_responses(self, turn_text: str, responses: Sequence[str]) -> str:
    return "".join(f"{self.result_open}{r.replace(self.result_close, ' ').ljust(self.pad_to)}"
                   f"{self.result_close}" for r in responses)

  def final_text(self, text: str) -> str:
    i = text.rfind(self.result_open)
    if i < 0:
      return text
    j = text.find(self.result_close, i + len(self.result_open))
    return text[j + len(self.result_close):] if j >= 0 else ""


FORMATS = ("qwen3", "plain", "plain_padded")


def make_format(name: str, registry=None, *, pad_to: int = 0):
  """The format called `name` (`plain*` learn the tools' main arguments from `registry`;
  `plain_padded` pads responses to `pad_to` characters)."""
  if name not in FORMATS:
    raise ValueError(f"unknown tool_format {name!r}; expected one of {list(FORMATS)}")
  if name.startswith("plain"):
    main = {} if registry is None else {n: registry[n].main_arg or "input"
                                        for n in registry.names}
    return PlainFormat(main, pad_to=pad_to if name == "plain_padded" else 0)
  return Qwen3Format()
