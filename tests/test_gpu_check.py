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
             "vapo_jax.memory.verdict", "vapo_jax.memory.xla_report", "vapo_jax.rollout", "vapo_jax.train.trainer",
             "experiments")
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


def test_the_rl_step_flops_add_the_rollouts_forward_to_the_updates():
  cfg = dataclasses.replace(preset("tiny"), num_layers=1, hidden_size=4, intermediate_size=6, num_heads=2,
                            num_kv_heads=1, head_dim=2, vocab_size=10)
  # The update's 7,488 (above), and the rollout's forward: linear 720 + attention 96 + the head on the 2 sampled
  # tokens 2 · 4 · 10 · 2 = 160.
  assert gpu_check.step_flops(cfg, 1, [2]) == 7488 + 976


def test_without_pyarrow_and_jinja2_the_rl_step_trains_on_math_500_with_plain_prompts(tmp_path):
  from vapo_jax.data import problems, tokenizer

  config, notes = gpu_check.rl_step_config(False, 8, str(tmp_path), installed=lambda name: False)
  assert config.data.train_path.endswith("math500/test.jsonl") and not config.data.chat_template
  assert len(notes) == 2 and config.model.random_init and config.eval.path is None
  assert (config.rollout.prompts_per_step, config.rollout.max_response_tokens) == (64, 4096)  # The experiment's.
  rows = problems.training_problems(config, tokenizer.load(config.model.tokenizer))
  assert len(rows) == 500
  full, _ = gpu_check.rl_step_config(True, 1, str(tmp_path), installed=lambda name: True)
  assert full.data.train_path.endswith("train.parquet") and full.data.chat_template
  assert (full.rollout.tensor_parallel, full.rollout.max_response_tokens) == (1, 512)


@pytest.mark.slow  # For time (40 s): make test runs `math` through the trainer in its rehearsal (test_rehearsal.py).
def test_the_rl_step_section_runs_math_shrunk_on_the_cpu_devices():
  """Section 5's code on the 8 CPU devices, `math` shrunk by the rehearsal (experiments/smoke.py): two steps
  through the trainer, their seconds and the step's FLOPs."""
  from experiments import smoke
  lines = gpu_check.rl_step(True, shrink=smoke.smoke)
  assert len(lines) == 3 and lines[2].endswith("MFU n/a (chip not in PEAK_BF16) over 8 x cpu"), lines
  assert lines[0].startswith("  math (micro, 1 layer, random weights, float32): 8 prompts x 4 samples"), lines
  # 32 responses of 16 tokens (random weights run to the cap) after the prompts: the step's FLOPs at those lengths.
  assert "32 responses of 16 tokens on average (100% at the cap)" in lines[2], lines
