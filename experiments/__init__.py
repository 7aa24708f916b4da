"""Experiments by name: each is a function returning an `ExperimentConfig`; sweeps return a dict.

  make train EXP=<name> ARGS="field.path=value ..."
  make sweep SWEEP=<sweep> SEEDS=0,1,2          (every member of a sweep × seed: vapo_jax/sweep.py)
"""

from collections.abc import Callable

from experiments import aime, tiny, toy
from vapo_jax.config import ExperimentConfig
from vapo_jax.errors import ConfigError

EXPERIMENTS: dict[str, Callable[[], ExperimentConfig]] = {
    "tiny": tiny.tiny,
    "aime": aime.vapo,
    "aime_ppo": aime.ppo,
    "aime_grpo": aime.grpo,
    "aime_dapo": aime.dapo,
    "toy": toy.vapo,
    "toy_warm_start": toy.warm_start,
}

SWEEPS: dict[str, Callable[[], dict[str, ExperimentConfig]]] = {
    "aime_baselines": aime.baselines,
    "aime_ablations": aime.ablations,
    "toy": toy.table,
}

# A sweep's shared warm start: `make sweep` runs this experiment once per seed, before the members,
# and starts each member of that seed from its exported policy (vapo_jax/sweep.py).
WARM_STARTS: dict[str, str] = {"toy": "toy_warm_start"}


def get_experiment(name: str) -> ExperimentConfig:
  """The experiment registered as `name`, or the member `name` of a registered sweep."""
  if name in EXPERIMENTS:
    return EXPERIMENTS[name]()
  for sweep in SWEEPS.values():
    members = sweep()
    if name in members:
      return members[name]
  known = sorted(EXPERIMENTS) + sorted(n for s in SWEEPS.values() for n in s())
  raise ConfigError(f"unknown experiment {name!r}; known: {', '.join(known)}")
