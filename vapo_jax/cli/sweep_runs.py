"""A sweep's runs: each member × seed as a `make train` subprocess (`Run`, `plan_runs`), started `jobs` at a
time once the shared stages it starts from have finished (`execute`), and stopped together, each saving its
checkpoint, on Ctrl-C or SIGTERM (`SweepStopped`). `cli/sweep.py` is the command that plans and reports them.
"""

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import experiments
from vapo_jax import paths
from vapo_jax.train import runlock


@dataclasses.dataclass(frozen=True)
class Run:
  """One member × seed of a sweep."""

  member: str  # Experiment name (`--exp`).
  seed: int
  sweep_dir: str  # runs/sweeps/<sweep>: the runs' parent directory (`run_dir=`).
  # The shared stages' runs this run starts from, each with its stage (what it exports, the field taking it).
  starts: tuple[tuple[experiments.SharedStage, "Run"], ...] = ()

  @property
  def name(self) -> str:
    return f"{self.member}_seed{self.seed}"

  @property
  def directory(self) -> str:
    return os.path.join(self.sweep_dir, self.name)

  @property
  def log(self) -> str:
    return os.path.join(self.sweep_dir, "logs", f"{self.name}.log")

  @property
  def finished(self) -> bool:
    return os.path.isfile(os.path.join(self.directory, "summary.json"))

  @property
  def ready(self) -> bool:
    """Every shared stage it starts from has finished."""
    return all(run.finished for _, run in self.starts)

  def overrides(self, extra: Sequence[str] = ()) -> list[str]:
    seed = self.seed
    start = [o for stage, run in self.starts
             for o in (f"{stage.field}={os.path.join(run.directory, stage.output)}", *stage.overrides)]
    return [f"seed={seed}", f"model.init_seed={seed}", f"data.seed={seed}", f"name={self.name}",
            f"run_dir={self.sweep_dir}", *start, *extra]

  def argv(self, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "vapo_jax.cli.train", "--exp", self.member, *self.overrides(extra)]

  def make_command(self, extra: Sequence[str] = ()) -> str:
    return f"make train EXP={self.member} ARGS={shlex.quote(' '.join(self.overrides(extra)))}"


def members_of(sweep: str) -> list[str]:
  """The member names of registered sweep `sweep`, in its order (the first is the full method)."""
  if sweep not in experiments.SWEEPS:
    raise KeyError(f"unknown sweep {sweep!r}; known: {', '.join(sorted(experiments.SWEEPS))}")
  return list(experiments.SWEEPS[sweep]())


def plan_runs(members: Sequence[str], seeds: Sequence[int], sweep_dir: str, *,
              stages: Sequence[experiments.SharedStage] = ()) -> list[Run]:
  """The shared `stages` first, in order, each once (seed 0, whatever the seeds) and each starting from
  the ones before it; then every member × seed, seed by seed, each starting from all of them, as every
  row of the paper starts from one base model: the seeds vary the RL (its sampling and data order),
  not the starting point."""
  runs, starts = [], ()
  for stage in stages:
    runs.append(Run(stage.experiment, 0, sweep_dir, starts))
    starts += ((stage, runs[-1]),)
  return runs + [Run(member, seed, sweep_dir, starts) for seed in seeds for member in members]


