"""A toy Table 1 on a 2-core CPU: VAPO, its baselines and its seven ablations on a task where the
length of the response varies over 10× within a batch and the reward is a sparse ±1 at the end.

  make train EXP=toy                          (one run: VAPO, seed 0)
  make sweep SWEEP=toy SEEDS=0,1,2            (11 members × 3 seeds → runs/sweeps/toy/)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2     (two runs at once)

Task (`vapo_jax/tasks.py`, the tiny experiment's arithmetic with more terms): add 2 to 11 one-digit
numbers step by step, each line adding the first two numbers and copying the rest
("7+5+9=" → "12+9\n21\nAnswer: 21"): 12 to 131 tokens with the byte tokenizer (mean 60), the
number of terms uniform, and a single slip anywhere makes the answer wrong. Held-out: avg@4 on 64
problems before RL, after 8 RL steps and at the end.

Warm start (`toy_warm_start`, run once by `make sweep SWEEP=toy` and shared by every run): 1,000
supervised steps of 32 demonstrations (8,000 distinct), NLL per token 5.6 → 0.15, held-out 0.33
(0.30 with other sampling keys: the evaluation's noise is about ±0.03), 28 min while the test suite
shared the machine. Clearly imperfect: long problems fail most.

Sizing (seed 0, from that warm start, 16 RL steps, two runs at once on the 2 cores):
  8 prompts × 8, lr 1e-4, mini-batches of 16, 5 value pretraining steps: VAPO 0.33 → 0.25 with its
    entropy rising, while PPO (0.35), GRPO (0.34) and DAPO (0.34) held; lr 5e-5 and mini-batches of
    32 alone: VAPO → 0.25 again;
  16 prompts × 8, lr 5e-5, mini-batches of 32, 10 value pretraining steps (below): VAPO 0.30 → 0.34
    (step 8) → 0.35, training accuracy 0.23 → 0.27 by quarters, entropy flat; 490-670 s a run with two at
    once, so the 33-run sweep takes about 2.5 hours with JOBS=2 (seed 0's 11 runs: README).

Members (`experiments/variants.py`): `toy_vapo`, `toy_ppo`, `toy_grpo`, `toy_dapo` and
`toy_vapo_no_<technique>` for the seven techniques; any one runs alone with `make train EXP=<name>`.
"""

import dataclasses

from experiments import variants
from vapo_jax.config import AlgoConfig, ExperimentConfig, OptimizerConfig, RewardConfig, RolloutConfig, SFTConfig
from vapo_jax.run_config import CheckpointConfig, DataConfig, EvalConfig, MeshConfig, ModelConfig

TRAIN = "synthetic:arithmetic?terms=2-11&count=4000&seed=0"
HELD_OUT = "synthetic:arithmetic?terms=2-11&count=64&seed=1"
DEMONSTRATIONS = "synthetic:arithmetic?terms=2-11&count=8000&seed=2"


def vapo() -> ExperimentConfig:
  """VAPO, every technique on: byte-level `small` model, 16 prompts × 8 samples, ≤ 176-token responses."""
  return ExperimentConfig(
      name="toy_vapo",
      rl_steps=16,
      model=ModelConfig(preset="small", dtype="float32", remat=False, tokenizer="bytes", random_init=True),
      # α scaled to 12-131-token responses (the paper's 0.05 targets thousands of tokens):
      # λ_actor = 1 − 1/l, from 0.92 to 0.99 here.
      # The tiny experiment's RL settings (4 updates of 32 responses per step, lr 5e-5, 10 value
      # pretraining steps). With 8 prompts a step, or lr 1e-4 and mini-batches of 16, VAPO lost
      # held-out accuracy here (0.33 → 0.25) while PPO, GRPO and DAPO held it (see the docstring).
      algo=AlgoConfig(value_pretrain_steps=10, mini_batch_responses=32, length_adaptive_alpha=1.0),
      optim=OptimizerConfig(actor_lr=5e-5, critic_lr=1e-3, warmup_updates=5, weight_decay=0.0),
      # 176 tokens: room above the longest solution (131) for DAPO's overlong buffer (the last 35).
      rollout=RolloutConfig(prompts_per_step=16, samples_per_prompt=8, max_prompt_tokens=32,
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
  """The supervised warm start alone, exported for the members: `make sweep SWEEP=toy` runs it once and
  starts every run from its policy (`model.checkpoint=`, `sft.steps=0`), as every row of the paper
  starts from the same base model. Only its model, data, SFT and seed fields act (no RL step runs):
  the RL fields it carries from `vapo()` (recorded in its config.json as they were) change nothing."""
  base = vapo()
  return dataclasses.replace(base, name="toy_warm_start", rl_steps=0,
                             algo=dataclasses.replace(base.algo, value_pretrain_steps=0),
                             eval=dataclasses.replace(base.eval, path=None),  # The members evaluate it before RL.
                             checkpoint=dataclasses.replace(base.checkpoint, export_final=True))
