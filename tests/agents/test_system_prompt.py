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
