"""The one-command GPU check (`benchmarks/gpu_check.py`) where no GPU is: one line and exit 1; it imports only the
packages a lent GPU machine has; its kernel section passes with the kernels in the Pallas interpreter; its MFU's
FLOP count against a hand count."""

import dataclasses
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check
from vapo_jax.models import pallas_gpu, sharding
from vapo_jax.models.config import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A GPU machine's Python has jax, flax, optax, orbax-checkpoint, transformers, numpy and pytest, nothing else.
BLOCKER = """
import importlib.abc, sys
ALLOWED_EXTRA = {"math_verify", "pyarrow", "tensorboardX", "wandb", "matplotlib", "jinja2", "hypothesis", "sympy",
                 "latex2sympy2_extended", "antlr4", "ruff", "datasets", "torch"}
class Blocker(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in ALLOWED_EXTRA:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
"""


def test_without_a_gpu_it_says_so_in_one_line_and_exits_1():
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("JAX_PLATFORMS", None)
  done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check: no GPU"), done.stderr


def test_every_section_imports_only_what_a_gpu_machine_has():
  imports = ("benchmarks.gpu_check", "benchmarks.packing_bench", "benchmarks.rollout_bench", "vapo_jax.cli.memory",
             "vapo_jax.memory.verdict", "vapo_jax.memory.xla_report", "vapo_jax.rollout")
  code = BLOCKER + "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in imports)
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT,
                                                                         JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]


def test_model_flops_against_a_hand_count():
  cfg = dataclasses.replace(preset("tiny"), num_layers=1, hidden_size=4, intermediate_size=6, num_heads=2,
                            num_kv_heads=1, head_dim=2, vocab_size=10)
  # One sequence of 1 prompt + 2 response tokens: 3 tokens. Per layer and token: q 4·2·2 = 16, k and v 4·1·2 each =
  # 16, o 16, MLP 3·4·6 = 72: 120 weights, 240 FLOPs; 3 tokens: 720. Attention: 2 matmuls × 2 FLOPs × 2 heads × 2
  # dims × (1 + 2 + 3) pairs = 96. Head: 2 · 4 · 10 · 3 = 240. Update: 4 × (2 models × (720 + 96) + 240) = 7,488.
  assert gpu_check.model_flops(cfg, 1, [2]) == 7488


@pytest.mark.slow  # For time (9 s): make test runs the Pallas GPU kernels interpreted in test_pallas_gpu.py.
def test_the_kernel_section_passes_with_the_kernels_interpreted(monkeypatch):
  monkeypatch.setattr(sharding, "platform", lambda: "gpu")
  with pallas_gpu.interpret():
    lines = gpu_check.kernels()
  assert len(lines) == 5 and all(line.endswith("(ok)") for line in lines), lines
