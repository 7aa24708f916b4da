"""`make sweep`: every member of a sweep × every seed as its own training run, then a table and plots.

  make sweep SWEEP=toy SEEDS=0,1,2                  (one run after another)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2           (two at once)
  make sweep SWEEP=toy PRINT=1                      (print one `make train` line per run, run nothing)
  make sweep SWEEP=toy SEEDS=0 SMOKE=1              (every member at smoke-test size: a minute a run)
  python -m vapo_jax.cli.sweep toy --seeds 0,1 --members toy_vapo,toy_ppo --jobs 2 [field.path=value ...]
  python -m vapo_jax.cli.sweep toy --report             (rebuild the table and plots from finished runs)

A sweep is data: `experiments.SWEEPS[name]()` returns {member name: ExperimentConfig}. Each member × seed S
runs as `python -m vapo_jax.cli.train --exp <member> seed=S model.init_seed=S data.seed=S
name=<member>_seed<S> run_dir=runs/sweeps/<sweep> [overrides]` (the `make train` command) in a subprocess, its
console output appended to `logs/<member>_seed<S>.log`. A sweep with shared stages
(`experiments.SHARED_STAGES`, e.g. toy → the supervised warm start, then the reward model) first runs each
stage's experiment once, in order (`<experiment>_seed0`), each later stage and every member starting from what
the earlier ones export: `model.checkpoint=<warm start>/export sft.steps=0` (every row of the paper starts
from one base model; the seeds vary the RL) and `model.critic_checkpoint=<reward model>/critic_pretrained`
(the critic the paper's PPO starts from); `--no-shared-stages` lets every run do its own warm start, its
critic from its policy. Runs go seed by seed (every member's seed 0 first), so a partial sweep already
compares all members. A run whose directory holds `summary.json` is finished and skipped, so running the same
command again resumes the sweep (an interrupted run resumes from its own checkpoint). Ctrl-C or SIGTERM stops
the sweep: the runs in progress get SIGTERM (each saves a checkpoint) and the sweep exits 130 once every one
has stopped, each run's end printed before the closing line (a further signal, such as the one make passes on,
does not cut the wait short); a rerun waits for a run whose directory a stopping run still holds rather than
failing it. A failed run is reported with its log and the others go on; the exit status is 1 if any failed.
The runs share one XLA compilation cache, `<sweep dir>/xla_cache` (unless JAX_COMPILATION_CACHE_DIR is set),
so a run compiles only the programs that differ from those of the runs before it.

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
import os
import signal
import sys
import time
from collections.abc import Sequence

import experiments
from vapo_jax.cli import ArgumentParser, one_line_warnings, outlasting_output, sweep_report
from vapo_jax.cli.sweep_runs import Run, SweepStopped, execute, members_of, plan_runs
from vapo_jax.errors import USER_ERROR_EXIT_CODE, UserError

DEFAULT_ROOT = os.path.join("runs", "sweeps")



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
  parser.add_argument("--root", default=DEFAULT_ROOT,
                      help=f"parent of the sweep's directory (default {DEFAULT_ROOT})")
  parser.add_argument("--smoke", action="store_true", help="every run at smoke-test size (experiments/smoke.py)")
  parser.add_argument("--no-shared-stages", action="store_true",
                      help="no shared warm start or reward model: each run does its own warm start, its "
                           "critic from its policy")
  parser.add_argument("--print-commands", action="store_true",
                      help="print one `make train` line per run; run nothing")
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
      print(f"error: {', '.join(unknown)} not in sweep {args.sweep!r} (members: {', '.join(members)})",
            file=sys.stderr)
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
    print(f"sweep {args.sweep}: {len(members)} members × seeds {','.join(map(str, args.seeds))} = "
          f"{len(runs)} runs"
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
  """Each run's config resolved as its `make train` will resolve it (experiment, overrides, shared stages'
  paths), so that no mistake is found only when its run starts: whether all resolve, else the mistakes
  printed, one line each ("<error> (<runs>)")."""
  from vapo_jax.cli import resolve
  found: dict[str, list[str]] = {}
  for run in runs:
    try:
      resolve.resolve(run.argv(extra)[3:])
    except UserError as e:
      found.setdefault(str(e), []).append(run.name)
  if found:
    print("error: the sweep's overrides do not make a valid config for every run (nothing has run):\n  " + "\n  ".join(
        f"{error} ({'every run' if len(names) == len(runs) else ', '.join(names)})" for error,
        names in found.items()),
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
