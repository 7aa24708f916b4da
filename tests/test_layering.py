"""Layering: imports flow one way (pure math → model → orchestration), `--help` loads no JAX, and
no module of the package imports one that imports it back, even from inside a function."""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vapo_jax"


def _loaded_after(module: str) -> set[str]:
  code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=PACKAGE.parent).stdout
  return set(out.split())


def test_config_and_the_cli_load_no_jax():
  for module in ("vapo_jax.config", "vapo_jax.cli"):
    loaded = _loaded_after(module)
    assert "jax" not in loaded and "flax" not in loaded, module


def test_pure_math_loads_no_flax_and_no_config():
  for module in ("vapo_jax.advantages", "vapo_jax.losses", "vapo_jax.masked"):
    loaded = _loaded_after(module)
    assert "flax" not in loaded and "vapo_jax.config" not in loaded, module


def _imports(path: pathlib.Path, name: str) -> set[str]:
  """Every `vapo_jax` module that `path` imports, at the top or inside a function."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level:
      base = ".".join(name.split(".")[:-node.level] + ([node.module] if node.module else []))
      found |= {base} | {f"{base}.{a.name}" for a in node.names}
  return {m for m in found if m.startswith("vapo_jax.")}


def _module_graph() -> dict[str, set[str]]:
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules[name] = path
  return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycle_inside_the_package():
  graph = _module_graph()
  assert "vapo_jax.trainer" in graph and graph["vapo_jax.trainer"]  # The graph is real.
  state, cycles = {}, []

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(path[path.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles)
