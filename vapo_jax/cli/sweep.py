"""`make sweep`: every member of a sweep × every seed as its own training run, then a table and plots.

  make sweep SWEEP=toy SEEDS=0,1,2                  (one run after another)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2           (two at once)
  make sweep SWEEP=toy PRINT=1                      (print one `make train` line per run, run nothing)
  make sweep SWEEP=toy SEEDS=0 SMOKE=1              (every member at smoke-test size: a minute a run)
  python -m vapo_jax.cli.sweep toy --seeds 0,1 --members toy_vapo,toy_ppo --jobs 2 [field.path=value ...]
  python -m vapo_jax.cli.sweep toy --report             (rebuild the table and plots from finished runs)

A sweep is data: `experiments.SWEEPS[name]()` returns {member name: ExperimentConfig}. Each member ×
seed S runs as `python -m vapo_jax.cli.train --exp <member> seed=S model.init_seed=S data.seed=S
name=<member>_seed<S> run_dir=runs/sweeps/<sweep> [overrides]` (the `make train` command) in a
subprocess, its console output appended to `logs/<member>_seed<S>.log`. A sweep with shared stages
(`experiments.SHARED_STAGES`, e.g. toy → the supervised warm start, then the reward model) first runs
each stage's experiment once, in order (`<experiment>_seed0`), each later stage and every member
starting from what the earlier ones export: `model.checkpoint=<warm start>/export sft.steps=0` (every
row of the paper starts from one base model; the seeds vary the RL) and
`model.critic_checkpoint=<reward model>/critic_pretrained` (the critic the paper's PPO starts from);
`--no-shared-stages` lets every run do its own warm start, its critic from its policy. Runs go seed by seed
(every member's seed 0 first), so a partial sweep already compares all members. A run whose
directory holds `summary.json` is finished and skipped, so running the same command again resumes
the sweep (an interrupted run resumes from its own checkpoint). Ctrl-C or SIGTERM stops the sweep:
the runs in progress get SIGTERM (each saves a checkpoint) and the sweep exits 130 once every one has
stopped, each run's end printed before the closing line (a further signal, such as the one make passes
on, does not cut the wait short); a rerun waits for a run whose directory a stopping run still holds
rather than failing it. A failed run is reported with its log and the others go on; the exit status is 1 if any
failed. The runs share one XLA compilation
cache, `<sweep dir>/xla_cache` (unless JAX_COMPILATION_CACHE_DIR is set), so a run compiles only
the programs that differ from those of the runs before it.

Written under runs/sweeps/<sweep>/ (after every finished run, so a long sweep can be read early):
  runs.csv      one row per run: held-out accuracy before RL, final, best during RL, and the area
                under the held-out accuracy curve over the RL steps divided by their number (the
                mean accuracy during training), wall time, log
  table.md      per member: mean ± sample std over seeds, and each mean's difference to the full
                method (the sweep's first member), beside the paper's AIME 2024 score for that row
  plots/*.png   held-out accuracy, response length, entropy and explained variance against the RL
                step: one line per member (mean over seeds) with a band from the seeds' min to max
"""

import argparse
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
from vapo_jax.cli import ArgumentParser, one_line_warnings, outlasting_output, sweep_report
from vapo_jax.errors import USER_ERROR_EXIT_CODE, UserError
from vapo_jax.train import runlock

