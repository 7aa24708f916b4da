"""Configuration: every setting of a run, declared once, in frozen keyword-only dataclasses validated at
construction; no JAX is loaded by importing it.

The package, one module a part:
  checks      validation of a field: each failure one `ConfigError` naming the class, the field and the value
  sections    the run's surroundings: `ModelConfig`, `MeshConfig`, `PackingConfig`, `DataConfig`,
              `EvalConfig`, `CheckpointConfig`, `LogConfig`
  experiment  the algorithm and what it samples and learns from (`AlgoConfig`, `OptimizerConfig`,
              `RolloutConfig`, `RewardConfig`, `SFTConfig`) and `ExperimentConfig`, the run
  overrides   `field.path=value` overrides of any field (the one syntax, for the command line and the code)

The configs are re-exported here: `from vapo_jax.config import ExperimentConfig, MeshConfig`.
"""

from vapo_jax.config.experiment import (
                                        AlgoConfig,
                                        ExperimentConfig,
                                        OptimizerConfig,
                                        RewardConfig,
                                        RolloutConfig,
                                        SFTConfig,
)
from vapo_jax.config.sections import (
                                        CheckpointConfig,
                                        DataConfig,
                                        EvalConfig,
                                        LogConfig,
                                        MeshConfig,
                                        ModelConfig,
                                        PackingConfig,
)

__all__ = ["AlgoConfig", "CheckpointConfig", "DataConfig", "EvalConfig", "ExperimentConfig", "LogConfig",
           "MeshConfig", "ModelConfig", "OptimizerConfig", "PackingConfig", "RewardConfig", "RolloutConfig",
           "SFTConfig"]
