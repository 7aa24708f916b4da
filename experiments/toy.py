"""A toy Table 1 on a 2-core CPU: VAPO, its baselines and its seven ablations on a task where the
length of the response varies over 10× within a batch and the reward is a sparse ±1 at the end.

  make sweep SWEEP=toy_mechanism SEEDS=0,1 JOBS=2   (the mechanism check: 4 members × 2 seeds)
  make sweep SWEEP=toy_mechanism_prefix_critic SEEDS=0,1,2   (the check with the paper's bias: 3 × 3 seeds)
  make sweep SWEEP=toy SEEDS=0,1,2 JOBS=2           (the table: 11 members × 3 seeds → runs/sweeps/toy/)
  make train EXP=toy                                (one VAPO run, its critic from its own policy)

Task (`vapo_jax/data/tasks.py`, the tiny experiment's arithmetic with more terms): add 2 to 11
one-digit numbers step by step, each line adding the first two numbers and copying the rest
("7+5+9=" → "12+9\\n21\\nAnswer: 21"): 12 to 131 tokens with the byte tokenizer (mean 60), the
number of terms uniform, and a single slip anywhere makes the answer wrong.

Shared stages (`experiments/__init__.py` SHARED_STAGES, run once by `make sweep` before the members):
  `toy_warm_start`   1,000 supervised steps of 32 demonstrations (8,000 distinct), exported; every
                     run starts its policy from it (`model.checkpoint=`, `sft.steps=0`).
  `toy_reward_model` an outcome reward model of the warm start's samples (`variants.reward_model`);
                     every run starts its critic from it (`model.critic_checkpoint=`), as the
                     paper's do: PPO and "w/o value pretraining" keep its bias, VAPO and the other
                     ablations pretrain it away first (VAPO §4.1).
  `toy_reward_model_prefix`  the same, fitted on prefixes too (each labelled with its verdict read as a
                     finished response), so it scores unfinished responses low, as the paper's does;
                     `toy_mechanism_prefix_critic` starts its critics from it instead.

Evaluation: avg@4 on 256 held-out problems at 5 points of a run (before RL, every quarter, at the
end), none of them among the training or demonstration problems (`data.drop_eval_overlap`, from `tiny`;
the sweeps in docs/ name the setting they ran with), each with a key fixed by the seed and the step
(`train/held_out.evaluation_key`), the same for every member of that seed: their paired differences are
free of most evaluation noise.

The toy's knobs against the paper's:
  α. λ_actor = 1 − 1/(α·l) is scale-free: λ^l → e^(−1/α) and the horizon 1/(1 − λ) = α·l is a fixed
     fraction of the response whatever its length, so "scaling α to short responses" changes the
     regime rather than preserving it. At the paper's α = 0.05 the terminal reward reaches the first
     token directly with weight e^(−20) (and λ = 0 below 20 tokens): the actor's advantages come
     almost wholly from the critic. The toy's α = 1 gives e^(−1) ≈ 0.37 at every length, mostly
     Monte-Carlo advantages that a bad critic barely moves. The toy keeps α = 1 (its sweep is
     comparable with the first toy table) and runs `toy_vapo_paper_alpha` (α = 0.05) beside it.
  Learning rates. The critic's is 2× the actor's, as in the paper (1e-6 / 2e-6); the first toy
     table's 20× let the critic repair a bad start within a few updates.
  Updates per step. 16 (mini-batches of 8 of the 128 responses, one epoch), the paper's 8192 / 512;
     the first table's 4 rarely moved the ratio out of the clip range, so clip-higher could not act.
  Value pretraining: 20 steps (the paper: 50) from the reward model.
A history: with 8 prompts a step, or lr 1e-4 with mini-batches of 16 (8 updates), the first toy's
VAPO lost held-out accuracy (0.33 → 0.25) in 16 RL steps while PPO, GRPO and DAPO held it; the
first table's settings (16 prompts × 8, lr 5e-5, 4 updates, critic lr 1e-3) were chosen after that.

Members (`experiments/variants.py`): `toy_vapo`, `toy_ppo`, `toy_grpo`, `toy_dapo` and
`toy_vapo_no_<technique>` for the seven techniques; any one runs alone with `make train EXP=<name>`
(add `model.checkpoint=... sft.steps=0 model.critic_checkpoint=...` for the sweep's starts).
"""

