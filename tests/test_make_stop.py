"""A stop through `make train`: SIGTERM to the process group of a real `make train` whose output goes to a pipe that
closes with make (as `make train | tee log` under a scheduler) saves the checkpoint, and the resume continues from
the step the run stopped at."""

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time

import pytest

from smoke_runs import ROOT, TINY_ARGS
from vapo_jax.cli import resolve
from vapo_jax.train import checkpoints

# The smoke run, a checkpoint only when stopped (none periodic): the resume can only start from the stop's save.
ARGS = [a for a in TINY_ARGS if a not in ("--exp", "tiny")] + ["checkpoint.every_steps=0", "rl_steps=12"]


def _env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT)
  env.pop("PYTEST_CURRENT_TEST", None)
  return env


def _records(run_dir) -> list[str]:
  path = os.path.join(run_dir, "resume", "metrics.jsonl")
  return open(path).read().splitlines() if os.path.exists(path) else []


def _trainers(run_dir) -> list[int]:
  """Pids of the trainer processes of `run_dir` (make's child, no longer ours once make is gone)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        line = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
      continue
    if "vapo_jax.cli.train" in line and f"run_dir={run_dir}" in line:
      found.append(int(pid))
  return found


@pytest.mark.slow  # A smoke run under make, stopped, then resumed: about a minute on 2 cores.
def test_sigterm_to_make_trains_group_saves_although_the_pipe_closes_and_the_resume_goes_on(tmp_path):
  run_dir = str(tmp_path)
  read, write = os.pipe()
  make = subprocess.Popen(["make", "-s", "train", "EXP=tiny", "ARGS=" + shlex.join(ARGS + [f"run_dir={run_dir}"])],
                          cwd=ROOT, env=_env(), stdout=write, stderr=write, start_new_session=True)
  os.close(write)
  deadline, seen = time.monotonic() + 600, b""
  while sum('"stage": "rl"' in r for r in _records(run_dir)) < 2:  # Two RL steps logged: the run is mid-stage.
    assert make.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
    if select.select([read], [], [], 0.2)[0]:
      seen += os.read(read, 65536)
  os.killpg(make.pid, signal.SIGTERM)  # The scheduler's stop, to the whole group: make, and Python under it.
  os.close(read)  # The reader goes with make (tee's end of the pipe): every later write of the run fails.
  make.wait(timeout=60)
  while _trainers(run_dir):  # The run finishes its step and saves on its own.
    assert time.monotonic() < deadline, "the trainer did not stop"
    time.sleep(0.2)
  found = checkpoints.RunCheckpoints(os.path.join(run_dir, "resume", "checkpoints"),
                                     resolve.resolve(["--exp", "tiny", *ARGS])[0].checkpoint)
  latest = found.latest_meta()
  found.close()
  assert latest is not None, "no checkpoint saved: " + seen.decode(errors="replace")[-2000:]
  progress = latest[1]["progress"]
  assert progress["stage"] == "rl" and progress["stage_step"] >= 2, progress
  resumed = subprocess.run([sys.executable, "-m", "vapo_jax.cli.train", "--exp", "tiny", *ARGS, f"run_dir={run_dir}"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  match = re.search(r"resumed from .*: stage (\w+), step (\d+)", resumed.stdout)
  assert match and match.groups() == ("rl", str(progress["stage_step"])), resumed.stdout[-3000:]
