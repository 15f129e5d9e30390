"""Tools, the registry and the tool-call formats: exact arithmetic, the Python sandbox's limits,
errors as tool responses (never exceptions), and the Qwen3 format against a chat template
rendered by transformers."""

import json
import time

import pytest

from sparrow_jax.agents import formats as F
from sparrow_jax.agents import tools as T


# --- calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize("expr,want", [
    ("123456*654321", str(123456 * 654321)),
    ("98765 + 43210 - 1", "141974"),
    ("1/3 + 1/6", "1/2"),
    ("0.1 + 0.2", "3/10"),
    ("2**100", str(2 ** 100)),
    ("-(7 // 2) % 5", str(-(7 // 2) % 5)),
    ("2^10", "1024"),
    ("12,345 * 2", "24690"),
    ("(1/2)**-2", "4"),
])
def test_calculator_is_exact(expr, want):
  assert T.calculate(expr) == want


@pytest.mark.parametrize("expr,msg", [
    ("__import__('os')", "unsupported syntax"),
    ("1/0", "division by zero"),
    ("2**100000", "exponent"),
    ("2**0.5", "integer exponents"),
    ("1 +", "cannot parse"),
    ("", "empty"),
    ("x + 1", "unsupported syntax"),
    ("(10**999)**3", "digits"),
])
def test_calculator_refuses(expr, msg):
  with pytest.raises(T.ToolError, match=msg):
    T.calculate(expr)


def test_registry_turns_failures_into_error_results():
  reg = T.build_registry("calculator")
  ok = reg.call("calculator", {"expression": "6*7"})
  assert (ok.text, ok.error, ok.timeout) == ("42", False, False)
  for name, args, msg in [("calc", {"expression": "1"}, "unknown tool 'calc'"),
                          ("calculator", {}, "needs the argument(s) expression"),
                          ("calculator", ["1+1"], "must be a JSON object"),
                          ("calculator", {"expression": "1/0"}, "division by zero"),
                          ("calculator", {"expression": 5}, "must be a string")]:
    r = reg.call(name, args)
    assert r.error and not r.timeout and r.text.startswith("Error:") and msg in r.text, r

  def boom(args):
    raise RuntimeError("kaput")
  reg.register(T.Tool("boom", "raises", {"type": "object"}, boom))
  r = reg.call("boom", {})
  assert r.error and "RuntimeError: kaput" in r.text
  with pytest.raises(ValueError, match="already registered"):
    reg.register(T.Tool("boom", "", {}, boom))
  with pytest.raises(ValueError, match="unknown tool 'nope'"):
    T.build_registry("calculator,nope")


def test_thread_tool_timeout_is_counted():
  reg = T.ToolRegistry([T.Tool("sleepy", "hangs", {"type": "object"},
                               lambda a: time.sleep(30) or "late", timeout_s=0.3)])
  t0 = time.perf_counter()
  r = reg.call("sleepy", {})
  took = time.perf_counter() - t0
  assert r.timeout and r.error and "timed out after 0.3 s" in r.text
  assert 0.3 <= took < 5, took  # it costs its timeout, not the tool's 30 s


def test_truncation():
  assert T.truncate_chars("abcdef", 100) == "abcdef"
  cut = T.truncate_chars("x" * 100, 40)
  assert len(cut) == 40 and cut.endswith("[truncated]")
  enc = lambda s: list(s.encode())
  dec = lambda ids: bytes(ids).decode()
  out = T.truncate_tokens("y" * 100, enc, dec, 30)
  assert len(enc(out)) <= 30 and out.endswith("...[truncated]") and out.startswith("y")
  assert T.truncate_tokens("short", enc, dec, 30) == "short"


# --- the Python interpreter ------------------------------------------------------------------
@pytest.fixture(scope="module")
def py():
  return T.PythonInterpreter(timeout_s=2.0, memory_mb=256, max_output_chars=300)


def test_python_runs_code_in_a_process(py):
  assert py.run("print(sum(range(10)))").strip() == "45"
  out = py.run("import os; print(os.getcwd()); print(sorted(set(os.environ) - {'LC_CTYPE'}))")
  # a fresh directory, an environment of PATH alone (Python adds LC_CTYPE itself)
  assert "sparrow_tool_" in out and "['PATH']" in out, out


def test_python_error_and_exit_are_failed_output():
  reg = T.build_registry("python", python_timeout_s=2.0)
  r = reg.call("python", {"code": "1/0"})
  assert r.error and not r.timeout and "ZeroDivisionError" in r.text and "exit code 1" in r.text
  r = reg.call("python", {"code": "print('ok')"})
  assert not r.error and r.text.strip() == "ok"


def test_python_hang_costs_its_timeout_and_is_counted():
  reg = T.ToolRegistry([T.python_tool(timeout_s=1.0)])
  t0 = time.perf_counter()
  r = reg.call("python", {"code": "import time\nwhile True: time.sleep(0.01)"})
  took = time.perf_counter() - t0
  assert r.timeout and r.error and "timed out after 1 s" in r.text
  assert 1.0 <= took < 6, took


def test_python_memory_limit(py):
  out = py.run("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')")
  assert "MemoryError" in out and "allocated" not in out


def test_python_output_truncated(py):
  out = py.run("print('z' * 10000)")
  assert len(out) <= 300 and out.endswith("[truncated]")


def test_python_no_network(py):
  code = ("import socket\n"
          "try:\n"
          "  socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
          "  print('CONNECTED')\n"
          "except OSError as e:\n"
          "  print('blocked', type(e).__name__)\n")
  out = py.run(code)
  assert "blocked" in out and "CONNECTED" not in out, out
  if py.network == "netns":  # a fresh namespace: even the raw module reaches nothing
    raw = ("import _socket\n"
           "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
           "s.settimeout(1)\n"
           "try:\n"
           "  s.connect(('1.1.1.1', 53)); print('CONNECTED')\n"
           "except OSError as e:\n"
           "  print('unreachable', e.errno)\n")
    out = py.run(raw)
    assert "unreachable" in out and "CONNECTED" not in out, out


def test_python_socket_block_fallback():
  p = T.PythonInterpreter(timeout_s=2.0, network_isolation="socket_block")
  assert p.network == "socket_block"
  out = p.run("import socket\ntry:\n  socket.socket()\nexcept OSError as e:\n  print(e)")
  assert "network access is disabled" in out


# --- formats ---------------------------------------------------------------------------------
def test_qwen3_parse():
  fmt = F.Qwen3Format()
  text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
          '{"expression": "12*3"}}\n</tool_call><|im_end|>')
  turn = fmt.parse(text)
  assert turn.calls == [F.ToolCall("calculator", {"expression": "12*3"})] and not turn.errors
  assert fmt.parse("The answer is 36.<|im_end|>").final
  # arguments written as a JSON string are accepted
  t2 = fmt.parse('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
                 '</tool_call>')
  assert t2.calls == [F.ToolCall("python", {"code": "print(1)"})]


