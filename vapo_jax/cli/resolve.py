"""Command-line config resolution shared by `make train`, `make eval`, `make memory` and `make sweep`.

  parser = resolve.parser("vapo_jax.cli.train", __doc__)      # --exp, --smoke, --help, overrides
  config, args = resolve.resolve(["--exp", "aime", "algo.eps_high=0.3"], parser)

It imports the configs, the overrides and the experiment registry (the repository's
`experiments/`, which only the command-line layer may import), and no JAX, so `--help` answers at once.
"""

import argparse
import dataclasses
import json
import os

import experiments
from experiments.smoke import DERIVED, smoke
from vapo_jax import files
from vapo_jax.cli import ArgumentParser
from vapo_jax.config import ExperimentConfig, overrides
from vapo_jax.errors import ConfigError

DEFAULT_EXPERIMENT = "tiny"


def parser(program: str, description: str) -> ArgumentParser:
  """The arguments of an entry point that runs an experiment: `--exp`, `--smoke`, `--help` (the usage and
  every field of the experiment with its value) and `field.path=value` overrides; add the program's own."""
  command = ArgumentParser(prog=f"python -m {program}", description=description, add_help=False,
                         allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
  command.add_argument("-h", "--help", action="store_true",
                       help="show this usage and every config field's value")
  command.add_argument("--exp", nargs="?", const="", default=DEFAULT_EXPERIMENT, metavar="NAME",
                     help=f"the experiment (experiments/; default {DEFAULT_EXPERIMENT})")
  command.add_argument("--smoke", action="store_true",
                     help="the experiment (with the overrides) rehearsed at smoke-test size, keeping every "
                          "choice that selects code (experiments/smoke.py); the overrides are applied to "
                          "it again")
  command.add_argument("overrides", nargs="*", metavar="field.path=value",
                       help="config overrides; later wins")
  return command


def usage(command: argparse.ArgumentParser, config: ExperimentConfig) -> str:
  """`command`'s help, then every field of `config` with its value."""
  fields = [f"  {path} = {value!r}" for path, (_, value) in overrides.field_paths(config).items()]
  return "\n".join([command.format_help(), f"fields of {config.name}:", *fields])


def resolve(argv: list[str], command: argparse.ArgumentParser | None = None
            ) -> tuple[ExperimentConfig, argparse.Namespace]:
  """Parses `argv` with `command` (default: `parser`'s for `make train`) into a validated config and the
  parsed arguments. An option the parser does not know is an override (`--algo.eps-high=0.3`), in its
  place among the others."""
  args, unknown = (command or parser("vapo_jax.cli.train", "")).parse_known_intermixed_args(argv)
  if not args.exp:
    raise ConfigError(f"--exp needs an experiment name, e.g. --exp {DEFAULT_EXPERIMENT} (make train EXP=...)")
  config = experiments.get_experiment(args.exp)
  changes = sorted(args.overrides + unknown, key=argv.index)
  if not args.smoke:
    return overrides.apply_overrides(config, changes), args
  args.full_run, again = full_run(config, changes)  # The run the smoke rehearses (`smoke.rehearsal_table`).
  return overrides.apply_overrides(smoke(args.full_run), again), args


def full_run(config: ExperimentConfig, changes: list[str]) -> tuple[ExperimentConfig, list[str]]:
  """What `--smoke` shrinks, and the overrides to apply to the smoke: the experiment with the overrides and
  those of the fields the smoke does not derive from it (`smoke.DERIVED`), or, where the overrides fit only
  the smoke's sizes, the experiment and every override."""
  try:
    full = overrides.apply_overrides(config, changes)
  except ConfigError:
    return config, changes
  return full, [c for c in changes if c.split("=", 1)[0].lstrip("-").replace("-", "_") not in DERIVED]


def write_resolved_config(config: ExperimentConfig) -> str:
  """Writes `<run_dir>/<name>/config.json` (atomically) and returns the run directory."""
  run_dir = config.run_directory
  with files.reporting_write_failures(run_dir, "writing config.json"):
    os.makedirs(run_dir, exist_ok=True)
    files.write_atomically(os.path.join(run_dir, "config.json"),
                           json.dumps(dataclasses.asdict(config), indent=2))
  return run_dir
