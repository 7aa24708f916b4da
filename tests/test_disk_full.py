"""A full disk at any write is one line naming the directory and what to free, with exit status 2; no
partial file is left where a reader would take it for complete; the checkpoints and the resume stay
intact. ENOSPC is injected at the write call (the safetensors writer's file, Orbax's checkpoint
metadata, metrics.jsonl, a plot, make eval's results), in a run of the real entry point where the exit
status matters."""

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from multiprocess_launch import without_device_count
from vapo_jax import files
from vapo_jax.cli import preflight
from vapo_jax.errors import SetupError

REPO = Path(__file__).resolve().parents[1]
ENOSPC = "OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))"
# Each injection: (what it patches, its code). `after` writes succeed, then the disk is full.
INJECT = {
    "export": f"""
        from vapo_jax.models import safetensors_io
        class Full:
          def __init__(self, f): self.f = f
          def __enter__(self): return self
          def __exit__(self, *exc): self.f.close()
          def write(self, data):
            self.f.write(data[:len(data) // 2])  # Half of it lands: the file is partial.
            where = self.f.name
            raise {ENOSPC}
        safetensors_io.open = lambda path, mode: Full(open(path, mode))
        """,
    "checkpoint": f"""
        from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
        save, calls = handler.JsonCheckpointHandler._save_fn, []
        async def full_after(self, item, where):
          calls.append(where)
          if len(calls) > AFTER:
            raise {ENOSPC}
          return await save(self, item, where)
        handler.JsonCheckpointHandler._save_fn = full_after
        """,
}


def run_train(run_dir: Path, inject: str | None = None, after: int = 0) -> subprocess.CompletedProcess:
  """`make train EXP=tiny --smoke` with no training steps (start, the stage checkpoints, the export)."""
  args = ["--exp", "tiny", "--smoke", f"run_dir={run_dir}", "name=full", "sft.steps=0",
          "algo.value_pretrain_steps=0", "rl_steps=0", "eval.path=none"]
  script = "import errno, os, sys\n" + (textwrap.dedent(INJECT[inject]).replace("AFTER", str(after)) if inject else "")
  script += f"from vapo_jax.cli import train\nsys.exit(train.main({args!r}))\n"
  env = without_device_count(PYTHONPATH=str(REPO))  # One CPU device: less to compile.
  return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=str(REPO),
                        timeout=600)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
  return errors[0]


# make test-slow, for time (three runs of the entry point, 23 s): make test injects the full disk at the other writes
# in one process, and stops a save in a checkpoint directory that cannot be written (both below).
@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_save_and_at_the_export_then_a_resume(tmp_path):
  """A full disk at a checkpoint save, and at the final export, is one line naming the directory, with
  no stacked tracebacks and no `export/model.safetensors.tmp` left behind; the same command resumes."""
  run = tmp_path / "full"
  result = run_train(tmp_path, "checkpoint", after=1)  # The first stage checkpoint is saved, the second is not.
  line = _one_line_error(result)
  assert line.startswith(f"error: saving a checkpoint in {run}/checkpoints: the disk is full (")
  assert line.endswith("then run the same command again: it resumes from checkpoint 1, which is intact")
  assert sorted(os.listdir(run / "checkpoints")) == ["1"]  # The partial one is removed; the complete one stays.

  result = run_train(tmp_path, "export")
  line = _one_line_error(result)
  assert "resumed from" in result.stdout
  assert line.startswith(f"error: exporting the model in {run}/export: the disk is full (")
  assert os.listdir(run / "export") == []  # No partial safetensors, no config.json: nothing a reader would load.
  assert not (run / "summary.json").exists()

  result = run_train(tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(run / "export")) == ["config.json", "model.safetensors"]
  assert json.loads((run / "summary.json").read_text())["run_dir"] == str(run)


# ------------------------------------------------------------------------------- in one process
def _full_after(monkeypatch, module, name: str, writes: int = 0):
  """Makes `module.open` a file whose `name` calls raise ENOSPC after `writes` of them succeed."""
  real_open, count = open, [0]

  class Full:
    def __init__(self, f):
      self.f = f

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

    def __getattr__(self, attr):
      return getattr(self.f, attr)

    def write(self, data):
      count[0] += 1
      if count[0] > writes:
        self.f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
      return self.f.write(data)

  monkeypatch.setattr(module, name, lambda path, mode="r", *a, **k: Full(real_open(path, mode, *a, **k)),
                      raising=False)


def test_metrics_jsonl_on_a_full_disk_keeps_whole_lines(tmp_path, monkeypatch):
  from vapo_jax.train import metrics
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(0, "rl", {"a": 1.0})
  before = (tmp_path / "metrics.jsonl").read_bytes()
  _full_after(monkeypatch, metrics, "open")
  with pytest.raises(SetupError, match=rf"^writing the run's logs \(metrics.jsonl, tensorboard/\) in {tmp_path}: the "
                                       r"disk is full \(.* free there\). Free space on that disk"):
    writer.write(1, "rl", {"a": 2.0})
  assert (tmp_path / "metrics.jsonl").read_bytes() == before  # The partial line is cut off again.
  monkeypatch.undo()
  writer.close()


