"""Command-line config resolution shared by `make train`, `make eval`, `make memory` and `make sweep`.

  resolve(["--exp", "aime", "algo.eps_high=0.3"]) -> (ExperimentConfig, want_help)

It imports the configs, the overrides and the experiment registry (the repository's
`experiments/`, which only the command-line layer may import), and no JAX, so `--help` answers at once.
"""

import dataclasses
import json
import os

import experiments
from experiments.smoke import smoke
from vapo_jax import files
from vapo_jax.config import ExperimentConfig, overrides
from vapo_jax.errors import ConfigError

DEFAULT_EXPERIMENT = "tiny"


def usage(config: ExperimentConfig, program: str = "vapo_jax.cli.train") -> str:
  lines = [f"usage: python -m {program} [--exp NAME] [--smoke] [field.path=value ...]", "",
           "--smoke: the experiment at smoke-test size (experiments/smoke.py), before the overrides", "", "fields:"]
  for path, (_, value) in overrides.field_paths(config).items():
    lines.append(f"  {path} = {value!r}")
  return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[ExperimentConfig, bool]:
  """Parses `--exp NAME`, `--smoke`, `--help` and `field.path=value` overrides into a validated config."""
  name, rest, want_help, small = DEFAULT_EXPERIMENT, [], False, False
  args = iter(argv)
  for arg in args:
    if arg in ("-h", "--help"):
      want_help = True
    elif arg == "--smoke":
      small = True
    elif arg == "--exp" or arg.startswith("--exp="):
      name = arg.split("=", 1)[1] if "=" in arg else next(args, "")
      if not name:
        raise ConfigError(f"--exp needs an experiment name, e.g. --exp {DEFAULT_EXPERIMENT} (make train EXP=...)")
    else:
      rest.append(arg)
  config = experiments.get_experiment(name)
  return overrides.apply_overrides(smoke(config) if small else config, rest), want_help


def write_resolved_config(config: ExperimentConfig) -> str:
  """Writes `<run_dir>/<name>/config.json` (atomically) and returns the run directory."""
  run_dir = config.run_directory
  with files.reporting_write_failures(run_dir, "writing config.json"):
    os.makedirs(run_dir, exist_ok=True)
    files.write_atomically(os.path.join(run_dir, "config.json"), json.dumps(dataclasses.asdict(config), indent=2))
  return run_dir
