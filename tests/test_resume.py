"""Checkpoints and resume: a run stopped by SIGTERM or SIGKILL continues exactly where it was.

The end-to-end tests run `python -m vapo_jax.cli.train` (the `make train` entry point) on a one-layer
model in subprocesses, as a preempted pod would: stop it, start it again, compare metrics.jsonl
with an uninterrupted run of the same seed.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoke_runs import ROOT, TINY_ARGS, VARYING
from vapo_jax.cli import resolve
from vapo_jax.errors import ConfigError
from vapo_jax.models import sharding
from vapo_jax.train import checkpoints


def _env(devices: int = 2) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=ROOT)
  env.pop("PYTEST_CURRENT_TEST", None)
  return env


def _start(run_dir, *extra):
  return subprocess.Popen([sys.executable, "-m", "vapo_jax.cli.train", *TINY_ARGS, f"run_dir={run_dir}", *extra],
                          cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir) -> list[dict]:
  path = os.path.join(run_dir, "resume", "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().splitlines()
  return [json.loads(line) for line in lines if line.endswith("}")]


def _stop_after(proc, run_dir, predicate, sig, timeout_s=300):
  """Sends `sig` once metrics.jsonl satisfies `predicate`; returns the exit code and output."""
  deadline = time.monotonic() + timeout_s
  while proc.poll() is None and not predicate(_records(run_dir)):
    if time.monotonic() > deadline:
      proc.kill()
      raise AssertionError(f"time-out waiting; output:\n{proc.communicate()[0][-3000:]}")
    time.sleep(0.05)
  if proc.poll() is None:
    proc.send_signal(sig)
  output = proc.communicate(timeout=timeout_s)[0]
  return proc.returncode, output


def _comparable(records):
  return [{k: v for k, v in r.items() if not k.startswith(VARYING)} for r in records]


@pytest.mark.slow  # make test-slow, for time (test_sweep's SIGTERM test stops a run the same way in make test).
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, checkpoints.PREEMPTED_EXIT_CODE),
                                      (signal.SIGINT, checkpoints.INTERRUPTED_EXIT_CODE)])
def test_a_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, sig, code):
  proc = _start(tmp_path)
  if sig == signal.SIGTERM:  # While the run holds its directory, the same command again is refused.
    while not _records(tmp_path) and proc.poll() is None:
      time.sleep(0.05)
    second = subprocess.run([sys.executable, "-m", "vapo_jax.cli.train", *TINY_ARGS, f"run_dir={tmp_path}"], cwd=ROOT,
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and "run.lock" in second.stderr and f"pid {proc.pid}" in second.stderr, second.stderr
  returncode, output = _stop_after(proc, tmp_path, lambda r: len(r) >= 1, sig)
  assert returncode == code, output[-3000:]
  assert f"stopped by {'SIGTERM' if sig == signal.SIGTERM else 'Ctrl-C'}" in output, output[-3000:]
  assert "Run the same command again" in output and "Traceback" not in output, output[-3000:]
  found = checkpoints.RunCheckpoints(str(tmp_path / "resume" / "checkpoints"), resolve.resolve(TINY_ARGS)[0].checkpoint)
  step, meta = found.latest_meta()
  # Saved at a step boundary after the first record (the second start's refusal may let the warm start end first).
  assert meta["progress"]["global_step"] >= 1 and meta["progress"]["stage"] in ("sft", "value_pretrain", "rl"), \
      meta["progress"]
  assert meta["metrics_bytes"] == os.path.getsize(tmp_path / "resume" / "metrics.jsonl")
  found.close()
  if sig == signal.SIGINT:
    return
  # Resuming with a different config is refused before any model is built, naming the fields.
  changed, _ = resolve.resolve(TINY_ARGS + [f"run_dir={tmp_path}", "algo.eps_high=0.3", "rl_steps=6"])
  with pytest.raises(ConfigError, match=r"(?s)algo\.eps_high: 0\.28 → 0\.3.*rl_steps: 5 → 6"):
    from vapo_jax.train.trainer import Trainer
    Trainer(changed, verbose=False)


@pytest.mark.slow  # Four runs of the default experiment at one-layer size: ~3 min on 2 cores.
def test_sigkill_and_resume_gives_the_uninterrupted_metrics(tmp_path):
  reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
  proc = _start(reference_dir)
  assert proc.wait(timeout=600) == 0, proc.communicate()[0][-3000:]
  reference = _records(reference_dir)
  stages = [r["stage"] for r in reference]
  assert stages.count("rl") == 5 and stages.count("value_pretrain") == 3
  # Kill at a random record of value pretraining, then at a random record of RL past the data's
  # first epoch boundary (20 prompts, 8 per step: RL steps 1-4 straddle one).
  rng = random.Random(0)
  first_vp, first_rl = stages.index("value_pretrain"), stages.index("rl")
  for kill_after in (rng.randrange(first_vp + 1, first_rl + 1), rng.randrange(first_rl + 2, len(stages))):
    proc = _start(resumed_dir)
    code, output = _stop_after(proc, resumed_dir, lambda r, n=kill_after: len(r) >= n, signal.SIGKILL)
    assert code == -signal.SIGKILL, (code, output[-3000:])
  proc = _start(resumed_dir)
  output = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, output[-3000:]
  assert "resumed from" in output
  assert _comparable(_records(resumed_dir)) == _comparable(reference)
  for name in ("summary.json",):
    a = json.loads((reference_dir / "resume" / name).read_text())
    b = json.loads((resumed_dir / "resume" / name).read_text())
    assert a["accuracy_after_rl"] == b["accuracy_after_rl"] and a["accuracy_before_rl"] == b["accuracy_before_rl"]


def _small_state(mesh):
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  return {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), spec), "b": jnp.ones(3)}


def test_a_truncated_checkpoint_is_skipped_with_a_warning(tmp_path):
  mesh = sharding.make_mesh(data=8, fsdp=1, tensor=1)
  config = resolve.resolve(["--exp", "tiny", "checkpoint.async_save=false"])[0].checkpoint
  found = checkpoints.RunCheckpoints(str(tmp_path), config)
  state = _small_state(mesh)
  found.save(1, state, {"stage": "rl", "n": 1}, wait=True)
  found.save(2, jax.tree.map(lambda x: x + 1, state), {"stage": "rl", "n": 2}, wait=True)
  # Step 2 loses its array files (a disk filled up, a copy cut short); a temporary directory of
  # an interrupted save is never listed at all.
  array_dir = tmp_path / "2" / "state"
  for path in sorted(array_dir.rglob("*"), reverse=True):
    if path.is_file() and not path.name.startswith("_"):
      path.unlink()
  (tmp_path / "3.orbax-checkpoint-tmp-1234").mkdir()
  found.close()
  found = checkpoints.RunCheckpoints(str(tmp_path), config)
  with pytest.warns(UserWarning, match=r"checkpoint .*/2 is incomplete or unreadable.*skipping it"):
    step, restored, meta = found.restore_latest(lambda meta: checkpoints.abstract(state))
  assert step == 1 and meta["n"] == 1
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert restored["w"].sharding == state["w"].sharding
  found.close()


def test_config_differences_name_each_changed_field():
  base, _ = resolve.resolve(["--exp", "tiny"])
  changed, _ = resolve.resolve(["--exp", "tiny", "algo.eps_high=0.3", "checkpoint.keep=7", "data.seed=4"])
  import dataclasses
  diffs = checkpoints.config_differences(dataclasses.asdict(base), changed)
  assert diffs == ["algo.eps_high: 0.28 → 0.3", "data.seed: 0 → 4"]  # checkpoint.* may change.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    checkpoints.check_resumable(base, dataclasses.asdict(base), "somewhere")


def test_saving_after_skipping_an_unreadable_checkpoint_continues_the_numbering(tmp_path):
  # Restoring step 1 because step 2 is unreadable must not make the next save collide with 2.
  mesh = sharding.make_mesh(data=8, fsdp=1, tensor=1)
  config = resolve.resolve(["--exp", "tiny", "checkpoint.async_save=false"])[0].checkpoint
  found = checkpoints.RunCheckpoints(str(tmp_path), config)
  state = _small_state(mesh)
  found.save(1, state, {"n": 1}, wait=True)
  found.save(2, state, {"n": 2}, wait=True)
  (tmp_path / "2" / "meta" / "metadata").unlink()
  found.close()
  found = checkpoints.RunCheckpoints(str(tmp_path), config)
  with pytest.warns(UserWarning, match="skipping it"):
    step, _, meta = found.restore_latest(lambda meta: checkpoints.abstract(state))
  assert (step, meta["n"]) == (1, 1)
  found.save(max(found.steps()) + 1, state, {"n": 3}, wait=True)  # What Trainer does.
  assert found.steps()[-1] == 3
  found.close()


PARTIAL = ("rollout.decode_budget=8", "rollout.max_staleness=1", "algo.tis_cap=2")  # Smoke responses: ≤ 16 tokens.


@pytest.mark.slow  # Three runs of the default experiment at one-layer size: ~2 min on 2 cores.
def test_sigkill_with_carried_sequences_and_resume_trains_the_same_tokens(tmp_path):
  """Partial rollouts: killed after an RL step that carried sequences over, the resumed run continues them from
  the checkpoint and logs what the uninterrupted run logs (the trained tokens' lengths, rewards, losses)."""
  reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
  proc = _start(reference_dir, *PARTIAL)
  assert proc.wait(timeout=600) == 0, proc.communicate()[0][-3000:]
  reference = _records(reference_dir)
  rl = [i for i, r in enumerate(reference) if r["stage"] == "rl"]
  carried = [i for i in rl[:-1] if reference[i]["rollout/carried_sequences"] > 0]
  assert carried and any(reference[i]["rollout/stale_token_frac"] > 0 for i in rl), [reference[i] for i in rl]
  proc = _start(resumed_dir, *PARTIAL)
  code, output = _stop_after(proc, resumed_dir, lambda r, n=carried[0] + 1: len(r) >= n, signal.SIGKILL)
  assert code == -signal.SIGKILL, (code, output[-3000:])
  proc = _start(resumed_dir, *PARTIAL)
  output = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0 and "resumed from" in output, output[-3000:]
  assert _comparable(_records(resumed_dir)) == _comparable(reference)
  carried = []  # The sequences in flight at the end, token by token, are the uninterrupted run's.
  for directory in (reference_dir, resumed_dir):
    found = checkpoints.RunCheckpoints(str(directory / "resume" / "checkpoints"),
                                       resolve.resolve(TINY_ARGS)[0].checkpoint)
    carried.append(found.latest_meta()[1]["progress"]["carry"])
    found.close()
  assert carried[0] == carried[1] and carried[0]["groups"], carried[0]
