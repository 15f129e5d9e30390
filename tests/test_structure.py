"""The package's shape, checked from its source: no import cycle among `sparrow_jax` modules
(imports inside functions count), the run package's classes and the run/rl functions within
their size limits, and one place that builds the GRPO loss config from a TrainConfig."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "sparrow_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str, mods) -> str | None:
  """The longest prefix of a dotted name that is a module of the package."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    cand = ".".join(parts[:i])
    if cand in mods:
      return cand
  return None


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports, at any depth of its code."""
  mods = _modules()
  graph = {m: set() for m in mods}
  for mod, path in mods.items():
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
          pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
          pkg = pkg[:len(pkg) - (node.level - 1)]
          base = ".".join(pkg + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                   for a in node.names]
      for t in targets:
        r = _resolve(t, mods) if t.startswith("sparrow_jax") else None
        if r is not None and r != mod:
          graph[mod].add(r)
  return graph


def cycles(graph) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_the_cycle_finder_finds_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_package_modules():
  graph = import_graph()
  assert "sparrow_jax.run.stages" in graph["sparrow_jax.run.trainer"]  # the graph is read
  assert cycles(graph) == []


def _defs(folder: str):
  for path in sorted((PKG / folder).glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield path.name, node, node.end_lineno - node.lineno + 1


def test_run_classes_and_run_rl_functions_stay_small():
  big_classes = [(f, n.name, size) for f, n, size in _defs("run")
                 if isinstance(n, ast.ClassDef) and size > 400]
  assert big_classes == []
  big_functions = [(f, n.name, size) for folder in ("run", "rl") for f, n, size in _defs(folder)
                   if not isinstance(n, ast.ClassDef) and size > 120]
  assert big_functions == []


def test_one_place_builds_the_loss_config():
  users = [p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py")
           if "GRPOLossConfig(" in p.read_text() and p.name != "grpo.py"]
  assert users == ["sparrow_jax/run/algorithm.py"]