@pytest.mark.parametrize("text,msg", [
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
])
def test_qwen3_malformed_calls_are_errors(text, msg):
  turn = F.Qwen3Format().parse(text)
  assert not turn.final and not turn.calls and len(turn.errors) == 1 and msg in turn.errors[0]


def test_plain_format():
  fmt = F.make_format("plain", T.build_registry("calculator"))
  turn = fmt.parse("<tool calculator 1234*5678>")
  assert turn.calls == [F.ToolCall("calculator", {"expression": "1234*5678"})]
  assert fmt.render_call(turn.calls[0]) == "<tool calculator 1234*5678>"
  assert fmt.render_responses("", ["7006652"]) == "<result 7006652>"
  assert fmt.parse("7006652").final
  assert fmt.parse("<tool >").errors == ["Error: the tool call names no tool"]
  assert "not closed" in fmt.parse("<tool calculator 12").errors[0]
  assert fmt.turn_complete("<tool calculator 1*2>") and not fmt.turn_complete("3>")
  assert fmt.turn_complete("7006652")
  assert fmt.final_text("<tool calculator 1*2><result 2>2") == "2"
  with pytest.raises(ValueError, match="unknown tool_format"):
    F.make_format("xml")
  # plain_padded: responses left-aligned in a fixed field, so that the i-th character of a
  # response is always the same distance from the i-th character of an answer repeating it
  padded = F.make_format("plain_padded", T.build_registry("calculator"), pad_to=8)
  assert padded.render_responses("", ["42"]) == "<result 42      >"
  assert padded.render_responses("", ["123456789"]) == "<result 123456789>"
  assert padded.final_text("<tool calculator 6*7><result 42      >42") == "42"


# A Qwen3-layout chat template (tool messages in one user turn as <tool_response> blocks, the
# assistant's tool calls as <tool_call> JSON after its content), written for this test.
_QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for tc in m.tool_calls | default([]) %}"
    "{%- if loop.first and m.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _qwen3_style_tokenizer():
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  from tokenizers import decoders, models, pre_tokenizers
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {c: i for i, c in enumerate(sorted(alphabet))}
  tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tk.decoder = decoders.ByteLevel()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
  tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
  tok.chat_template = _QWEN3_STYLE_TEMPLATE
  return tok


def test_qwen3_format_matches_the_chat_template():
  """prompt + policy turn + the format's environment text == the template's rendering of the
  conversation with the tool message, as text and as token ids."""
  tok = _qwen3_style_tokenizer()
  fmt = F.Qwen3Format()
  call = F.ToolCall("calculator", {"expression": "1234*5678"})
  msgs = [{"role": "user", "content": "What is 1234*5678?"}]
  prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  turn = "I will use the calculator.\n" + fmt.render_call(call) + "<|im_end|>"
  env = fmt.render_responses(turn, ["7006652"])
  ours = prompt + turn + env
  full = msgs + [
      {"role": "assistant", "content": "I will use the calculator.",
       "tool_calls": [{"type": "function",
                       "function": {"name": "calculator",
                                    "arguments": {"expression": "1234*5678"}}}]},
      {"role": "tool", "content": "7006652"}]
  want = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
  assert ours == want
  enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
  assert enc(prompt) + enc(turn) + enc(env) == enc(want)  # pieces tokenize as the whole
  # two calls in one turn -> two <tool_response> blocks in one user turn
  env2 = fmt.render_responses(turn, ["a", "b"])
  full2 = full[:-1] + [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
  assert prompt + turn + env2 == tok.apply_chat_template(full2, tokenize=False,
                                                         add_generation_prompt=True)
  # a turn stopped at </tool_call> without <|im_end|>: the environment closes it
  assert fmt.render_responses(turn[:-len("<|im_end|>")], ["7006652"]) == "<|im_end|>" + env
  assert json.loads(turn.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["name"] == \
      "calculator"
