"""Runs one program as several local JAX processes on CPU, as a multi-host run would.

  results = launch("tests/some_worker.py", ["--out", dir], num_processes=2, devices_per_process=4)

Each child gets `VAPO_COORDINATOR` (a free localhost port), `VAPO_NUM_PROCESSES`,
`VAPO_PROCESS_ID` and `VAPO_LOCAL_DEVICES`, which `vapo_jax.distributed.initialize()` reads, and
`JAX_PLATFORMS=cpu`; the parent's `--xla_force_host_platform_device_count` is removed. When one
child fails, or the time-out passes, every child is killed at once: a JAX process whose peer has
died otherwise waits in a collective or at the exit barrier for minutes, and JAX catches SIGTERM
(as a preemption notice), so only SIGKILL ends it promptly.

(Not named `multiprocess.py`: the tests directory is on `sys.path` under pytest, and that name
would hide the installed `multiprocess` package that `datasets` imports.)
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class LaunchError(RuntimeError):
  """A child failed or the time-out passed; `results` holds every child's output."""

  def __init__(self, message: str, results: list[subprocess.CompletedProcess]):
    super().__init__(message)
    self.results = results


def free_port() -> int:
  """A localhost TCP port that is free now (the coordinator binds it moments later)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def without_device_count(**extra: str) -> dict[str, str]:
  """This process's environment less its host device count (a child gets one CPU device) and with its
  other XLA flags (`make test`'s optimisation level), plus `extra`."""
  env = dict(os.environ)
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return env | extra


def child_env(process_id: int, *, num_processes: int, devices_per_process: int, port: int,
              extra: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of child `process_id`: the parent's, minus its host device count, plus the run's."""
  env = without_device_count()
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", VAPO_COORDINATOR=f"localhost:{port}",
             VAPO_NUM_PROCESSES=str(num_processes), VAPO_PROCESS_ID=str(process_id),
             VAPO_LOCAL_DEVICES=str(devices_per_process))
  env.update(extra or {})
  return env


def launch(target: str, args: Sequence[str] = (), *, num_processes: int = 2, devices_per_process: int = 4,
           timeout_s: float = 120.0, env: dict[str, str] | None = None, cwd: str | None = None,
           check: bool = True) -> list[subprocess.CompletedProcess]:
  """Runs `python target args...` (`target` a .py path, or a module name for `-m`) as N processes.

  Returns each child's `CompletedProcess` (text stdout and stderr), in process order. With
  `check`, raises `LaunchError` (with every child's output in its message) when a child exits
  non-zero or the time-out passes. Children killed because another failed report -9; at the
  time-out, children still running get SIGABRT first (-6), so their stderr ends with the Python
  stack of every thread, showing where they waited.
  """
  port = free_port()
  command = [sys.executable, *([target] if target.endswith(".py") else ["-m", target]), *args]
  with tempfile.TemporaryDirectory(prefix="vapo_launch_") as tmp:
    procs, files = [], []
    try:
      for i in range(num_processes):
        out, err = open(os.path.join(tmp, f"{i}.out"), "w+"), open(os.path.join(tmp, f"{i}.err"), "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(
            command, stdout=out, stderr=err, cwd=cwd, start_new_session=True,
            env=child_env(i, num_processes=num_processes, devices_per_process=devices_per_process,
                          port=port, extra=env)))
      deadline, failure = time.monotonic() + timeout_s, None
      while failure is None and any(_status(p) is None for p in procs):
        failed = [i for i, p in enumerate(procs) if _status(p) not in (None, 0)]
        if failed:
          failure = f"process {failed[0]} exited with {_status(procs[failed[0]])}"
        elif time.monotonic() > deadline:
          failure = f"time-out after {timeout_s:.0f} s"
        else:
          time.sleep(0.05)
      if failure and failure.startswith("time-out"):
        _dump_stacks(procs)
    finally:
      for p in procs:
        _kill_group(p)
    results = [subprocess.CompletedProcess([*command, f"# process {i}"], p.returncode, _read(out), _read(err))
               for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True))]
  if failure is None and any(r.returncode for r in results):
    failure = "a process failed"
  if check and failure:
    raise LaunchError(f"{' '.join(command)}: {failure}\n" + "\n".join(_describe(r, i) for i, r in enumerate(results)),
                      results)
  return results


def _status(p: subprocess.Popen) -> int | None:
  """The child's exit status (negative: killed by that signal), or None while it runs; not reaped
  (WNOWAIT), so its pid, which names its process group, cannot be reused before `_kill_group`."""
  info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  if info is None or info.si_pid == 0:
    return None
  return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _dump_stacks(procs: list[subprocess.Popen], wait_s: float = 5.0):
  """SIGABRT to the children still running: Python's faulthandler (PYTHONFAULTHANDLER) prints
  every thread's stack to stderr, which shows where a hung process waits."""
  running = [p for p in procs if _status(p) is None]
  for p in running:
    os.kill(p.pid, signal.SIGABRT)
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline and any(_status(p) is None for p in running):
    time.sleep(0.05)


def _kill_group(p: subprocess.Popen):
  """SIGKILL to the child's process group (its session: the child and anything it started, such
  as verifier workers left behind), then reaps the child."""
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  p.wait()


def _read(f) -> str:
  with f:
    f.seek(0)
    return f.read()


def _describe(result: subprocess.CompletedProcess, i: int, tail: int = 4000) -> str:
  return (f"--- process {i}: exit {result.returncode}\n[stdout]\n{result.stdout[-tail:]}\n"
          f"[stderr]\n{result.stderr[-tail:]}")
