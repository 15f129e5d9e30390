"""Tools an agent may call during a rollout, and the registry that calls them.

A tool is a name, a description, a JSON schema of its arguments, and a function
`(arguments: dict) -> str`. `ToolRegistry.call` never raises: an unknown tool, bad arguments, a
tool that raises, or one that runs past its timeout become a `ToolResult` whose text is an
error message for the model (the tool-response turn), with `error` / `timeout` set so the
metrics can count them.

    Calculator         exact integer and rational arithmetic (`fractions.Fraction`) over a parsed
                       expression tree: numbers, + - * / // % **, parentheses, unary signs. No
                       `eval`; exponents and operand sizes are bounded.
    PythonInterpreter  runs a snippet in a fresh `python -I` process: wall-clock timeout (the
                       process group is killed), address-space and CPU-time limits
                       (`resource.setrlimit` in the child), no network, stdout + stderr
                       truncated to a token budget. What is enforced is in its docstring.

This module imports nothing from the project (the layer under the agent loop).
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What a tool call gave the model: `text` (the tool-response content), whether it failed
  (`error`: unknown tool, bad arguments, an exception, a non-zero exit) or was killed at its
  timeout (`timeout`, also an error), and the wall seconds it took."""

  text: str
  error: bool = False
  timeout: bool = False
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool. `fn(arguments) -> str` may raise: the registry turns that into an error
  result. `timeout_s`: the registry abandons a call past it (a process tool enforces its own).
  `main_arg`: the argument a plain-format call's text fills (`<tool NAME TEXT>`)."""

  name: str
  description: str
  parameters: Mapping[str, Any]  # JSON schema of the arguments object
  fn: Callable[[Mapping[str, Any]], str]
  main_arg: str | None = None
  timeout_s: float | None = None

  def schema(self) -> dict:
    """The OpenAI/Qwen function description a chat template lists under `tools`."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": dict(self.parameters)}}


class ToolError(Exception):
  """A tool's own, expected failure (bad input): its message goes to the model as is."""


