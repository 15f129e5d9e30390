"""The package's layers import only downward (README, Layout); the run package may import
everything, nothing imports it. Lazy imports inside functions count too."""

import ast
import pathlib

import pytest

# Bottom to top: a module may import from its own layer and the layers before it.
LAYERS = ("cpu_kernels", "pallas_kernels", "models", "schedule", "engine", "agents", "rl",
          "calibration", "run")
ROOT = pathlib.Path(__file__).resolve().parents[1] / "sparrow_jax"


def _imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      yield node.lineno, names
    elif isinstance(node, ast.Import):
      yield node.lineno, [a.name for a in node.names]


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_downward(layer):
  allowed = set(LAYERS[:LAYERS.index(layer) + 1])
  bad = []
  for f in sorted((ROOT / layer).rglob("*.py")):
    for line, names in _imports(f):
      for name in names:
        parts = name.split(".")
        if parts[0] == "sparrow_jax" and len(parts) > 1 and parts[1] in LAYERS \
            and parts[1] not in allowed:
          bad.append(f"{f.relative_to(ROOT.parent)}:{line} imports {name}")
  assert not bad, "\n".join(sorted(set(bad)))


def test_every_subpackage_has_a_layer():
  subpackages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
  assert subpackages == set(LAYERS), subpackages ^ set(LAYERS)
