"""Stopping and resuming: Ctrl-C stops like SIGTERM (exit 130, a second Ctrl-C aborts), and a run
directory spelled relative or absolute is the same run."""

import dataclasses
import os
import signal

import pytest

from vapo_jax.config import DataConfig, ExperimentConfig
from vapo_jax.errors import ConfigError
from vapo_jax.train import checkpoints


@pytest.fixture
def flag():
  flag = checkpoints.PreemptionFlag()
  flag.install()
  yield flag
  flag.uninstall()


def test_ctrl_c_stops_after_the_step_and_a_second_one_aborts(flag, capfd):
  """Ctrl-C sets a flag the run reads after its step, rather than raising KeyboardInterrupt wherever the
  run is (a traceback inside Orbax)."""
  os.kill(os.getpid(), signal.SIGINT)  # Handled here, in the main thread, before kill returns.
  assert flag.event.is_set() and flag.is_set()
  assert flag.signum == signal.SIGINT and flag.exit_code == checkpoints.INTERRUPTED_EXIT_CODE == 130
  assert flag.signal_name == "Ctrl-C (SIGINT)"
  assert "Ctrl-C (SIGINT) received: finishing the current step" in capfd.readouterr().err
  with pytest.raises(KeyboardInterrupt):
    os.kill(os.getpid(), signal.SIGINT)
  assert "second Ctrl-C: aborting now" in capfd.readouterr().err


def test_sigterm_still_means_preempted(flag):
  os.kill(os.getpid(), signal.SIGTERM)
  os.kill(os.getpid(), signal.SIGTERM)  # A scheduler repeating itself: still just stopping.
  assert flag.is_set() and flag.signum == signal.SIGTERM and flag.exit_code == checkpoints.PREEMPTED_EXIT_CODE
  assert flag.signal_name == "SIGTERM"
  with pytest.raises(KeyboardInterrupt):  # Ctrl-C after a SIGTERM: abort at once.
    os.kill(os.getpid(), signal.SIGINT)


def test_uninstall_restores_the_handlers():
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  flag = checkpoints.PreemptionFlag()
  flag.install()
  assert signal.getsignal(signal.SIGINT) == flag._handle
  flag.uninstall()
  assert {s: signal.getsignal(s) for s in before} == before
  error = checkpoints.Preempted("stopped", exit_code=flag.exit_code)
  assert error.exit_code == 75 and checkpoints.Preempted("x").exit_code == 75


def test_the_same_run_directory_spelled_two_ways_resumes(tmp_path, monkeypatch):
  """`run_dir=runs` then `run_dir=$PWD/runs` resume: the two spellings are not a changed config, nor is the run
  directory moved to another parent; another training file is."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()
  (tmp_path / "train.jsonl").write_text("")
  os.symlink(tmp_path / "train.jsonl", tmp_path / "link.jsonl")
  saved = dataclasses.asdict(ExperimentConfig(name="x", run_dir="runs", data=DataConfig(train_path="train.jsonl")))
  for run_dir, train_path in [(str(tmp_path / "runs"), str(tmp_path / "train.jsonl")), ("./runs/", "link.jsonl")]:
    now = ExperimentConfig(name="x", run_dir=run_dir, data=DataConfig(train_path=train_path))
    assert checkpoints.config_differences(saved, now) == []
    checkpoints.check_resumable(now, saved, "runs/x/checkpoints")
  # A run directory moved (or copied) under another parent is the same run: its checkpoints are where it is now.
  moved = ExperimentConfig(name="x", run_dir=str(tmp_path / "other"), data=DataConfig(train_path="train.jsonl"))
  assert checkpoints.config_differences(saved, moved) == []
  checkpoints.check_resumable(moved, saved, "other/x/checkpoints")
  changed = ExperimentConfig(name="x", run_dir="runs", data=DataConfig(train_path="other.jsonl"))
  assert checkpoints.config_differences(saved, changed) == ["data.train_path: 'train.jsonl' → 'other.jsonl'"]
  with pytest.raises(ConfigError, match="refusing to resume"):
    checkpoints.check_resumable(changed, saved, "runs/x/checkpoints")
  assert not checkpoints.same_path(None, "runs") and checkpoints.same_path("bytes", "bytes")


@pytest.mark.parametrize("stage", ["value_pretrain", "rl", "done"])
def test_a_signal_during_a_stage_is_honoured_on_entering_the_next_one_the_last_included(stage):
  """A SIGTERM during the final export stops the run with the exit status it prints (75)."""
  import types

  from vapo_jax.train.trainer import Trainer
  saved, flag = [], checkpoints.PreemptionFlag()
  flag.event.set()
  flag.signum = signal.SIGTERM
  trainer = types.SimpleNamespace(progress=types.SimpleNamespace(enter=lambda s: None), preemption=flag,
                                  config=types.SimpleNamespace(checkpoint=types.SimpleNamespace(every_steps=5)),
                                  save=lambda wait=False: saved.append(wait), checkpoints=None)
  trainer._save_or_stop = lambda *args, **kwargs: Trainer._save_or_stop(trainer, *args, **kwargs)
  with pytest.raises(checkpoints.Preempted, match=f"on entering {stage}; checkpoint saved") as stopped:
    Trainer._enter(trainer, stage)
  assert stopped.value.exit_code == checkpoints.PREEMPTED_EXIT_CODE and saved == [False]


def test_a_changed_config_is_warned_about_once(recwarn):
  """`checkpoint.allow_config_change=true`: the start and the restore both check the saved config; one warning."""
  import dataclasses as dc

  from vapo_jax.config import ExperimentConfig
  from vapo_jax.train import checkpoints as ck

  saved = ExperimentConfig(name="x")
  now = dc.replace(saved, seed=5, checkpoint=dc.replace(saved.checkpoint, allow_config_change=True))
  for _ in range(2):
    ck.check_resumable(now, dc.asdict(saved), "/runs/x/checkpoints")
  changed = [w for w in recwarn if "resuming with a changed config" in str(w.message)]
  assert len(changed) == 1 and "seed: 0 → 5" in str(changed[0].message)


# SIGTERM in make test-slow, for time (5 s): the same handler; make test sends SIGTERM during training elsewhere.
@pytest.mark.parametrize("sig,code,name", [(signal.SIGINT, 130, "Ctrl-C (SIGINT)"),
                                           pytest.param(signal.SIGTERM, 143, "SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_during_start_up_says_what_is_true_and_leaves_no_run_directory(tmp_path, sig, code, name):
  """Before the first step nothing is trained or saved: one line says so (no "second Ctrl-C", no checkpoint
  claimed), the exit status is the signal's, and the run directory made for the run is gone."""
  import subprocess
  import sys

  from smoke_runs import ROOT
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("PYTEST_CURRENT_TEST", None)
  proc = subprocess.Popen([sys.executable, "-m", "vapo_jax.cli.train", "--exp", "tiny", "--smoke",
                           f"run_dir={tmp_path / 'runs'}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline().startswith("memory: not checked")  # The start-up check: before the trainer.
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == code, err[-2000:]
  assert err.strip().splitlines()[-1] == (f"stopped by {name} during start-up, before any step: nothing was trained "
                                          "or saved. Run the same command again to start."), err[-2000:]
  assert not (tmp_path / "runs").exists()
