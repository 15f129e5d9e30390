"""The tool-using arithmetic task: its demonstrations (tool responses masked out of the warm
start), the tiny_tools preset and the multi-turn keys' checks."""

import numpy as np
import pytest

from sparrow_jax.agents import build_registry, calculate, make_format
from sparrow_jax.agents.tasks import demo_responses, demo_segments, encode_segments
from sparrow_jax.rl import data as data_lib
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.run.builders import build_examples
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.warmstart import warmstart_pairs

TOK = ByteTokenizer()


def test_tiny_tools_task_is_4_to_6_digit_sums_and_products_with_exact_answers():
  cfg = get_train_config("tiny_tools")
  assert (cfg.tools, cfg.tool_format, cfg.reward) == ("calculator", "plain_padded",
                                                      "exact_match")
  exs = build_examples(cfg)
  ops = set()
  for e in exs[:200]:
    expr = e.metadata["expression"]
    op = "*" if "*" in expr else "+"
    ops.add(op)
    a, b = expr.split(op)
    assert 4 <= len(a) <= 6 and 4 <= len(b) <= 6, expr
    assert e.answer == calculate(expr) == str(int(a) * int(b) if op == "*" else int(a) + int(b))
    # the padded template: the expression left-aligned in a 13-character field
    assert e.prompt == expr.ljust(13) + "=" and e.metadata["field"] == expr.ljust(13)
  assert ops == {"*", "+"}


def test_demonstrations_call_the_tool_for_a_share_and_mask_its_response():
  reg = build_registry("calculator")
  fmt = make_format("plain", reg)
  segs = demo_segments("1234*5678", "7006652", fmt, reg, use_tool=True)
  assert segs == [("<tool calculator 1234*5678>", True), ("<result 7006652>", False),
                  ("7006652", True)]
  assert demo_segments("1+2", "3", fmt, reg, use_tool=False) == [("3", True)]
  ids, mask = encode_segments(segs, lambda s: TOK.encode(s, add_bos=False), eos=2)
  assert TOK.decode(ids) == "<tool calculator 1234*5678><result 7006652>7006652"
  assert ids[-1] == 2 and mask == [1.0] * 27 + [0.0] * 16 + [1.0] * 8
  exs = data_lib.arithmetic_examples(400, seed=3, config=data_lib.ArithmeticConfig(
      min_digits=4, max_digits=6, operations=("+", "*"), template="raw"))
  demos = demo_responses(exs, fmt, reg, frac=0.3, seed=0)
  share = np.mean([len(d) == 3 for d in demos])
  assert 0.22 < share < 0.38, share
  assert all(d[-1][0] == e.answer for d, e in zip(demos, exs))
  with pytest.raises(ValueError, match="no metadata\\['expression'\\]"):
    demo_responses([data_lib.PromptExample(prompt="hi", answer="1", id="x")], fmt, reg,
                   frac=1.0, seed=0)


def test_warmstart_pairs_carry_the_demonstration_mask():
  cfg = get_train_config("tiny_tools", ["tool_demo_frac=1.0", "num_examples=8"])
  exs = build_examples(cfg)
  pairs = warmstart_pairs(cfg, TOK, exs, eos=2)
  for (p, r, m), e in zip(pairs, exs):
    assert TOK.decode(p) == e.prompt and len(r) == len(m)
    env = TOK.decode([t for t, k in zip(r, m) if k == 0])
    assert env == f"<result {e.answer.ljust(16)}>"  # padded to max_tool_response_tokens
    pol = TOK.decode([t for t, k in zip(r, m) if k == 1])
    assert pol == f"<tool calculator {e.metadata['field']}>{e.answer}"
  plain = warmstart_pairs(get_train_config("tiny"), TOK, exs, eos=2)
  assert all(len(x) == 2 for x in plain)  # single-turn runs keep their pairs


@pytest.mark.parametrize("kw,msg", [
    (["tools=calculator,abacus"], "tools='calculator,abacus': expected a comma-separated"),
    (["tool_format=xml"], "tool_format='xml': expected qwen3, plain or plain_padded"),
    (["max_turns=0"], "max_turns=0: expected a positive integer"),
    (["tool_timeout_s=0"], "tool_timeout_s=0"),
    (["tool_demo_frac=1.5"], "tool_demo_frac=1.5"),
    (["arrol=true", "arrol_detect_len=8"], "tools with arrol=true: not supported"),
])
def test_multi_turn_keys_are_checked(kw, msg):
  with pytest.raises(ValueError, match=msg.replace("(", "\\(").replace("[", "\\[")):
    get_train_config("tiny_tools", kw)
