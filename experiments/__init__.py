"""Experiments by name: each is a function returning an `ExperimentConfig`; sweeps return a dict.

  make train EXP=<name> ARGS="field.path=value ..."
  make sweep SWEEP=<sweep> SEEDS=0,1,2          (every member of a sweep × seed: vapo_jax/cli/sweep.py)
"""

import sys
from collections.abc import Callable

from experiments import aime, one_host, tiny, toy
from vapo_jax.config import ExperimentConfig
from vapo_jax.config.checks import frozen, require
from vapo_jax.errors import ConfigError

EXPERIMENTS: dict[str, Callable[[], ExperimentConfig]] = {
    "tiny": tiny.tiny,
    "aime": aime.vapo,
    "aime_ppo": aime.ppo,
    "aime_grpo": aime.grpo,
    "aime_dapo": aime.dapo,
    "aime_reward_model": aime.reward_model,
    "math": one_host.vapo,
    "math_1.5b": one_host.vapo_1_5b,
    "toy": toy.vapo,
    "toy_vapo_paper_alpha": toy.paper_alpha,
    "toy_warm_start": toy.warm_start,
    "toy_reward_model": toy.reward_model,
    "toy_reward_model_prefix": toy.reward_model_prefix,
}

SWEEPS: dict[str, Callable[[], dict[str, ExperimentConfig]]] = {
    "aime_baselines": aime.baselines,
    "aime_ablations": aime.ablations,
    "math_baselines": one_host.baselines,
    "math_ablations": one_host.ablations,
    "toy": toy.table,
    "toy_mechanism": toy.mechanism,
    "toy_mechanism_prefix_critic": toy.mechanism_prefix_critic,
}
# Former sweep names, each still accepted (with a note) until the next release: `sweep_name`.
RENAMED_SWEEPS = {"toy_mechanism_v3": "toy_mechanism_prefix_critic"}


@frozen
class SharedStage:
  """A run that `make sweep` makes once (seed 0) before a sweep's members, and how every later run
  (a later stage, each member) starts from it: `<field>=<its run directory>/<output>` plus `overrides`."""

  experiment: str  # The experiment run once (EXPERIMENTS).
  output: str  # What the later runs take, relative to its run directory: "export", "critic_pretrained".
  field: str  # The later runs' field that points to it: "model.checkpoint", "model.critic_checkpoint".
  overrides: tuple[str, ...] = ()  # Further `field=value` overrides of the later runs ("sft.steps=0").

  def __post_init__(self):
    require(self.experiment in EXPERIMENTS, self, "experiment", "must be a registered experiment", self.experiment)
    require(all("=" in o for o in self.overrides), self, "overrides", "must look like field.path=value", self.overrides)


# The toy sweeps' shared stages, in order: the supervised warm start (every policy starts from it),
# then the outcome reward model fitted on its samples (every critic starts from it, as in the paper).
WARM_START = SharedStage(experiment="toy_warm_start", output="export", field="model.checkpoint",
                         overrides=("sft.steps=0",))
TOY_STAGES = (WARM_START,
              SharedStage(experiment="toy_reward_model", output="critic_pretrained", field="model.critic_checkpoint"))
# toy_mechanism_prefix_critic: the critics from the reward model fitted on prefixes too (the paper's bias).
TOY_PREFIX_STAGES = (WARM_START, SharedStage(experiment="toy_reward_model_prefix", output="critic_pretrained",
                                             field="model.critic_checkpoint"))
SHARED_STAGES: dict[str, tuple[SharedStage, ...]] = {"toy": TOY_STAGES, "toy_mechanism": TOY_STAGES,
                                                     "toy_mechanism_prefix_critic": TOY_PREFIX_STAGES}


def sweep_name(name: str) -> str:
  """The registered name of sweep `name`: itself, or what a former name (`RENAMED_SWEEPS`) is now called, with a
  note on stderr."""
  if name in RENAMED_SWEEPS:
    print(f"note: sweep {name!r} is now {RENAMED_SWEEPS[name]!r}; the old name works until the next release",
          file=sys.stderr)
  return RENAMED_SWEEPS.get(name, name)


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
