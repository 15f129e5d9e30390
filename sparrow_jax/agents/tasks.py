"""The tool-using arithmetic task's demonstrations for the supervised warm start.

The task is the synthetic arithmetic set (`rl/data.py`) with operands of 4-6 digits and `+`,
`*` (`tiny_tools` preset): a tiny model cannot multiply two 6-digit numbers in its head, but
it can copy the expression into a calculator call and the result into its answer, so the
reward (the exact final answer, after the last tool response) rewards calling the tool.

A demonstration is a list of (text, trainable) segments of the response: the policy's call,
the environment's response (trainable=False: the warm start's loss skips it, as GRPO's does),
the answer. `tool_demo_frac` of the examples get a tool demonstration, the others the answer
alone, so RL starts from a policy that calls the tool only sometimes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sparrow_jax.agents.formats import ToolCall
from sparrow_jax.agents.tools import ToolRegistry


def demo_segments(expression: str, answer: str, fmt, registry: ToolRegistry, *,
                  use_tool: bool, tool: str = "calculator") -> list[tuple[str, bool]]:
  """(text, trainable) segments of one response: with `use_tool` a call of `tool` on
  `expression`, its real response, then the answer; else the answer alone."""
  if not use_tool:
    return [(answer, True)]
  arg = registry[tool].main_arg or "input"
  call = ToolCall(tool, {arg: expression})
  res = registry.call(tool, call.arguments)
  turn = fmt.render_call(call)
  if hasattr(fmt, "end_of_turn"):  # a chat format: the policy ends its turn itself
    turn += fmt.end_of_turn
  return [(turn, True), (fmt.render_responses(turn, [res.text]), False), (answer, True)]


def demo_responses(examples: Sequence, fmt, registry: ToolRegistry, *, frac: float, seed: int
                   ) -> list[list[tuple[str, bool]]]:
  """Segments of each example's demonstration; a `frac` share (drawn with `seed`) calls the
  tool. Examples need `metadata["expression"]` (the synthetic arithmetic set has it)."""
  if not 0 <= frac <= 1:
    raise ValueError(f"tool_demo_frac={frac}: expected in [0, 1]")
  rng = np.random.default_rng(seed)
  use = rng.random(len(examples)) < frac
  out = []
  for e, u in zip(examples, use):
    expr = e.metadata.get("expression")
    if expr is None:
      raise ValueError(f"example {e.id!r} has no metadata['expression']: tool demonstrations "
                       "are made for the synthetic arithmetic task (data=synthetic:arithmetic)")
    # (the padded template's field keeps the call at a fixed distance from the prompt)
    out.append(demo_segments(e.metadata.get("field", expr), e.answer, fmt, registry,
                             use_tool=bool(u)))
  return out


def encode_segments(segments, encode, eos: int | None) -> tuple[list[int], list[float]]:
  """Token ids and loss mask (1 trainable, 0 environment) of a demonstration, EOS appended."""
  ids, mask = [], []
  for text, trainable in segments:
    t = encode(text)
    ids += t
    mask += [1.0 if trainable else 0.0] * len(t)
  if eos is not None:
    ids.append(eos)
    mask.append(1.0)
  return ids, mask


def tool_system_prompt(registry: ToolRegistry, fmt, *, tool: str = "calculator",
                       example: str = "12345 * 678", answer_hint: str = "\\boxed{}") -> str:
  """A system message that describes `tool` and shows one call in `fmt`'s exact format.

  For chat models whose template does not list tools (SmolLM2's ignores `tools=`): the model
  then sees the call format only if the prompt shows it. The example's call is rendered by
  `fmt` itself (the text the parser reads) and its result comes from the tool."""
  if tool not in registry:
    raise ValueError(f"tool_system_prompt: tool {tool!r} is not registered "
                     f"(registered: {registry.names})")
  t = registry[tool]
  arg = t.main_arg or "input"
  call = fmt.render_call(ToolCall(tool, {arg: example}))
  result = registry.call(tool, {arg: example}).text
  return (f"You can use a tool named {tool}: {t.description}\n"
          f"To use it, reply with only this, then stop:\n{call}\n"
          f"The result comes back to you, e.g. for that call: {result}\n"
          f"Then write the final answer in {answer_hint}.")
