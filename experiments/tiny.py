"""The default experiment: VAPO on a tiny model, sized for a 2-core CPU.

  make train            (the same as `make train EXP=tiny`)

It runs exactly the code path of the 32B experiment with small numbers.
"""

from vapo_jax.config import (AlgoConfig, ExperimentConfig, MeshConfig, ModelConfig,
                             OptimizerConfig, RolloutConfig)


def tiny() -> ExperimentConfig:
  """VAPO with every technique on; tiny model, 8 prompts × 8 samples, 128-token responses."""
  return ExperimentConfig(
      name="tiny_vapo",
      rl_steps=40,
      model=ModelConfig(preset="tiny", dtype="float32", remat=False),
      algo=AlgoConfig(value_pretrain_steps=10, mini_batch_responses=32),
      optim=OptimizerConfig(actor_lr=3e-4, critic_lr=1e-3, warmup_steps=5),
      rollout=RolloutConfig(prompts_per_step=8, samples_per_prompt=8, max_prompt_tokens=64,
                            max_response_tokens=128),
      mesh=MeshConfig(preset="dp"),
  )
