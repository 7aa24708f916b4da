"""The rows of the VAPO paper's comparison table, derived from any full-VAPO experiment.

Every experiment that compares methods (`aime`, `toy`) builds its baselines and leave-one-out
ablations here from its own VAPO config, so the rows differ from VAPO in the same fields at every
scale, each as one `dataclasses.replace`:

  ppo(base)    vanilla PPO: λ = 0.95 for actor and critic, symmetric clip, sequence-mean loss, no
               value pretraining, no NLL, one sample per prompt (as many responses per step)
  grpo(base)   no critic: group-normalised outcome advantages, symmetric clip, sequence-mean loss,
               k3 KL to the starting policy (β = 0.001, verl's GRPO example)
  dapo(base)   DAPO (Yu et al. 2025, arXiv 2503.14476) as verl's recipe runs it
               (recipe/dapo/run_dapo_qwen2.5_32b.sh): group advantages, clip-higher 0.2 / 0.28,
               token-mean loss, dynamic sampling (at most 10 generation rounds), soft overlong
               penalty over the last fifth of the response budget (4096 of 20480 tokens), dual clip
               c = 10 (`clip_ratio_c=10.0`), weight decay 0.1, no KL, no entropy bonus
  ablations(base)  VAPO with each technique left out in turn, in the paper's Table 1 order
  reward_model(base)  an outcome reward model of the base's starting policy (below); no RL

Critic initialisation. The paper's critics start from a reward model (VAPO §4.1: its bias toward
the last token is what value pretraining removes; PPO and "w/o value pretraining" keep it). A run
starts its critic from one with `model.critic_checkpoint=<dir>` (a Hugging Face directory whose
one-output `value_head` or `score` head becomes the value head), else from the policy's backbone
with a zero value head, which has no such bias. `reward_model(base)` makes one the paper's way: the
critic, started from the policy, fitted to the verifier's verdict (±1) on the last token of each
response alone, on samples of the starting policy (value pretraining with
`algo.value_pretrain_target="outcome"`), and exported to `<run>/critic_pretrained/`. With
`target="prefix"` it also fits prefixes of each response, each labelled with the verdict it gets read
as a finished response (no answer yet: incorrect), so that, like the paper's, it scores an unfinished
response as unfinished. The toy sweeps run it once and pass it to every member (`experiments/__init__.py`
SHARED_STAGES).

What is not changed: the model, data, learning rates, warm-up and evaluation are the base's, so a
difference between rows is the algorithm's. DAPO's warm-up (verl's recipe: 10 rollout steps; the
DAPO paper: 20) is left at the base's `optim.warmup_updates`.
"""

import dataclasses

from vapo_jax.config import ExperimentConfig
from vapo_jax.kinds import ValueTarget

# AIME 2024 avg@32 of each row in the VAPO paper (Qwen2.5-32B), by the row's name after its prefix.
# The paper has no GRPO row (the DAPO paper reports 30 for its GRPO baseline on the same model).
PAPER_AIME_2024 = {"vapo": 60.4, "ppo": 5.0, "dapo": 50.0, "vapo_no_value_pretraining": 11.0,
                   "vapo_no_decoupled_gae": 33.0, "vapo_no_length_adaptive_gae": 45.0, "vapo_no_clip_higher": 46.0,
                   "vapo_no_token_level_loss": 53.0, "vapo_no_positive_nll": 54.0, "vapo_no_group_sampling": 55.0}

# The paper's Table 1 order: value pretraining, decoupled GAE, length-adaptive GAE, clip-higher,
# token-level loss, positive-example LM loss, group sampling.
TECHNIQUES = ("value_pretraining", "decoupled_gae", "length_adaptive_gae", "clip_higher", "token_level_loss",
              "positive_nll", "group_sampling")


def _algo(base: ExperimentConfig, name: str, **changes) -> ExperimentConfig:
  return dataclasses.replace(base, name=name, algo=dataclasses.replace(base.algo, **changes))


def _one_sample_per_prompt(base: ExperimentConfig) -> ExperimentConfig:
  """As many responses per step, each from its own prompt (generation rounds of as many sequences)."""
  ro, g = base.rollout, base.rollout.samples_per_prompt
  rounds = None if ro.prompts_per_generation is None else ro.prompts_per_generation * g
  return dataclasses.replace(base, rollout=dataclasses.replace(
      ro, prompts_per_step=ro.responses_per_step, samples_per_prompt=1, prompts_per_generation=rounds))


def ppo(base: ExperimentConfig, *, name: str) -> ExperimentConfig:
  """Vanilla PPO through the same code (its critic from `model.critic_checkpoint`, see above)."""
  config = _algo(base, name, lam_actor=0.95, lam_critic=0.95, decoupled_gae=False, length_adaptive_alpha=None,
                 value_pretrain_steps=0, eps_high=base.algo.eps_low, loss_agg="seq-mean-token-mean",
                 positive_nll_coef=0.0)
  return _one_sample_per_prompt(config)


