"""`make train` entry point: resolve an experiment, write its config, run it.

  python -m vapo_jax.cli.train --exp tiny [field.path=value ...]
  python -m vapo_jax.cli.train --exp aime --help      (every field with its current value)
  python -m vapo_jax.cli.train --exp aime --smoke     (the same experiment at smoke-test size)

Compiles the run's programs on its devices and refuses a run with a phase over the device memory by
XLA's figures, naming the phase and the settings to change (`preflight.check_memory`; on CPUs only with
mesh.device_memory_gib, which they do not report); then runs the experiment's stages
(supervised warm start, value pretraining, RL) with `trainer.Trainer` and prints held-out accuracy
before and after RL and where the run directory is.
Running the same command again resumes from the run directory's newest checkpoint. Exit codes:
0 done; 1 the run diverged (non-finite updates) or crashed; 2 a user error (configuration,
data, checkpoint, reward function, machine, a second start on a busy run directory: one line
names what to fix); 75 stopped by SIGTERM after saving a checkpoint, 130 stopped by Ctrl-C after
saving (run again to resume).
"""

import os
import shutil
import signal
import sys

from vapo_jax.cli import one_line_warnings, outlasting_output, resolve
from vapo_jax.errors import USER_ERROR_EXIT_CODE, UserError


def main(argv: list[str]) -> int:
  handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
  try:
    with one_line_warnings(), outlasting_output():  # Warnings in one line; a gone reader does not stop a save.
      return _main(argv)
  finally:
    for signum, handler in handlers.items():  # As they were (a caller in the same process: the tests).
      signal.signal(signum, handler)


def _main(argv: list[str]) -> int:
  parser = resolve.parser("vapo_jax.cli.train", __doc__)
  try:
    config, args = resolve.resolve(argv, parser)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return USER_ERROR_EXIT_CODE
  if args.help:
    print(resolve.usage(parser, config))
    return 0
  from vapo_jax import compile_cache
  compile_cache.bound()  # make train's cache, at its size before this run adds to it.
  from experiments import smoke
  from vapo_jax import distributed  # Imports JAX: kept off the `--help` path.
  from vapo_jax.cli import preflight
  from vapo_jax.train import checkpoints
  from vapo_jax.train.experience import DynamicSamplingCapReached
  from vapo_jax.train.metrics import Diverged
  from vapo_jax.train.trainer import Trainer

  run_dir, created, started = config.run_directory, [], False
  compile_cache.install()  # Before anything compiles: each kept program checked against its key.
  stopped_by = _stop_at_start()
  try:
    distributed.tpu_compiler_flags(config.mesh)  # Before libtpu starts.
    distributed.initialize(cpu_devices=config.mesh.cpu_devices)  # Processes, CPU devices: before any JAX.
    devices = preflight.check_backend()
    created = preflight.check_run_dir(run_dir)
    preflight.check_memory(config, devices, show=distributed.is_main_process())
    trainer = Trainer(config)
    if distributed.is_main_process():
      resolve.write_resolved_config(config)
      print(f"experiment {config.name}: resolved config written to {run_dir}/config.json")
      print(preflight.kernels(config, trainer.model_cfg, devices[0].platform))
      if args.smoke:
        print(smoke.rehearsal_table(args.full_run, config, devices=trainer.layout.data_devices,
                                    platform=devices[0].platform))
    started = True  # From here the run's own stop (PreemptionFlag) finishes a step and saves.
    summary = trainer.run()
  except UserError as e:
    preflight.remove_empty(created)  # A failed start leaves no empty run directory behind.
    print(f"error: {e}", file=sys.stderr)
    return USER_ERROR_EXIT_CODE
  except checkpoints.Preempted as e:
    print(f"stopped: {e}. Run the same command again to resume.", file=sys.stderr)
    return e.exit_code
  except KeyboardInterrupt:
    if not started:
      return _stopped_at_start(stopped_by[0], run_dir, created)
    return _aborted(run_dir)
  except (Diverged, DynamicSamplingCapReached) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except Exception:
    preflight.remove_empty(created)  # A crash at the start leaves no empty run directory behind either.
    raise
  if not distributed.is_main_process():
    return 0
  print("\n".join(closing_lines(summary, run_dir, _draw_curves(run_dir))))
  return 0


