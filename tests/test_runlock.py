"""The run-directory lock: a second start is refused naming the holder; a killed holder's lock is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vapo_jax.train.runlock import LOCK_FILE, RunLock, RunLockError

REPO = str(Path(__file__).resolve().parents[1])
# A start in another process: imports only vapo_jax.train.runlock (no JAX), holds the lock, then waits.
HOLD = """
import sys
from vapo_jax.train.runlock import RunLock, RunLockError
try:
  lock = RunLock(sys.argv[1]).acquire()
except RunLockError as e:
  print(e, flush=True)
  sys.exit(2)
print("held", flush=True)
sys.stdin.readline()
"""


def _start(run_dir):
  return subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": REPO})


def test_a_second_start_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path):
  run_dir = tmp_path / "runs" / "exp"
  holder = _start(run_dir)
  try:
    assert holder.stdout.readline() == "held\n"
    record = json.loads((run_dir / LOCK_FILE).read_text())  # The holder's record.
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    second = _start(run_dir)  # The same command started again.
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 2
    assert f"{run_dir} is in use by another run: pid {holder.pid} on {socket.gethostname()} (since " in out
    assert f"holds {run_dir / LOCK_FILE}. Wait for it to finish or stop it" in out
    with pytest.raises(RunLockError, match=f"pid {holder.pid} on "):
      RunLock(str(run_dir)).acquire()  # In this process as well.
  finally:
    holder.send_signal(signal.SIGKILL)  # A crash: the kernel drops the flock, the file stays.
    holder.wait(timeout=60)
  assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid
  with pytest.warns(UserWarning, match=rf"took over the lock left by pid {holder.pid} on .*no longer holds it"):
    lock = RunLock(str(run_dir)).acquire()
  assert lock.took_over["pid"] == holder.pid
  assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
  lock.release()
  assert not (run_dir / LOCK_FILE).exists() and run_dir.is_dir()  # Not created by this lock: kept.


def test_released_on_an_exception_and_held_against_this_process_too(tmp_path):
  run_dir = tmp_path / "exp"
  with pytest.raises(ValueError, match="failed start"):
    with RunLock(str(run_dir)) as lock:
      assert lock.held and (run_dir / LOCK_FILE).exists()
      with pytest.raises(RunLockError, match=f"pid {os.getpid()} "):
        RunLock(str(run_dir)).acquire()  # Another open of the lock file: refused like another process.
      raise ValueError("failed start")
  assert not lock.held and not run_dir.exists()  # Created by the lock and left empty: removed.
  with RunLock(str(run_dir)):
    (run_dir / "metrics.jsonl").write_text("")
  assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
  lock.release()  # Idempotent.


def test_an_empty_or_unreadable_lock_file(tmp_path):
  (tmp_path / LOCK_FILE).write_text("")  # Left by a holder killed before it wrote its record: not reported.
  with RunLock(str(tmp_path)) as lock:
    assert lock.took_over is None
  (tmp_path / LOCK_FILE).write_text("garbage")
  with pytest.warns(UserWarning, match="took over the lock left by .*unreadable record 'garbage'"):
    RunLock(str(tmp_path)).acquire().release()
