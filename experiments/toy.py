"""A toy Table 1 on a 2-core CPU: VAPO, its baselines and its seven ablations on a task where the
length of the response varies over 10× within a batch and the reward is a sparse ±1 at the end.

  make train EXP=toy                          (one run: VAPO, seed 0)
  make sweep SWEEP=toy SEEDS=0,1,2            (11 members × 3 seeds → runs/sweeps/toy/)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2     (two runs at once)

Task ("chain", `vapo_jax/tasks.py`): add 2 to 20 one-digit numbers, writing the running total one
addition per line ("7+5+9=" → "7+5=12\\n12+9=21\\nAnswer: 21"): 17 to 172 tokens with the byte
tokenizer, uniform over the number of terms, and a single slip anywhere makes the answer wrong.
A short supervised warm start on the same distribution leaves the policy clearly imperfect
(it adds most short chains right and few long ones); value pretraining fits the critic to it; RL
then trains on all lengths. Held-out: avg@4 on 64 problems every 10 RL steps.

Members (`experiments/variants.py`): `toy_vapo`, `toy_ppo`, `toy_grpo`, `toy_dapo` and
`toy_vapo_no_<technique>` for the seven techniques; any one runs alone with `make train EXP=<name>`.
"""

from experiments import variants
from vapo_jax.config import (AlgoConfig, CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig, MeshConfig,
                             ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig, SFTConfig)

TRAIN = "synthetic:chain?terms=2-20&count=4000&seed=0"
HELD_OUT = "synthetic:chain?terms=2-20&count=64&seed=1"
DEMONSTRATIONS = "synthetic:chain?terms=2-20&count=2000&seed=2"


def vapo() -> ExperimentConfig:
  """VAPO, every technique on: byte-level `small` model, 8 prompts × 8 samples, ≤ 224-token responses."""
  return ExperimentConfig(
      name="toy_vapo",
      rl_steps=40,
      model=ModelConfig(preset="small", dtype="float32", remat=False, tokenizer="bytes", random_init=True),
      # α scaled to 17-172-token responses (the paper's 0.05 targets thousands of tokens):
      # λ_actor = 1 − 1/l, from 0.94 to 0.994 here.
      algo=AlgoConfig(value_pretrain_steps=10, mini_batch_responses=32, length_adaptive_alpha=1.0),
      optim=OptimizerConfig(actor_lr=5e-5, critic_lr=1e-3, warmup_updates=5, weight_decay=0.0),
      rollout=RolloutConfig(prompts_per_step=8, samples_per_prompt=8, max_prompt_tokens=48,
                            max_response_tokens=224),
      reward=RewardConfig(answer_forms=("answer_line",), verifier_workers=1),
      data=DataConfig(train_path=TRAIN, template="raw", chat_template=False),
      eval=EvalConfig(path=HELD_OUT, samples_per_problem=4, temperature=1.0, top_p=0.7, every_steps=10),
      sft=SFTConfig(path=DEMONSTRATIONS, steps=200, batch_size=32, lr=2e-3),
      mesh=MeshConfig(preset="dp"),
      checkpoint=CheckpointConfig(export_final=False),
  )


def table() -> dict[str, ExperimentConfig]:
  """The sweep: VAPO, PPO, GRPO, DAPO and the seven leave-one-out ablations."""
  return variants.table(vapo(), prefix="toy")