def grpo(base: ExperimentConfig, *, name: str) -> ExperimentConfig:
  """GRPO: no critic, group-normalised outcome advantages, symmetric clip, k3 KL to the start."""
  return _algo(base, name, estimator="group", value_pretrain_steps=0, eps_high=base.algo.eps_low,
               loss_agg="seq-mean-token-mean", positive_nll_coef=0.0, kl_coef=0.001, kl_estimator="k3")


def dapo(base: ExperimentConfig, *, name: str) -> ExperimentConfig:
  """DAPO with verl's recipe settings where they differ from VAPO's (see the module docstring)."""
  config = _algo(base, name, estimator="group", value_pretrain_steps=0, eps_low=0.2, eps_high=0.28,
                 loss_agg="token-mean", positive_nll_coef=0.0, kl_coef=0.0, entropy_coef=0.0, dual_clip=10.0,
                 dynamic_sampling=True, dynamic_sampling_max_rounds=10,
                 overlong_buffer_tokens=base.rollout.max_response_tokens // 5, overlong_penalty_factor=1.0)
  return dataclasses.replace(config, optim=dataclasses.replace(config.optim, weight_decay=0.1))


def baselines(base: ExperimentConfig, *, prefix: str) -> dict[str, ExperimentConfig]:
  """VAPO (the base, renamed `<prefix>_vapo`) against vanilla PPO, GRPO and DAPO."""
  configs = (dataclasses.replace(base, name=f"{prefix}_vapo"), ppo(base, name=f"{prefix}_ppo"),
             grpo(base, name=f"{prefix}_grpo"), dapo(base, name=f"{prefix}_dapo"))
  return {config.name: config for config in configs}


def ablations(base: ExperimentConfig, *, prefix: str) -> dict[str, ExperimentConfig]:
  """VAPO with each of its seven techniques left out in turn, named `<prefix>_vapo_no_<technique>`."""
  name = lambda technique: f"{prefix}_vapo_no_{technique}"
  variants = {
      "value_pretraining": _algo(base, name("value_pretraining"), value_pretrain_steps=0),
      "decoupled_gae": _algo(base, name("decoupled_gae"), decoupled_gae=False),
      "length_adaptive_gae": _algo(base, name("length_adaptive_gae"), length_adaptive_alpha=None),
      "clip_higher": _algo(base, name("clip_higher"), eps_high=base.algo.eps_low),
      "token_level_loss": _algo(base, name("token_level_loss"), loss_agg="seq-mean-token-mean"),
      "positive_nll": _algo(base, name("positive_nll"), positive_nll_coef=0.0),
      "group_sampling": _one_sample_per_prompt(dataclasses.replace(base, name=name("group_sampling"))),
  }
  assert tuple(variants) == TECHNIQUES
  return {config.name: config for config in variants.values()}


def reward_model(base: ExperimentConfig, *, name: str, steps: int, lr: float,
                 target: ValueTarget = "outcome") -> ExperimentConfig:
  """An outcome reward model (see the module docstring): `steps` critic-only steps of the base's
  rollouts at critic learning rate `lr`, the loss on each response's last token alone ("outcome"), or
  also on prefixes of it, each with the verdict it gets read as a finished response ("prefix"); no RL,
  no held-out evaluation, no policy export. Its critic is in `<run>/critic_pretrained/`."""
  algo = dataclasses.replace(base.algo, estimator="gae", value_pretrain_steps=steps, value_pretrain_target=target,
                             value_pretrain_patience=None)
  return dataclasses.replace(base, name=name, rl_steps=0, algo=algo,
                             optim=dataclasses.replace(base.optim, critic_lr=lr),
                             model=dataclasses.replace(base.model, critic_checkpoint=None),
                             eval=dataclasses.replace(base.eval, path=None),
                             checkpoint=dataclasses.replace(base.checkpoint, export_final=False))


def table(base: ExperimentConfig, *, prefix: str) -> dict[str, ExperimentConfig]:
  """The whole comparison: VAPO, PPO, GRPO, DAPO and the seven leave-one-out ablations (11 runs)."""
  return baselines(base, prefix=prefix) | ablations(base, prefix=prefix)


def paper_score(name: str) -> float | None:
  """The paper's AIME 2024 score of the row a member named `<prefix>_<row>` stands for, if it has one."""
  rows = sorted(PAPER_AIME_2024, key=len, reverse=True)  # "vapo_no_x" before "vapo".
  return next((PAPER_AIME_2024[row] for row in rows if name.endswith("_" + row) or name == row), None)