def test_summary_json_and_plots_on_a_full_disk(tmp_path, monkeypatch, capsys):
  from vapo_jax.cli import plots
  from vapo_jax.train import metrics
  writer = metrics.MetricsWriter(str(tmp_path))
  for step in range(3):
    writer.write(step, "rl", {"rollout/reward_mean": step / 3})
  writer.close()
  (tmp_path / "summary.json").write_text('{"seconds": 1}')
  _full_after(monkeypatch, files, "open")
  with pytest.raises(SetupError, match=rf"^writing summary.json in {tmp_path}: the disk is full"):
    writer.write_summary({"seconds": 2}, rerun=False)
  assert json.loads((tmp_path / "summary.json").read_text()) == {"seconds": 1}  # The old one, whole.
  assert plots.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: writing ") and f".png in {tmp_path}/plots: the disk is full" in err
  assert err.count("\n") == 1
  assert not (tmp_path / "plots").exists() or os.listdir(tmp_path / "plots") == []


def test_make_eval_results_on_a_full_disk(tmp_path, monkeypatch, capsys):
  from vapo_jax.cli import evaluate
  responses = tmp_path / "r.jsonl"
  responses.write_text(json.dumps({"id": "a", "response": "Answer: 2", "answer": 2}) + "\n")
  _full_after(monkeypatch, files, "open")
  assert evaluate.main(["--exp", "aime", "eval.path=none", "--responses", str(responses), "--out",
                        str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert re.fullmatch(rf"error: writing the evaluation's results in {tmp_path}/out: the disk is full \([\d.]+ [MG]iB "
                      r"free there\). Free space on that disk \(e.g. other runs' checkpoints/ and export/ "
                      r"directories\) or choose another --out=, then run make eval again\n", err), err
  assert os.listdir(tmp_path / "out") == []


def test_a_full_disk_at_start_leaves_no_probe_file(tmp_path, monkeypatch):
  """The run directory's write probe does not stay behind as `.write_probe.<pid>`."""
  _full_after(monkeypatch, preflight, "open")
  with pytest.raises(SetupError, match=r"cannot write to the run directory .*: the disk is full"):
    preflight.check_run_dir(str(tmp_path / "runs" / "exp"))
  assert os.listdir(tmp_path) == []


# A run directory that turns read-only mid-run, as root sees one (root writes through chmod): from the
# fourth write of metrics.jsonl on, every write, create, rename or delete under the run's directory is
# refused with EACCES, Python's and Orbax's alike (Orbax's array files come from tensorstore, which this
# cannot refuse: its JSON records and the commit of a checkpoint are refused).
READ_ONLY = """
    import builtins
    RUN, state = os.path.abspath(RUN_DIR), {"metrics": 0}
    def refuse(path, write=True):
      if write and state["metrics"] >= 4 and os.path.abspath(str(path)).startswith(RUN):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    real_open = builtins.open
    def guarded_open(path, mode="r", *args, **kwargs):
      if str(path).endswith("metrics.jsonl") and "a" in mode:
        state["metrics"] += 1
      refuse(path, any(c in mode for c in "wax+"))
      return real_open(path, mode, *args, **kwargs)
    builtins.open = guarded_open
    for name in ("unlink", "remove", "rename", "replace", "mkdir", "rmdir"):
      real = getattr(os, name)
      setattr(os, name, lambda path, *a, _real=real, **k: (refuse(path), _real(path, *a, **k))[1])
    """


@pytest.mark.slow  # make test-slow; make test covers both halves, see the docstring.
def test_a_run_directory_turning_read_only_mid_run_is_one_line_and_resumes(tmp_path):
  """Exit 2 and one line: no PermissionError traceback from metrics.jsonl, nor from run.lock on closing.
  In make test: a write failing mid-run is one line and resumes through the same reporting
  (`files.reporting_write_failures`) in `test_a_full_disk_at_a_checkpoint_save_and_at_the_export_then_a_resume`,
  and a read-only run directory is named in `test_user_errors.test_a_read_only_run_directory_is_refused`."""
  run = tmp_path / "full"
  args = ["--exp", "tiny", "--smoke", f"run_dir={tmp_path}", "name=full", "sft.steps=6", "algo.value_pretrain_steps=0",
          "rl_steps=0", "eval.path=none", "checkpoint.every_steps=1", "checkpoint.async_save=false"]
  # Synchronous saves: none is in flight when the directory turns read-only. (One in flight fails inside
  # Orbax, whose tensorstore writes then complete into a closed event loop and print "Event loop is
  # closed" tracebacks of their own after the one-line error.)
  env = without_device_count(PYTHONPATH=str(REPO))
  train = lambda inject: subprocess.run(
      [sys.executable, "-c",
       "import errno, os, sys\n" + inject + f"from vapo_jax.cli import train\nsys.exit(train.main({args!r}))"],
      capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
  result = train(textwrap.dedent(READ_ONLY).replace("RUN_DIR", repr(str(run))))
  line = _one_line_error(result)
  assert f"in {run}: cannot write {run}/metrics.jsonl (Permission denied). Make {run} writable" in line, line
  assert "ERROR:absl" not in result.stderr and "PermissionError" not in result.stderr, result.stderr[-3000:]
  assert (run / "checkpoints").is_dir() and os.listdir(run / "checkpoints")  # Its checkpoints stay.
  result = train("")  # Writable again: the same command resumes.
  assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-3000:]


# The run's checkpoint directory turning read-only while an asynchronous save is in flight: from the fourth write
# of metrics.jsonl on, Orbax's background threads (not the run's own) are refused every write under checkpoints/;
# the time of the first refusal is written to REFUSED_AT.
READ_ONLY_IN_FLIGHT = """
    import builtins, threading, time
    CHECKPOINTS, state = os.path.join(os.path.abspath(RUN_DIR), "checkpoints"), {"metrics": 0}
    def refuse(path, write=True):
      if (write and state["metrics"] >= 4 and threading.current_thread() is not threading.main_thread()
          and os.path.abspath(str(path)).startswith(CHECKPOINTS)):
        if not os.path.exists(REFUSED_AT):
          with real_open(REFUSED_AT, "w") as f:
            f.write(str(time.time()))
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    real_open = builtins.open
    def guarded_open(path, mode="r", *args, **kwargs):
      if str(path).endswith("metrics.jsonl") and "a" in mode:
        state["metrics"] += 1
      refuse(path, any(c in mode for c in "wax+"))
      return real_open(path, mode, *args, **kwargs)
    builtins.open = guarded_open
    for name in ("unlink", "remove", "rename", "replace", "mkdir", "rmdir"):
      real = getattr(os, name)
      setattr(os, name, lambda path, *a, _real=real, **k: (refuse(path), _real(path, *a, **k))[1])
    """


# make test-slow (a minute); make test: test_a_checkpoint_directory_that_cannot_be_written_stops_a_save.
@pytest.mark.slow
def test_a_failed_asynchronous_save_stops_the_run_at_once_in_one_line(tmp_path):
  """An asynchronous save whose writes are refused ends the run within 30 s of the first refusal: exit 2, one
  line naming the directory, no traceback (Orbax's threads, tensorstore's closed event loop, un-awaited
  coroutines: silenced); the complete checkpoints stay and the same command resumes."""
  import time

  run, refused = tmp_path / "full", tmp_path / "refused_at"
  args = ["--exp", "tiny", "--smoke", f"run_dir={tmp_path}", "name=full", "sft.steps=8", "algo.value_pretrain_steps=0",
          "rl_steps=0", "eval.path=none", "checkpoint.every_steps=1", "checkpoint.async_save=true"]
  env = without_device_count(PYTHONPATH=str(REPO))
  train = lambda inject: subprocess.run(
      [sys.executable, "-c",
       "import errno, os, sys\n" + inject + f"from vapo_jax.cli import train\nsys.exit(train.main({args!r}))"],
      capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
  inject = textwrap.dedent(READ_ONLY_IN_FLIGHT).replace("RUN_DIR", repr(str(run))).replace(
      "REFUSED_AT", repr(str(refused)))
  result = train(inject)
  ended = time.time()
  line = _one_line_error(result)
  assert f"saving a checkpoint in {run}/checkpoints: cannot write" in line and "Permission denied" in line, line
  assert "Traceback" not in result.stderr and "never awaited" not in result.stderr, result.stderr[-3000:]
  assert ended - float(refused.read_text()) < 30
  assert [n for n in os.listdir(run / "checkpoints") if n.isdigit()]  # The complete checkpoints stay.
  result = train("")  # Writable again: the same command resumes.
  assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-3000:]


def test_a_checkpoint_directory_that_cannot_be_written_stops_a_save(tmp_path, monkeypatch):
  """Before each save the directory is probed: one that refuses a file is one line at once, and no background
  save starts writing into it."""
  import builtins

  from vapo_jax.config import CheckpointConfig
  from vapo_jax.train import checkpoints

  found = checkpoints.RunCheckpoints(str(tmp_path / "checkpoints"), CheckpointConfig(async_save=True))
  monkeypatch.setattr(found.manager, "save", lambda *a, **k: pytest.fail("a save started into an unwritable directory"))
  real_open = builtins.open

  def refuse(path, mode="r", *args, **kwargs):
    if ".write_probe" in str(path):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    return real_open(path, mode, *args, **kwargs)
  monkeypatch.setattr(builtins, "open", refuse)
  with pytest.raises(SetupError, match=r"saving a checkpoint in .*checkpoints: cannot write .*\.write_probe\.\d+ "
                                       r"\(Permission denied\)"):
    found.save(1, {"x": np.zeros(3)}, {"progress": {}})
  monkeypatch.setattr(builtins, "open", real_open)
  found.close()
