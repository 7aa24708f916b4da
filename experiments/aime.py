"""The VAPO paper's setting (arXiv 2504.05118 §5) and its comparisons, on AIME 2024.

  make train EXP=aime ARGS="model.checkpoint=/path/to/Qwen2.5-32B"

Policy and critic start from a Qwen2.5-32B base checkpoint; training prompts are DAPO-Math-17k,
evaluation is AIME 2024 avg@32 at temperature 1.0, top-p 0.7. Reported there: VAPO 60.4,
DAPO 50, vanilla PPO 5; leaving out each technique in turn gives 11 / 33 / 45 / 46 / 53 / 54 / 55
(value pretraining, decoupled GAE, length-adaptive GAE, clip-higher, token-level loss,
positive-example LM loss, group sampling).

Data: the repository's own copies under data/ (found from the package, whatever the working
directory); pass `data.train_path=... eval.path=...` for others, e.g. the hub copy
`data.train_path=hf:BytedTsinghua-SIA/DAPO-Math-17k data.template=raw` (needs `datasets`).
"""

import dataclasses

from vapo_jax import paths
from vapo_jax.config import (AlgoConfig, DataConfig, EvalConfig, ExperimentConfig, MeshConfig, ModelConfig,
                             OptimizerConfig, RolloutConfig)

DAPO_MATH_17K = paths.data_path("dapo_math_17k/dapo_math_17k.parquet")
AIME_2024 = paths.data_path("aime24/qwen25math_aime24_test.jsonl")
MAX_RESPONSE_TOKENS = 20480


def vapo() -> ExperimentConfig:
  """VAPO with every technique on: the paper's main run (AIME 2024 avg@32 60.4)."""
  return ExperimentConfig(
      name="aime_vapo",
      rl_steps=5000,
      model=ModelConfig(checkpoint=None, preset="qwen2.5-32b", dtype="bfloat16", remat=True),
      algo=AlgoConfig(
          estimator="gae", gamma=1.0, lam_critic=1.0, decoupled_gae=True,
          length_adaptive_alpha=0.05, value_pretrain_steps=50, eps_low=0.2, eps_high=0.28,
          loss_agg="token-mean", positive_nll_coef=0.1, kl_coef=0.0, mini_batch_responses=512,
          micro_batch_responses=64,
      ),
      optim=OptimizerConfig(actor_lr=1e-6, critic_lr=2e-6, warmup_steps=10),
      # Generation in rounds of 32 prompts × 16 samples keeps the KV cache at 44 GiB per chip on
      # 256 chips (`make memory EXP=aime MESH=fsdp=64,tensor=4 DEVICE_GIB=95`).
      rollout=RolloutConfig(prompts_per_step=512, samples_per_prompt=16,
                            max_response_tokens=MAX_RESPONSE_TOKENS, temperature=1.0, top_p=1.0,
                            prompts_per_generation=32, kv_cache_budget_gib=60.0),
      # FSDP over the remaining devices × 4-way tensor parallelism (splits attention heads: a
      # 22528-token sequence's attention does not fit one chip otherwise); one sequence per chip.
      mesh=MeshConfig(preset="fsdp_tp", data=1, fsdp=-1, tensor=4),
      data=DataConfig(train_path=DAPO_MATH_17K),
      eval=EvalConfig(path=AIME_2024, samples_per_problem=32, temperature=1.0, top_p=0.7),
  )


def ppo() -> ExperimentConfig:
  """Vanilla PPO: λ=0.95 for actor and critic, ε=0.2, sequence-mean loss, one sample per prompt."""
  base = vapo()
  return dataclasses.replace(
      base, name="aime_ppo",
      algo=dataclasses.replace(
          base.algo, lam_actor=0.95, lam_critic=0.95, decoupled_gae=False, length_adaptive_alpha=None,
          value_pretrain_steps=0, eps_high=0.2, loss_agg="seq-mean-token-mean", positive_nll_coef=0.0),
      rollout=dataclasses.replace(base.rollout, prompts_per_step=8192, samples_per_prompt=1,
                                  prompts_per_generation=512),
  )


def grpo() -> ExperimentConfig:
  """GRPO: no critic, group-normalised outcome advantages, symmetric clip, k3 KL to the start."""
  base = vapo()
  return dataclasses.replace(
      base, name="aime_grpo",
      algo=dataclasses.replace(
          base.algo, estimator="group", value_pretrain_steps=0, eps_high=0.2,
          loss_agg="seq-mean-token-mean", positive_nll_coef=0.0, kl_coef=0.001, kl_estimator="k3"),
  )


def dapo() -> ExperimentConfig:
  """DAPO: group advantages, clip-higher, token-mean, dynamic sampling, soft overlong penalty."""
  base = vapo()
  return dataclasses.replace(
      base, name="aime_dapo",
      algo=dataclasses.replace(
          base.algo, estimator="group", value_pretrain_steps=0, eps_high=0.28, loss_agg="token-mean",
          positive_nll_coef=0.0, dynamic_sampling=True, overlong_buffer_tokens=4096,
          overlong_penalty_factor=1.0),
  )


def baselines() -> dict[str, ExperimentConfig]:
  """The paper's comparison table: VAPO against vanilla PPO, GRPO and DAPO."""
  return {config.name: config for config in (vapo(), ppo(), grpo(), dapo())}


def ablations() -> dict[str, ExperimentConfig]:
  """VAPO with each of its seven techniques left out in turn (the paper's Table 1 order)."""
  base = vapo()
  algo = lambda **kw: dataclasses.replace(base, algo=dataclasses.replace(base.algo, **kw))
  variants = {
      "no_value_pretraining": algo(value_pretrain_steps=0),
      "no_decoupled_gae": algo(decoupled_gae=False),
      "no_length_adaptive_gae": algo(length_adaptive_alpha=None),
      "no_clip_higher": algo(eps_high=base.algo.eps_low),
      "no_token_level_loss": algo(loss_agg="seq-mean-token-mean"),
      "no_positive_nll": algo(positive_nll_coef=0.0),
      "no_group_sampling": dataclasses.replace(
          base, rollout=dataclasses.replace(
              base.rollout, prompts_per_step=base.rollout.responses_per_step, samples_per_prompt=1)),
  }
  return {f"aime_vapo_{k}": dataclasses.replace(v, name=f"aime_vapo_{k}") for k, v in variants.items()}
