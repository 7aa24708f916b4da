"""Layering: the package's folders are its tiers, and imports flow one way (`TIERS`, lowest first), read
from the source (imports inside functions included, `experiments/` included); `--help` loads no JAX;
no module imports one that imports it back."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Tier by tier, lowest first; each tier's rooms (module prefixes). A module may import any module of a
# lower tier, and modules of its own room; never a higher tier, nor another room of its tier.
TIERS = (
    ("base", (("vapo_jax", "vapo_jax.distributed", "vapo_jax.errors", "vapo_jax.files", "vapo_jax.kinds",
               "vapo_jax.paths"),)),
    ("rl", (("vapo_jax.rl",),)),
    ("models", (("vapo_jax.models",),)),
    ("config", (("vapo_jax.config",),)),
    ("rollout, data, rewards", (("vapo_jax.rollout",), ("vapo_jax.data",), ("vapo_jax.rewards",))),
    ("train", (("vapo_jax.train",),)),
    ("memory", (("vapo_jax.memory",),)),
    ("roofline", (("vapo_jax.roofline",),)),
    ("experiments", (("experiments",),)),
    ("cli", (("vapo_jax.cli",),)),
)


def place(module: str) -> tuple[int, int]:
  """(tier, room) of a module: its longest matching prefix."""
  best, where = -1, None
  for tier, (_, rooms) in enumerate(TIERS):
    for room, prefixes in enumerate(rooms):
      for prefix in prefixes:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
          best, where = len(prefix), (tier, room)
  if where is None:
    raise AssertionError(f"{module} is in no tier of TIERS: add it")
  return where


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
  """The modules of `modules` that the source at `path` (module `name`) imports, anywhere in it.
  `from package import x` imports module package.x when there is one, else the package itself."""
  found = set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # Relative: up `level - 1` packages from this module's own.
        parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
  return {m for m in found if m in modules and m != name}


def module_graph() -> dict[str, set[str]]:
  """Every module of vapo_jax/ and experiments/ → the modules of the two that it imports."""
  paths = {}
  for path in [*(ROOT / "vapo_jax").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def violations(graph: dict[str, set[str]]) -> list[str]:
  """Every import that goes up a tier or across the rooms of one."""
  bad = []
  for module, imported in sorted(graph.items()):
    (tier, room) = place(module)
    for other in sorted(imported):
      other_tier, other_room = place(other)
      if other_tier > tier or (other_tier == tier and other_room != room):
        bad.append(f"{module} ({TIERS[tier][0]}) imports {other} ({TIERS[other_tier][0]})")
  return bad


def test_imports_flow_down_the_tiers():
  graph = module_graph()
  assert {"vapo_jax.train.trainer", "vapo_jax.memory.verdict", "vapo_jax.cli.train",
          "experiments.toy"} <= graph.keys()
  assert "vapo_jax.rl.losses" in graph["vapo_jax.train.algorithm"]  # The graph is real.
  assert "vapo_jax.memory.verdict" in graph["vapo_jax.cli.preflight"]  # The start-up memory check.
  assert violations(graph) == []


def test_a_lower_tier_importing_a_higher_one_is_caught(tmp_path):
  bad = tmp_path / "bad.py"  # As if it were vapo_jax/rl/bad.py: the pure math reaching up, inside a function.
  bad.write_text("import jax\n\ndef f():\n  from vapo_jax.train import trainer\n  import experiments\n")
  graph = module_graph()
  graph["vapo_jax.rl.bad"] = _imports(bad, "vapo_jax.rl.bad", set(graph))
  assert violations(graph) == ["vapo_jax.rl.bad (rl) imports experiments (experiments)",
                               "vapo_jax.rl.bad (rl) imports vapo_jax.train.trainer (train)"]
  graph = module_graph()  # Across the rooms of one tier: the rollout reading problem files.
  graph["vapo_jax.rollout.common"].add("vapo_jax.data.records")
  assert violations(graph) == ["vapo_jax.rollout.common (rollout, data, rewards) imports vapo_jax.data.records "
                               "(rollout, data, rewards)"]
  graph = module_graph()  # The run reaching up to the memory reports.
  graph["vapo_jax.train.trainer"].add("vapo_jax.memory.verdict")
  assert violations(graph) == ["vapo_jax.train.trainer (train) imports vapo_jax.memory.verdict (memory)"]


def test_every_module_is_in_a_tier():
  for module in module_graph():
    place(module)


# One fresh process imports `preload`, then forks a child per module, which imports it and prints the modules
# loaded: JAX (which loads neither flax nor the config) is imported once, not once per module.
FORK_EACH = """import os, sys
for module in sys.argv[1:]:
  if (pid := os.fork()) == 0:
    __import__(module)
    print(" ".join(sorted(sys.modules)), flush=True)
    os._exit(0)
  assert os.waitpid(pid, 0)[1] == 0, module
"""


def _loaded_after(modules: tuple[str, ...], preload: str = "") -> dict[str, set[str]]:
  """{module: the modules loaded once it is imported} in a fresh interpreter that imported `preload`."""
  code = (f"import {preload}\n" if preload else "") + FORK_EACH
  out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, check=True,
                       cwd=ROOT).stdout
  lines = out.splitlines()
  assert len(lines) == len(modules), out
  return {module: set(line.split()) for module, line in zip(modules, lines)}


def test_config_and_the_cli_resolution_load_no_jax():
  for module, loaded in _loaded_after(("vapo_jax.config", "vapo_jax.cli.resolve")).items():
    assert "jax" not in loaded and "flax" not in loaded, module


def test_pure_math_loads_no_flax_and_no_config():
  modules = ("vapo_jax.rl.advantages", "vapo_jax.rl.losses", "vapo_jax.rl.masked")
  for module, loaded in _loaded_after(modules, preload="jax").items():
    assert "jax" in loaded and "flax" not in loaded and "vapo_jax.config" not in loaded, module


def test_no_import_cycle():
  graph = module_graph()
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