# ------------------------------------------------------------------------------------ running
def _launch(run: Run, extra: Sequence[str], env: dict) -> subprocess.Popen:
  """Starts `run` as `make train` would, its output appended to its log (kept open as `.log`)."""
  os.makedirs(os.path.dirname(run.log), exist_ok=True)
  log = open(run.log, "a")
  log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(run.argv(extra))}\n")
  log.flush()
  process = subprocess.Popen(run.argv(extra), cwd=paths.REPO_ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
  process.log = log
  return process


def _outcome(run: Run, returncode: int, seconds: float, stream) -> str:
  """The status of a run that ended with `returncode`, printed."""
  if returncode == 0 and run.finished:
    print(f"done    {run.name} in {seconds:.0f}s", file=stream, flush=True)
    return "done"
  if returncode in (75, 130):  # SIGTERM / Ctrl-C: checkpointed (`train/checkpoints.py`).
    print(f"stopped {run.name} (exit {returncode}): checkpointed, run the sweep again to resume; log: "
          f"{run.log}", file=stream, flush=True)
    return f"stopped (exit {returncode})"
  why = f"exit {returncode}" if returncode else "exit 0 without summary.json"
  said = error_line(run.log)
  print(f"FAILED  {run.name} ({why}) after {seconds:.0f}s{f': {said}' if said else ''}; log: {run.log}",
        file=stream, flush=True)
  return f"failed ({why})"


def error_line(log: str, *, tail_bytes: int = 65536) -> str | None:
  """What a failed run said last: its log's last `error: ` line (the trainer's one-line errors), else its
  last non-empty line (a traceback's exception), at most 300 characters; None for an empty log."""
  try:
    with open(log, "rb") as f:
      f.seek(max(0, os.path.getsize(log) - tail_bytes))
      lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
  except OSError:
    return None
  found = [line for line in lines if line.startswith("error: ")] or lines
  return found[-1][:300] if found else None


class SweepStopped(KeyboardInterrupt):
  """The sweep was stopped (SIGTERM, Ctrl-C) and every run in progress has ended; `message` says how."""

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message


def execute(runs: Sequence[Run], *, jobs: int = 1, extra: Sequence[str] = (), on_done=None,
            status: dict[str, str] | None = None, stream=sys.stdout) -> dict[str, str]:
  """Runs the unfinished `runs`, `jobs` at a time; returns {run name: status}.

  Status: "skipped" (finished before), "done", or "failed (exit N)", entered into `status` (when
  given) as each run ends; then `on_done(run)` is called. A run whose directory another process still
  holds (the run of an earlier, stopped sweep that is still saving) waits for it, said once. Ctrl-C or
  SIGTERM sends SIGTERM to the runs in progress (each saves a checkpoint and stops), waits for every one
  of them whatever signals follow, and raises `SweepStopped`.
  """
  status = {} if status is None else status
  pending, active, waiting = [], {}, set()
  env = dict(os.environ)
  if runs and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.path.abspath(runs[0].sweep_dir), "xla_cache")
  for run in runs:
    if run.finished:
      status[run.name] = "skipped"
      print(f"skip    {run.name} (finished: {run.directory}/summary.json)", file=stream, flush=True)
    else:
      pending.append(run)
  total = len(pending)
  try:
    while pending or active:
      for process in [p for p in active if p.poll() is not None]:  # Ends first: "done" before the next "start".
        run, start = active.pop(process)
        process.log.close()
        status[run.name] = _outcome(run, process.returncode, time.perf_counter() - start, stream)
        if on_done is not None:
          on_done(run)
      # A run whose shared stage failed, or can no longer finish (not among the runs): nothing to start from.
      stuck = not active and not any(r.ready for r in pending) and not waiting
      for run in list(pending):
        unfinished = [s for _, s in run.starts if not s.finished]
        failed = [s for s in unfinished if stuck or status.get(s.name, "").startswith(("failed", "stopped"))]
        if failed:
          status.setdefault(failed[0].name, "not run")
          pending.remove(run)
          status[run.name] = f"failed (shared stage {failed[0].name}: {status[failed[0].name]})"
          print(f"FAILED  {run.name} (its shared stage {failed[0].name} did not finish)", file=stream,
                flush=True)
      while len(active) < jobs:
        ready = [r for r in pending if r.ready and not _held(r, waiting, stream)]
        if not ready:
          break
        run = ready[0]
        pending.remove(run)
        active[_launch(run, extra, env)] = (run, time.perf_counter())
        print(f"start   {run.name} [{total - len(pending)}/{total}] (log: {run.log})", file=stream,
              flush=True)
      time.sleep(0.2)
  except KeyboardInterrupt:
    raise SweepStopped(_stop(active, status, stream)) from None
  return status


def _held(run: Run, waiting: set, stream) -> bool:
  """Whether another process holds `run`'s directory (said once): it is waited for, never started beside."""
  holder = runlock.holder(run.directory)
  if holder is None:
    waiting.discard(run.name)
    return False
  if run.name not in waiting:
    waiting.add(run.name)
    who = runlock.describe(holder) if holder else "a process"
    print(f"wait    {run.name}: {who} still holds {run.directory} (a stopped sweep's run saving its "
          "checkpoint?); it starts when that ends", file=stream, flush=True)
  return True


def _stop(active: dict, status: dict, stream) -> str:
  """SIGTERM to every run in progress, then a wait for each that no further signal interrupts (make passes
  its own on to the sweep, and a group's SIGTERM reaches it twice); each run's end is printed. Returns the
  closing line."""
  said = []

  def again(signum, frame):  # A second stop: the runs are already stopping.
    if not said:
      said.append(signum)
      print(f"still stopping: waiting for {len(active)} run(s) to save their checkpoints", file=stream,
            flush=True)
  previous = {s: signal.signal(s, again) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for process in active:
      if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # The trainer checkpoints and exits 75; a second SIGTERM is ignored.
    for process, (run, start) in active.items():
      process.wait()
      process.log.close()
      if process.returncode in (0, 75, 130):  # Finished, or saved a checkpoint and stopped.
        status[run.name] = _outcome(run, process.returncode, time.perf_counter() - start, stream)
      else:  # Stopped before it could save (still starting): its rerun starts from its newest checkpoint, if any.
        status[run.name] = f"stopped (exit {process.returncode}, before saving)"
        print(f"stopped {run.name} (exit {process.returncode}): before it could save; run the sweep again to "
              f"start it again; log: {run.log}", file=stream, flush=True)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  ended = [status[run.name] for run, _ in active.values()]
  saved = sum(s.startswith("stopped") and "before saving" not in s for s in ended)
  lost = [s for s in ended if not (s.startswith("stopped") and "before saving" not in s) and s != "done"]
  return (f"sweep stopped: {saved} run(s) in progress saved checkpoints" + (f", {len(lost)} ended otherwise ("
          f"{'; '.join(lost)})" if lost else "") + "; the same command resumes the sweep")
