"""A toy Table 1 on a 2-core CPU: VAPO, its baselines and its seven ablations on a task where the
length of the response varies over 10× within a batch and the reward is a sparse ±1 at the end.

  make train EXP=toy                          (one run: VAPO, seed 0)
  make sweep SWEEP=toy SEEDS=0,1,2            (11 members × 3 seeds → runs/sweeps/toy/)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2     (two runs at once)

Task (`vapo_jax/tasks.py`, the tiny experiment's arithmetic with more terms): add 2 to 11 one-digit
numbers step by step, each line adding the first two numbers and copying the rest
("7+5+9=" → "12+9\\n21\\nAnswer: 21"): 12 to 131 tokens with the byte tokenizer (mean 60), the
number of terms uniform, and a single slip anywhere makes the answer wrong. A short supervised warm
start on the same distribution leaves the policy clearly imperfect (long problems fail more);
value pretraining fits the critic to it; RL then trains on all lengths. Held-out: avg@4 on 64
problems every 10 RL steps.

Status: not yet sized. Measured once (seed 0, `toy_vapo`) on the shared 2-core machine under a
load of 7-10: 1918 s wall, 832 CPU-s (about 8-9 min on 2 idle cores, not 3), responses of 2 to 176
tokens within a batch (up to 23 % cut at 176), and no learning: held-out 0.035 before RL, 0.031
after. The warm start (150 × 16 demonstrations, NLL 1.0 per token) is too weak to give RL a
signal, and a stronger one costs more than the 3-minute budget per run: size this before running
`make sweep SWEEP=toy` (11 × 3 runs).

Members (`experiments/variants.py`): `toy_vapo`, `toy_ppo`, `toy_grpo`, `toy_dapo` and
`toy_vapo_no_<technique>` for the seven techniques; any one runs alone with `make train EXP=<name>`.
"""

import dataclasses

from experiments import variants
from vapo_jax.config import (AlgoConfig, CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig, MeshConfig,
                             ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig, SFTConfig)

TRAIN = "synthetic:arithmetic?terms=2-11&count=4000&seed=0"
HELD_OUT = "synthetic:arithmetic?terms=2-11&count=64&seed=1"
DEMONSTRATIONS = "synthetic:arithmetic?terms=2-11&count=8000&seed=2"


def vapo() -> ExperimentConfig:
  """VAPO, every technique on: byte-level `small` model, 8 prompts × 8 samples, ≤ 176-token responses."""
  return ExperimentConfig(
      name="toy_vapo",
      rl_steps=16,
      model=ModelConfig(preset="small", dtype="float32", remat=False, tokenizer="bytes", random_init=True),
      # α scaled to 12-131-token responses (the paper's 0.05 targets thousands of tokens):
      # λ_actor = 1 − 1/l, from 0.92 to 0.99 here.
      algo=AlgoConfig(value_pretrain_steps=5, mini_batch_responses=16, length_adaptive_alpha=1.0),
      optim=OptimizerConfig(actor_lr=1e-4, critic_lr=1e-3, warmup_updates=5, weight_decay=0.0),
      # 176 tokens: room above the longest solution (131) for DAPO's overlong buffer (the last 35).
      rollout=RolloutConfig(prompts_per_step=8, samples_per_prompt=8, max_prompt_tokens=32,
                            max_response_tokens=176),
      reward=RewardConfig(answer_forms=("answer_line",), verifier_workers=1),
      data=DataConfig(train_path=TRAIN, template="raw", chat_template=False),
      eval=EvalConfig(path=HELD_OUT, samples_per_problem=4, temperature=1.0, top_p=0.7, every_steps=8),
      sft=SFTConfig(path=DEMONSTRATIONS, steps=1000, batch_size=32, lr=2e-3),
      mesh=MeshConfig(preset="dp"),
      checkpoint=CheckpointConfig(export_final=False),
  )


def table() -> dict[str, ExperimentConfig]:
  """The sweep: VAPO, PPO, GRPO, DAPO and the seven leave-one-out ablations."""
  return variants.table(vapo(), prefix="toy")


def warm_start() -> ExperimentConfig:
  """The supervised warm start alone, exported for the members: `make sweep SWEEP=toy` runs it once per
  seed and starts that seed's 11 members from its policy (`model.checkpoint=`, `sft.steps=0`), as
  every row of the paper starts from the same base model."""
  base = vapo()
  return dataclasses.replace(base, name="toy_warm_start", rl_steps=0,
                             algo=dataclasses.replace(base.algo, value_pretrain_steps=0),
                             eval=dataclasses.replace(base.eval, path=None),  # The members evaluate it before RL.
                             checkpoint=dataclasses.replace(base.checkpoint, export_final=True))
