"""The tool system prompt (issue 49, item 4: chat models whose template ignores `tools=`, e.g.
SmolLM2's): its example call is one the format parses, and `system_prompt=` reaches the
rendered prompt of every example (chat template and byte tokenizer), the warm start's too."""

import pytest

from sparrow_jax.agents import ToolCall, build_registry, make_format
from sparrow_jax.agents.tasks import tool_system_prompt
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.run.builders import build_examples, encode_prompt
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.warmstart import warmstart_pairs
from tests.agents.test_tools import _qwen3_style_tokenizer

REG = build_registry("calculator")


@pytest.mark.parametrize("fmt_name", ["qwen3", "plain"])
def test_tool_system_prompt_shows_a_call_the_format_parses(fmt_name):
  fmt = make_format(fmt_name, REG)
  text = tool_system_prompt(REG, fmt, example="12345 * 678")
  assert fmt.parse(text).items == (ToolCall("calculator", {"expression": "12345 * 678"}),)
  assert "8369910" in text  # the tool's real result for the example
  assert "\\boxed{}" in text
  with pytest.raises(ValueError, match="'python' is not registered"):
    tool_system_prompt(REG, fmt, tool="python")


def _cfg(**kw):
  return get_train_config("tiny_tools").replace(
      num_examples=8, arith_template="boxed", tool_format="qwen3", system_prompt="tools", **kw)


def test_system_prompt_reaches_the_chat_template_and_the_byte_prompt():
  cfg = _cfg()
  want = tool_system_prompt(REG, make_format("qwen3", REG))
  exs = build_examples(cfg)
  plain = build_examples(cfg.replace(system_prompt=""))
  assert len(exs) == len(plain) == 8
  tok = _qwen3_style_tokenizer()
  for e, p in zip(exs, plain):
    assert e.prompt == ({"role": "system", "content": want},
                        {"role": "user", "content": p.prompt})
    assert (e.answer, e.metadata) == (p.answer, p.metadata)
    text = tok.decode(encode_prompt(tok, e, True))
    assert text.startswith("<|im_start|>system\n" + want + "<|im_end|>\n<|im_start|>user\n"
                           + p.prompt)
    byte = ByteTokenizer()
    assert byte.decode(encode_prompt(byte, e, True)) == want + "\n" + p.prompt
  # the warm start's demonstrations are conditioned on the same prompt
  pairs = warmstart_pairs(cfg.replace(tool_format="plain"), ByteTokenizer(), exs, 2)
  assert ByteTokenizer().decode(pairs[0][0]).startswith(want)
  # any other text goes in verbatim
  assert build_examples(cfg.replace(system_prompt="Be brief."))[0].prompt[0] == {
      "role": "system", "content": "Be brief."}


def test_system_prompt_tools_needs_tools():
  with pytest.raises(ValueError, match="system_prompt=tools describes the tools"):
    get_train_config("tiny", ["system_prompt=tools"])


def test_probe_classifies_calls_by_the_policy_turns_only():
  """experiments/smollm2_tools_probe.py: a call counts when the policy wrote it (loss mask 1)
  and is right when the calculator's result equals the answer; text in the environment's
  tokens (here a call-shaped string) is not the policy's call."""
  import numpy as np
  from experiments.smollm2_tools_probe import build_messages, classify, summarize
  from sparrow_jax.engine.config import Completion
  from sparrow_jax.rl.data import PromptExample

  tok = ByteTokenizer()
  fmt = make_format("qwen3", REG)
  dec = lambda ids: tok.decode([int(i) for i in ids])  # noqa: E731

  def comp(pieces):  # (text, policy?) pieces
    ids, mask = [], []
    for text, pol in pieces:
      t = tok.encode(text, add_bos=False)
      ids += t
      mask += [float(pol)] * len(t)
    return Completion(0, np.zeros(1, np.int32), np.asarray(ids, np.int32),
                      np.zeros(len(ids), np.float32), "stop",
                      loss_mask=np.asarray(mask, np.float32))

  good = fmt.render_call(ToolCall("calculator", {"expression": "1234*5678"}))
  wrong = fmt.render_call(ToolCall("calculator", {"expression": "1234+5678"}))
  bad_args = fmt.render_call(ToolCall("calculator", {"operation": "add"}))
  cases = [([(good, 1), ("<tool_response>7006652</tool_response>", 0), ("7006652", 1)],
            dict(tag=True, parsed=True, right=True)),
           ([(wrong, 1)], dict(tag=True, parsed=True, right=False)),
           ([(bad_args, 1)], dict(tag=True, parsed=True, right=False)),
           ([("<tool_call>{not json</tool_call>", 1)], dict(tag=True, parsed=False, right=False)),
           ([("7006652", 1), (good, 0)], dict(tag=False, parsed=False, right=False))]
  for pieces, want in cases:
    assert classify(comp(pieces), "7006652", fmt, REG, dec) == want, pieces
  rows = [dict(tag=True, parsed=True, right=True, calls=1, errors=0, reward=1.0),
          dict(tag=False, parsed=False, right=False, calls=0, errors=0, reward=0.0)]
  s = summarize(rows)
  assert (s["frac_right_call"], s["reward_with_call"], s["reward_without_call"]) == (0.5, 1.0, 0.0)
  ex = PromptExample(prompt="Compute 1+2.", answer="3")
  assert build_messages(ex, "template", "S") == [{"role": "user", "content": "Compute 1+2."}]
  assert build_messages(ex, "hint", "S") == [
      {"role": "system", "content": "S"},
      {"role": "user", "content": "Compute 1+2. Use the calculator tool."}]
  with pytest.raises(ValueError, match="condition 'x'"):
    build_messages(ex, "x", "S")