class ToolRegistry:
  """Tools by name. `call(name, arguments)` -> `ToolResult`, never an exception."""

  def __init__(self, tools=(), *, max_output_chars: int = 2000):
    self._tools: dict[str, Tool] = {}
    self.max_output_chars = max_output_chars
    for t in tools:
      self.register(t)

  def register(self, tool: Tool) -> Tool:
    if not tool.name or any(c.isspace() or c in "<>" for c in tool.name):
      raise ValueError(f"tool name {tool.name!r}: expected a non-empty name without spaces "
                       "or angle brackets")
    if tool.name in self._tools:
      raise ValueError(f"tool {tool.name!r} is already registered")
    self._tools[tool.name] = tool
    return tool

  def __contains__(self, name: str) -> bool:
    return name in self._tools

  def __getitem__(self, name: str) -> Tool:
    return self._tools[name]

  @property
  def names(self) -> list[str]:
    return list(self._tools)

  def schemas(self) -> list[dict]:
    return [t.schema() for t in self._tools.values()]

  def call(self, name: str, arguments: Any) -> ToolResult:
    t0 = time.perf_counter()
    tool = self._tools.get(name)
    if tool is None:
      return ToolResult(f"Error: unknown tool {name!r}; available tools: "
                        f"{', '.join(self._tools) or 'none'}", error=True)
    if not isinstance(arguments, Mapping):
      return ToolResult(f"Error: the arguments of {name} must be a JSON object, got "
                        f"{type(arguments).__name__}", error=True)
    missing = [k for k in tool.parameters.get("required", ()) if k not in arguments]
    if missing:
      return ToolResult(f"Error: {name} needs the argument(s) {', '.join(missing)}", error=True)
    try:
      if tool.timeout_s is None:
        text = tool.fn(arguments)
      else:
        text = _call_with_deadline(tool.fn, arguments, tool.timeout_s)
    except _Deadline:
      return ToolResult(f"Error: {name} timed out after {tool.timeout_s:g} s", error=True,
                        timeout=True, seconds=time.perf_counter() - t0)
    except ToolTimeout as e:
      return ToolResult(f"Error: {e}", error=True, timeout=True,
                        seconds=time.perf_counter() - t0)
    except ToolError as e:
      return ToolResult(f"Error: {e}", error=True, seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a tool must never stop a rollout
      return ToolResult(f"Error: {type(e).__name__}: {e}", error=True,
                        seconds=time.perf_counter() - t0)
    failed = isinstance(text, _FailedOutput)
    return ToolResult(truncate_chars(str(text), self.max_output_chars), error=failed,
                      seconds=time.perf_counter() - t0)


class ToolTimeout(Exception):
  """A tool that enforces its own timeout (a killed process) ran past it."""


class _Deadline(Exception):
  pass


class _FailedOutput(str):
  """Tool output that is also a failure (a process that exited non-zero): shown to the model
  as is, counted as an error."""


def _call_with_deadline(fn, arguments, timeout_s: float) -> str:
  """`fn(arguments)` in a daemon thread; past `timeout_s` the call is abandoned."""
  box: dict[str, Any] = {}

  def run():
    try:
      box["out"] = fn(arguments)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller
      box["exc"] = e

  th = threading.Thread(target=run, daemon=True)
  th.start()
  th.join(timeout_s)
  if th.is_alive():
    raise _Deadline()
  if "exc" in box:
    raise box["exc"]
  return box["out"]


def truncate_chars(text: str, limit: int) -> str:
  """`text` cut to `limit` characters, the cut marked."""
  if limit <= 0 or len(text) <= limit:
    return text
  mark = "\n...[truncated]"
  return text[:max(limit - len(mark), 0)] + mark


def truncate_tokens(text: str, encode: Callable[[str], list], decode: Callable[[list], str],
                    budget: int) -> str:
  """`text` cut to at most `budget` tokens of a tokenizer (`encode`/`decode`), the cut marked
  (the mark counts against the budget)."""
  ids = encode(text)
  if len(ids) <= budget:
    return text
  mark = "...[truncated]"
  keep = max(budget - len(encode(mark)), 0)
  return decode(ids[:keep]) + mark


# --- the calculator --------------------------------------------------------------------------
_MAX_EXPONENT = 1000
_MAX_DIGITS = 2000
_MAX_EXPR_CHARS = 500


def _check_size(x: fractions.Fraction) -> fractions.Fraction:
  if max(abs(x.numerator), x.denominator).bit_length() > _MAX_DIGITS * 3.33:
    raise ToolError(f"result has more than {_MAX_DIGITS} digits")
  return x


def _eval_node(node: ast.AST) -> fractions.Fraction:
  if isinstance(node, ast.Expression):
    return _eval_node(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    if isinstance(node.value, float):  # "0.1" is read as the exact decimal 1/10
      return fractions.Fraction(repr(node.value))
    return fractions.Fraction(node.value)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    v = _eval_node(node.operand)
    return v if isinstance(node.op, ast.UAdd) else -v
  if isinstance(node, ast.BinOp):
    a, b = _eval_node(node.left), _eval_node(node.right)
    op = node.op
    if isinstance(op, ast.Add):
      return _check_size(a + b)
    if isinstance(op, ast.Sub):
      return _check_size(a - b)
    if isinstance(op, ast.Mult):
      return _check_size(a * b)
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)):
      if b == 0:
        raise ToolError("division by zero")
      if isinstance(op, ast.Div):
        return _check_size(a / b)
      return _check_size(fractions.Fraction(a // b) if isinstance(op, ast.FloorDiv) else a % b)
    if isinstance(op, ast.Pow):
      if b.denominator != 1:
        raise ToolError("only integer exponents are exact")
      if abs(b.numerator) > _MAX_EXPONENT:
        raise ToolError(f"exponent {b.numerator} too large (at most {_MAX_EXPONENT})")
      if a == 0 and b < 0:
        raise ToolError("division by zero")
      return _check_size(a ** int(b.numerator))
  raise ToolError(f"unsupported syntax {ast.unparse(node)!r}: use numbers, + - * / // % ** "
                  "and parentheses")


def calculate(expression: str) -> str:
  """The exact value of an arithmetic expression: an integer, or a reduced fraction `p/q`.

  `1/3 + 1/6` -> `1/2`; `2**100` -> all 31 digits; `0.1 + 0.2` -> `3/10`. Raises `ToolError`
  for anything else (names, calls, attributes, too large results)."""
  if not isinstance(expression, str):
    raise ToolError(f"expression must be a string, got {type(expression).__name__}")
  expr = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
  expr = expr.replace(",", "")  # thousands separators (a tuple is no arithmetic anyway)
  if not expr:
    raise ToolError("empty expression")
  if len(expr) > _MAX_EXPR_CHARS:
    raise ToolError(f"expression longer than {_MAX_EXPR_CHARS} characters")
  try:
    tree = ast.parse(expr, mode="eval")
  except SyntaxError as e:
    raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
  v = _eval_node(tree)
  return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def calculator_tool() -> Tool:
  return Tool(
      name="calculator",
      description="Exact arithmetic on integers and fractions: + - * / // % ** and parentheses.",
      parameters={"type": "object",
                  "properties": {"expression": {"type": "string",
                                                "description": "e.g. 12345 * 678"}},
                  "required": ["expression"]},
      fn=lambda args: calculate(args["expression"]), main_arg="expression", timeout_s=5.0)


# --- the Python interpreter ------------------------------------------------------------------
# Run in the child before the snippet: the fallback network block, then the snippet itself.
_RUNNER = r"""
import socket, sys
def _blocked(*a, **k):
  raise OSError("network access is disabled in this sandbox")
for _n in ("socket", "create_connection", "socketpair", "fromfd", "getaddrinfo"):
  setattr(socket, _n, _blocked)
del _n
_src = sys.stdin.read()
sys.argv = ["<tool>"]
_g = {"__name__": "__main__"}
exec(compile(_src, "<tool>", "exec"), _g)
"""


def _netns_available() -> bool:
  """Whether `unshare --user --map-root-user --net` can start a process here (it needs
  unprivileged user namespaces)."""
  exe = shutil.which("unshare")
  if exe is None:
    return False
  try:
    r = subprocess.run([exe, "--user", "--map-root-user", "--net", "true"], timeout=10,
                       capture_output=True)
    return r.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


class PythonInterpreter:
  """Runs a Python snippet in a separate process and returns its stdout + stderr.

  Enforced (the test file checks each):
    - wall-clock `timeout_s`: the child runs in its own session and the whole process group
      is killed (SIGKILL) at the deadline; the call then reports a timeout;
    - `memory_mb`: RLIMIT_AS (address space) set in the child before exec, so an allocation
      past it fails with MemoryError; RLIMIT_CPU at ceil(timeout_s) + 1 CPU seconds;
      RLIMIT_NPROC is not set (it counts the user's processes machine-wide);
    - no network: where unprivileged user namespaces work (`unshare --user --map-root-user
      --net`, checked once) the child runs in a fresh network namespace with only a downed
      loopback, so no socket can reach anything (`network="netns"`); elsewhere the runner
      replaces `socket.socket` and friends with a function that raises
      (`network="socket_block"`: this stops ordinary code, not code that imports `_socket`);
    - `python -I` (isolated: no user site, no PYTHON* variables), an empty environment, a
      fresh temporary working directory removed afterwards;
    - output: stdout and stderr merged and cut to `max_output_chars` characters (the agent
      loop cuts the tool response again to its token budget).
  Not enforced: file-system access outside the working directory (the process runs as the
  trainer's user). Use it for trusted-ish model output on a machine that holds nothing secret,
  or run the trainer itself in a container.
  """

  def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_chars: int = 2000, network_isolation: str = "auto"):
    if timeout_s <= 0:
      raise ValueError(f"PythonInterpreter timeout_s={timeout_s}: expected > 0")
    if memory_mb < 32:
      raise ValueError(f"PythonInterpreter memory_mb={memory_mb}: expected >= 32")
    if network_isolation not in ("auto", "netns", "socket_block"):
      raise ValueError(f"PythonInterpreter network_isolation={network_isolation!r}: expected "
                       "auto, netns or socket_block")
    self.timeout_s, self.memory_mb, self.max_output_chars = timeout_s, memory_mb, max_output_chars
    if network_isolation == "auto":
      network_isolation = "netns" if _netns_available() else "socket_block"
    elif network_isolation == "netns" and not _netns_available():
      raise ValueError("PythonInterpreter network_isolation='netns': `unshare --user "
                       "--map-root-user --net` does not work on this machine")
    self.network = network_isolation

  def _limits(self):
    import resource  # in the child, between fork and exec
    mem = self.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(self.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

  def run(self, code: str) -> str:
    """stdout + stderr of `code` (a failure's traceback included). Raises `ToolTimeout` past
    the timeout; a non-zero exit returns its output marked as failed."""
    if not isinstance(code, str):
      raise ToolError(f"code must be a string, got {type(code).__name__}")
    cmd = [sys.executable, "-I", "-c", _RUNNER]
    if self.network == "netns":
      cmd = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net", *cmd]
    with tempfile.TemporaryDirectory(prefix="sparrow_tool_") as cwd:
      proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=cwd, env={"PATH": os.defpath},
                              start_new_session=True, preexec_fn=self._limits)
      try:
        out, _ = proc.communicate(code.encode(), timeout=self.timeout_s)
      except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise ToolTimeout(f"python timed out after {self.timeout_s:g} s") from None
    text = truncate_chars(out.decode("utf-8", "replace"), self.max_output_chars)
    if proc.returncode != 0:
      reason = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                else f"exit code {proc.returncode}")
      return _FailedOutput(f"{text}\n[{reason}]" if text else f"[{reason}]")
    return text


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    proc.kill()