import dataclasses

from experiments import tiny, variants
from vapo_jax.config import ExperimentConfig, overrides

TRAIN = "synthetic:arithmetic?terms=2-11&count=4000&seed=0"
HELD_OUT = "synthetic:arithmetic?terms=2-11&count=256&seed=1"
DEMONSTRATIONS = "synthetic:arithmetic?terms=2-11&count=8000&seed=2"
RL_STEPS = 100


def vapo() -> ExperimentConfig:
  """VAPO, every technique on: byte-level `small` model, 16 prompts × 8 samples, ≤ 176-token responses:
  `tiny.tiny()` (its model, α = 1, sampling, learning rates but the critic's, evaluation settings) on
  the longer task, with more value pretraining and supervised steps."""
  return overrides.replace_fields(tiny.tiny(), {
      "name": "toy_vapo", "rl_steps": RL_STEPS,
      # α = 1: see the module docstring (toy_vapo_paper_alpha runs the paper's 0.05). 16 updates per step.
      "algo.value_pretrain_steps": 20, "algo.mini_batch_responses": 8, "optim.critic_lr": 1e-4,
      "optim.actor_lr": 5e-5,  # The toy tables' (tiny's own is 1e-4 since its retuning).
      "mesh.cpu_devices": None,  # The toy tables' one CPU device (tiny's own is 2 since its retuning).
      # 176 tokens: room above the longest solution (131) for DAPO's overlong buffer (the last 35).
      "rollout.max_response_tokens": 176, "reward.verifier_workers": 1,
      "data.train_path": TRAIN, "eval.path": HELD_OUT, "eval.every_steps": RL_STEPS // 4,
      "sft.path": DEMONSTRATIONS, "sft.steps": 1000, "checkpoint.export_final": False})


def paper_alpha() -> ExperimentConfig:
  """VAPO at the paper's α = 0.05: λ_actor = 0 below 20 tokens, 0.85 at the longest (131)."""
  base = vapo()
  return dataclasses.replace(base, name="toy_vapo_paper_alpha",
                             algo=dataclasses.replace(base.algo, length_adaptive_alpha=0.05))


def table() -> dict[str, ExperimentConfig]:
  """The sweep: VAPO, PPO, GRPO, DAPO and the seven leave-one-out ablations."""
  return variants.table(vapo(), prefix="toy")


def mechanism() -> dict[str, ExperimentConfig]:
  """The mechanism check: does the reward-model start show the paper's signature (early-token
  advantages off, lengths collapsing) where value pretraining is missing, at either α?"""
  rows = table()
  return {config.name: config for config in (rows["toy_vapo"], paper_alpha(), rows["toy_ppo"],
                                             rows["toy_vapo_no_value_pretraining"])}


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


def reward_model_prefix() -> ExperimentConfig:
  """`reward_model()` that has also learned "unfinished is not correct": the same warm start, samples
  (seed 0's keys), steps and learning rate, the loss also on `algo.value_pretrain_prefixes` (4) prefixes
  of each response, uniform over its length, each labelled with the reward it gets read as a finished
  response (no answer yet: −1). The critic of `mechanism_prefix_critic`'s members."""
  return variants.reward_model(vapo(), name="toy_reward_model_prefix", steps=40, lr=1e-3, target="prefix")


def mechanism_prefix_critic() -> dict[str, ExperimentConfig]:
  """The mechanism check with the paper's bias: PPO, VAPO without value pretraining and VAPO, every critic
  from `toy_reward_model_prefix` (VAPO's value pretraining starts from it too), the v2 settings otherwise.
  Does a critic that under-estimates the first tokens turn early advantages positive and collapse
  lengths or accuracy where value pretraining is missing?"""
  rows = table()
  return {name: rows[name] for name in ("toy_vapo", "toy_ppo", "toy_vapo_no_value_pretraining")}


def reward_model() -> ExperimentConfig:
  """The outcome reward model every member's critic starts from: 40 steps of 128 samples of the warm
  start (sampled at the rollout temperature, 1.0), 16 updates each at lr 1e-3 on the last token's
  verdict (`variants.reward_model`). Started by the sweep from the warm start's export."""
  return variants.reward_model(vapo(), name="toy_reward_model", steps=40, lr=1e-3)
