"""`make train` entry point: resolve an experiment, write its config, run it.

  python -m vapo_jax.main --exp tiny [field.path=value ...]
  python -m vapo_jax.main --exp aime --help      (every field with its current value)

Runs the experiment's stages (supervised warm start, value pretraining, RL) with
`trainer.Trainer` and prints held-out accuracy before and after RL and where the run directory is.
Running the same command again resumes from the run directory's newest checkpoint. Exit codes:
0 done, 2 bad configuration, 75 (`checkpointing.PREEMPTED_EXIT_CODE`) stopped by SIGTERM after
saving a checkpoint (run again to resume).
"""

import dataclasses
import json
import os
import sys

from vapo_jax import overrides
from vapo_jax.config import ConfigError, ExperimentConfig


def _usage(config: ExperimentConfig) -> str:
  lines = ["usage: python -m vapo_jax.main [--exp NAME] [field.path=value ...]", "", "fields:"]
  for path, (_, value) in overrides.field_paths(config).items():
    lines.append(f"  {path} = {value!r}")
  return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[ExperimentConfig, bool]:
  """Parses `--exp NAME`, `--help` and overrides into a validated config."""
  import experiments  # The registry lives beside the package, at the repository's top level.

  name, rest, want_help = "tiny", [], False
  args = iter(argv)
  for arg in args:
    if arg in ("-h", "--help"):
      want_help = True
    elif arg == "--exp":
      name = next(args, "")
    elif arg.startswith("--exp="):
      name = arg.split("=", 1)[1]
    else:
      rest.append(arg)
  config = experiments.get_experiment(name or "tiny")
  return overrides.apply_overrides(config, rest), want_help


def write_resolved_config(config: ExperimentConfig) -> str:
  """Writes `<run_dir>/<name>/config.json` and returns the run directory."""
  run_dir = os.path.join(config.run_dir, config.name)
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, "config.json")
  with open(path + ".tmp", "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2)
  os.replace(path + ".tmp", path)
  return run_dir


def main(argv: list[str]) -> int:
  try:
    config, want_help = resolve(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if want_help:
    print(_usage(config))
    return 0
  from vapo_jax import checkpointing, distributed  # Import JAX; kept off the `--help` path.
  from vapo_jax.trainer import Trainer

  distributed.initialize()  # Several processes (a pod, or VAPO_* variables): before any JAX computation.
  from vapo_jax.data import DataError
  try:
    trainer = Trainer(config)
  except (ConfigError, DataError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  run_dir = os.path.join(config.run_dir, config.name)
  if distributed.is_main_process():
    write_resolved_config(config)
    print(f"experiment {config.name}: resolved config written to {run_dir}/config.json")
  try:
    summary = trainer.run()
  except checkpointing.Preempted as e:
    print(f"preempted: {e}. Run the same command again to resume.", file=sys.stderr)
    return checkpointing.PREEMPTED_EXIT_CODE
  if not distributed.is_main_process():
    return 0
  print(f"done in {summary['seconds']:.0f}s. held-out accuracy: before RL {summary['accuracy_before_rl']}, "
        f"after RL {summary['accuracy_after_rl']}")
  print(f"run directory: {run_dir} (config.json, metrics.jsonl, tensorboard/, checkpoints/, export/, summary.json)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