def python_tool(**kwargs) -> Tool:
  interp = PythonInterpreter(**kwargs)
  return Tool(
      name="python",
      description=("Run Python code in a sandbox and return what it prints (stdout and "
                   "stderr); no network, limited time and memory."),
      parameters={"type": "object",
                  "properties": {"code": {"type": "string", "description": "Python source"}},
                  "required": ["code"]},
      fn=lambda args: interp.run(args["code"]), main_arg="code")


# Tools by the name a config lists them under (`tools=calculator,python`).
TOOL_FACTORIES: dict[str, Callable[..., Tool]] = {"calculator": calculator_tool,
                                                  "python": python_tool}


def build_registry(names: str | list[str], *, max_output_chars: int = 2000,
                   python_timeout_s: float = 5.0) -> ToolRegistry:
  """A registry of the named tools (comma-separated or a list)."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  reg = ToolRegistry(max_output_chars=max_output_chars)
  for n in names:
    if n not in TOOL_FACTORIES:
      raise ValueError(f"unknown tool {n!r}; known tools: {sorted(TOOL_FACTORIES)}")
    kw = {"timeout_s": python_timeout_s, "max_output_chars": max_output_chars} \
        if n == "python" else {}
    reg.register(TOOL_FACTORIES[n](**kw))
  return reg
