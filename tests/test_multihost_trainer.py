"""Multi-host training on one machine: 2 processes × 4 CPU devices (localhost coordinator, gloo
collectives) run a few steps of the default experiment and match one process with 8 devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from multiprocess_launch import launch
from smoke_runs import ROOT, TINY_ARGS, VARYING

ARGS = [a for a in TINY_ARGS if not a.startswith(("mesh.", "checkpoint.", "rl_steps", "eval.every"))]
ARGS += ["mesh.data=8", "rl_steps=3", "eval.every_steps=0", "checkpoint.every_steps=2"]


def _metrics(run_dir) -> list[dict]:
  with open(os.path.join(run_dir, "resume", "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow  # Three processes each compile the run: ~2-3 min on 2 cores.
def test_two_processes_match_one_process_with_eight_devices(tmp_path):
  single = subprocess.run([sys.executable, "-m", "vapo_jax.cli.train", *ARGS, f"run_dir={tmp_path / 'single'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                                   XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
  results = launch("vapo_jax.cli.train", [*ARGS, f"run_dir={tmp_path / 'multi'}"], num_processes=2,
                   devices_per_process=4, timeout_s=400, cwd=ROOT, env={"PYTHONPATH": ROOT})
  assert "held-out accuracy after RL" in results[0].stdout
  assert "held-out accuracy" not in results[1].stdout  # Only process 0 reports and writes.
  reference, multi = _metrics(tmp_path / "single"), _metrics(tmp_path / "multi")
  assert [(r["stage"], r["step"]) for r in multi] == [(r["stage"], r["step"]) for r in reference]
  for a, b in zip(reference, multi):
    keys = sorted(k for k in a if not k.startswith(VARYING) and k not in ("stage", "step"))
    assert keys == sorted(k for k in b if not k.startswith(VARYING) and k not in ("stage", "step"))
    np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=1e-5, atol=1e-5,
                               err_msg=f"{a['stage']} step {a['step']}: {keys}")
  # Both processes took part in the checkpoints (Orbax multi-process) and the export.
  assert os.listdir(tmp_path / "multi" / "resume" / "checkpoints")
  assert os.path.exists(tmp_path / "multi" / "resume" / "export" / "model.safetensors")