def _draw_curves(run_dir: str) -> str | None:
  """A finished run's held-out accuracy and reward by step, `<run>/plots/reward_accuracy.png` (`cli/plots`, as
  `make plot` draws it; `make plot` draws the other figures, 2-3 CPU seconds more), when matplotlib is
  installed: its path, else None. A drawing that fails is one line, not the run's failure (its results are
  written)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return None
  from vapo_jax.cli import plots
  try:
    written = plots.plot_runs({os.path.basename(run_dir): os.path.join(run_dir, "metrics.jsonl")},
                              os.path.join(run_dir, "plots"), only=("reward_accuracy",))
  except Exception as e:  # noqa: BLE001  (a full disk, a damaged metrics file: the run itself has finished)
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    print(f"warning: the curves were not drawn ({type(e).__name__}: {first}); make plot RUN={run_dir} draws "
          "them", file=sys.stderr)
    return None
  return next((path for path in written if path.endswith("reward_accuracy.png")), None)


_interrupted_start = [False]  # Set when a signal stopped the start-up, or a second Ctrl-C the run (`__main__`).


def _stop_at_start() -> list[str]:
  """Until the run starts (its own handler then takes over): Ctrl-C or SIGTERM stops the start-up at once, as
  a KeyboardInterrupt; the returned list holds the signal's name."""
  which = ["Ctrl-C (SIGINT)"]

  def stop(signum, frame):
    which[0] = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (SIGINT)"
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  return which


def _aborted(run_dir: str) -> int:
  """A second Ctrl-C: stopped at once, a save in progress abandoned (Orbax's reports of it silenced, the exit
  without atexit's waits); one line names the newest complete checkpoint, which a resume starts from."""
  from vapo_jax.train import background_saves, checkpoints
  background_saves.quiet_after_failure()
  _interrupted_start[0] = True  # Ends the process at once (`__main__`): nothing is left to keep.
  directory = os.path.join(run_dir, "checkpoints")
  complete = checkpoints.complete_steps(directory)
  resume = (f"the newest complete checkpoint, {os.path.join(directory, str(complete[-1]))}, is intact: run "
            "the same command again to resume from it" if complete else "no checkpoint is complete: the same "
            "command starts afresh")
  print(f"interrupted (a second Ctrl-C): stopped at once, any save in progress abandoned; {resume}.",
        file=sys.stderr)
  return checkpoints.INTERRUPTED_EXIT_CODE


def _stopped_at_start(signal_name: str, run_dir: str, created: list[str]) -> int:
  """A signal before the first step: the run directory this start made removed, one line, the signal's status."""
  from vapo_jax.cli import preflight
  from vapo_jax.train import checkpoints
  if run_dir in created:  # Made by this start, which stopped before any step: all it holds is this start's.
    shutil.rmtree(run_dir, ignore_errors=True)
  preflight.remove_empty(created)
  _interrupted_start[0] = True
  print(f"stopped by {signal_name} during start-up, before any step: nothing was trained or saved. Run the "
        "same command again to start.", file=sys.stderr)
  return checkpoints.INTERRUPTED_EXIT_CODE if signal_name.startswith("Ctrl-C") else 128 + signal.SIGTERM


def closing_lines(summary: dict, run_dir: str, drawn: str | None = None) -> list[str]:
  """A finished run's last lines: its time, held-out accuracy before and after RL (3 decimals) with the gain
  and its standard error (each accuracy's over the problems, combined as independent: a bound from above, the
  two evaluations sharing their problems), its directory, and its curves: `drawn`, the held-out accuracy and
  reward figure the run drew, else the command that draws them."""
  before, after = summary["accuracy_before_rl"], summary["accuracy_after_rl"]
  accuracy = ("no held-out evaluation (eval.path is unset)" if before is None and after is None else
              f"held-out accuracy: before RL {_rounded(before)}, after RL {_rounded(after)}")
  errors = (summary.get("stderr_before_rl"), summary.get("stderr_after_rl"))
  if before is not None and after is not None and None not in errors and summary.get("eval_problems"):
    accuracy += (f" ({after - before:+.3f} ± {(errors[0] ** 2 + errors[1] ** 2) ** 0.5:.3f}, "
                 f"{summary['eval_problems']:.0f} problems × {summary['eval_samples_per_problem']})")
  return [f"done in {summary['seconds']:.0f}s. {accuracy}",
          f"run directory: {run_dir} (config.json, metrics.jsonl, tensorboard/, checkpoints/, export/, "
          "summary.json)",
          f"curves: {drawn} (held-out accuracy and mean reward by step; make plot RUN={run_dir} draws the "
          "others)"
          if drawn else
          f"curves: make plot RUN={run_dir} (PNGs in {os.path.join(run_dir, 'plots')}/)"]


def _rounded(accuracy: float | None) -> str:
  return "n/a" if accuracy is None else f"{accuracy:.3f}"


if __name__ == "__main__":
  status = main(sys.argv[1:])
  from vapo_jax.train import background_saves
  # Stopped inside JAX's start-up work, whose teardown may crash, or after a failed save whose background
  # threads wait minutes for signals: nothing is left to keep, so the process ends without them.
  if _interrupted_start[0] or (status and background_saves.background_left()):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)