DEFAULT_ROOT = os.path.join("runs", "sweeps")



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
  process = subprocess.Popen(run.argv(extra), cwd=paths.REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
  process.log = log
  return process


def _outcome(run: Run, returncode: int, seconds: float, stream) -> str:
  """The status of a run that ended with `returncode`, printed."""
  if returncode == 0 and run.finished:
    print(f"done    {run.name} in {seconds:.0f}s", file=stream, flush=True)
    return "done"
  if returncode in (75, 130):  # SIGTERM / Ctrl-C: checkpointed (`train/checkpoints.py`).
    print(f"stopped {run.name} (exit {returncode}): checkpointed, run the sweep again to resume; log: {run.log}",
          file=stream, flush=True)
    return f"stopped (exit {returncode})"
  why = f"exit {returncode}" if returncode else "exit 0 without summary.json"
  said = error_line(run.log)
  print(f"FAILED  {run.name} ({why}) after {seconds:.0f}s{f': {said}' if said else ''}; log: {run.log}", file=stream,
        flush=True)
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
          print(f"FAILED  {run.name} (its shared stage {failed[0].name} did not finish)", file=stream, flush=True)
      while len(active) < jobs:
        ready = [r for r in pending if r.ready and not _held(r, waiting, stream)]
        if not ready:
          break
        run = ready[0]
        pending.remove(run)
        active[_launch(run, extra, env)] = (run, time.perf_counter())
        print(f"start   {run.name} [{total - len(pending)}/{total}] (log: {run.log})", file=stream, flush=True)
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
    print(f"wait    {run.name}: {who} still holds {run.directory} (a stopped sweep's run saving its checkpoint?); "
          "it starts when that ends", file=stream, flush=True)
  return True


def _stop(active: dict, status: dict, stream) -> str:
  """SIGTERM to every run in progress, then a wait for each that no further signal interrupts (make passes
  its own on to the sweep, and a group's SIGTERM reaches it twice); each run's end is printed. Returns the
  closing line."""
  said = []

  def again(signum, frame):  # A second stop: the runs are already stopping.
    if not said:
      said.append(signum)
      print(f"still stopping: waiting for {len(active)} run(s) to save their checkpoints", file=stream, flush=True)
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
        print(f"stopped {run.name} (exit {process.returncode}): before it could save; run the sweep again to start it "
              f"again; log: {run.log}", file=stream, flush=True)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  ended = [status[run.name] for run, _ in active.values()]
  saved = sum(s.startswith("stopped") and "before saving" not in s for s in ended)
  lost = [s for s in ended if not (s.startswith("stopped") and "before saving" not in s) and s != "done"]
  return (f"sweep stopped: {saved} run(s) in progress saved checkpoints" + (f", {len(lost)} ended otherwise ("
          f"{'; '.join(lost)})" if lost else "") + "; the same command resumes the sweep")


# --------------------------------------------------------------------------------------- main
def _seeds(text: str) -> list[int]:
  try:
    seeds = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers such as 0,1,2, got {text!r}") from None
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise argparse.ArgumentTypeError(f"--seeds needs distinct non-negative integers, got {text!r}")
  return seeds


def _parser() -> ArgumentParser:
  parser = ArgumentParser(prog="python -m vapo_jax.cli.sweep", description=__doc__.split("\n\n")[0])
  parser.add_argument("sweep", help="a registered sweep (experiments.SWEEPS), e.g. toy")
  parser.add_argument("overrides", nargs="*", help="field.path=value overrides for every run")
  parser.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
  parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
  parser.add_argument("--members", help="comma-separated subset of the sweep's members (default: all)")
  parser.add_argument("--root", default=DEFAULT_ROOT, help=f"parent of the sweep's directory (default {DEFAULT_ROOT})")
  parser.add_argument("--smoke", action="store_true", help="every run at smoke-test size (experiments/smoke.py)")
  parser.add_argument("--no-shared-stages", action="store_true",
                      help="no shared warm start or reward model: each run does its own warm start, its critic from "
                           "its policy")
  parser.add_argument("--print-commands", action="store_true", help="print one `make train` line per run; run nothing")
  parser.add_argument("--report", action="store_true", help="only rebuild runs.csv, table.md and plots/")
  return parser


def main(argv: Sequence[str], *, stream=sys.stdout) -> int:
  args = _parser().parse_intermixed_args(argv)  # Overrides may come before or after the options.
  given, args.sweep = args.sweep, experiments.sweep_name(args.sweep)  # A former name runs in its old directory.
  try:
    members = members_of(args.sweep)
  except KeyError as e:
    print(f"error: {e.args[0]}", file=sys.stderr)
    return 2
  if args.members:
    chosen = [m.strip() for m in args.members.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in members]
    if unknown:
      print(f"error: {', '.join(unknown)} not in sweep {args.sweep!r} (members: {', '.join(members)})", file=sys.stderr)
      return 2
    members = [m for m in members if m in chosen]  # The sweep's order: its first member is the reference.
  if args.jobs < 1:
    print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
    return 2
  if bad := [o for o in args.overrides if "=" not in o]:
    print(f"error: overrides look like field.path=value, got {', '.join(bad)}", file=sys.stderr)
    return 2
  sweep_dir = os.path.join(args.root, given)
  extra = ["--smoke"] * args.smoke + args.overrides
  stages = () if args.no_shared_stages else experiments.SHARED_STAGES.get(args.sweep, ())
  if args.print_commands:  # In order: the shared stages before the members.
    for run in plan_runs(members, args.seeds, sweep_dir, stages=stages):
      print(run.make_command(extra), file=stream)
    return 0
  status: dict[str, str] = {}
  # Absolute paths: the runs start in the repository root.
  everything = plan_runs(members, args.seeds, os.path.abspath(sweep_dir), stages=stages)
  if not args.report and not check_configs(everything, extra):
    return 2
  runs = everything[len(stages):]  # The table's rows.
  if not args.report:
    start = time.perf_counter()
    print(f"sweep {args.sweep}: {len(members)} members × seeds {','.join(map(str, args.seeds))} = {len(runs)} runs"
          + (f" from shared stages {', '.join(f'{s.experiment}_seed0' for s in stages)}" if stages else "")
          + f", {args.jobs} at a time, under {sweep_dir}", file=stream, flush=True)
    report = lambda _: _report_between_runs(args.sweep, members, runs, status, sweep_dir, stream=stream)
    execute(everything, jobs=args.jobs, extra=extra, on_done=report, status=status, stream=stream)
    print(f"sweep {args.sweep}: {time.perf_counter() - start:.0f}s", file=stream)
  written = sweep_report.write_report(args.sweep, members, runs, status, sweep_dir, stream=stream)
  print("\n".join(f"{what}: {path}" for what, path in written.items()), file=stream)
  failed = [run for run in everything if status.get(run.name, "").startswith(("failed", "stopped"))]
  for run in failed:
    print(f"failed: {run.name}: {status[run.name]}; log: {run.log}", file=stream)
  return 1 if failed else 0


def check_configs(runs: Sequence[Run], extra: Sequence[str]) -> bool:
  """Each run's config resolved as its `make train` will resolve it (experiment, overrides, shared stages' paths),
  so that no mistake is found only when its run starts: whether all resolve, else the mistakes printed, one line
  each ("<error> (<runs>)")."""
  from vapo_jax.cli import resolve
  found: dict[str, list[str]] = {}
  for run in runs:
    try:
      resolve.resolve(run.argv(extra)[3:])
    except UserError as e:
      found.setdefault(str(e), []).append(run.name)
  if found:
    print("error: the sweep's overrides do not make a valid config for every run (nothing has run):\n  " + "\n  ".join(
        f"{error} ({'every run' if len(names) == len(runs) else ', '.join(names)})" for error, names in found.items()),
          file=sys.stderr)
  return not found


def _report_between_runs(*args, stream) -> None:
  """The report after a run; a full disk there is said in one line, and the runs go on."""
  try:
    sweep_report.write_report(*args, stream=stream)
  except UserError as e:
    print(f"warning: {e}", file=stream, flush=True)


def _terminate(signum, frame):
  raise KeyboardInterrupt  # As Ctrl-C: `execute` passes SIGTERM on to the runs in progress and waits for them.


if __name__ == "__main__":
  signal.signal(signal.SIGTERM, _terminate)  # A scheduler's or `kill`'s stop, like Ctrl-C.
  try:
    with one_line_warnings(), outlasting_output():
      sys.exit(main(sys.argv[1:]))
  except UserError as e:  # The final report on a full disk.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT_CODE)
  except SweepStopped as e:
    print(e.message, file=sys.stderr)
    sys.exit(130)
  except KeyboardInterrupt:  # Before any run started.
    print("sweep stopped before any run started", file=sys.stderr)
    sys.exit(130)
