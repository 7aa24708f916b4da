"""`smoke(config)`: any experiment at smoke-test size, for tests and a first look on a laptop.

  python -m vapo_jax.cli.train --exp aime_dapo --smoke        (big_vision's `runlocal`, for any config)

A one-layer model from random weights, the byte tokenizer, synthetic arithmetic, 8 prompts of
16-token responses and at most two steps of each stage that the experiment has (and a held-out
evaluation where it has one). Everything else (the algorithm, the stages, the mesh preset's code
path) is the experiment's own: the same program as the full run, with small numbers.
"""

import dataclasses
import math

from vapo_jax.config import ExperimentConfig
from vapo_jax.models.config import preset

TRAIN = "synthetic:arithmetic?terms=2-3&count=200&seed=0"
EVAL = "synthetic:arithmetic?terms=2-3&count=8&seed=1"
SFT = "synthetic:arithmetic?terms=2-3&count=50&seed=2"


def smoke(config: ExperimentConfig) -> ExperimentConfig:
  """`config` shrunk to run in seconds on a CPU."""
  replace = dataclasses.replace
  group = 4 if config.rollout.samples_per_prompt > 1 else 1
  return replace(
      config, rl_steps=min(config.rl_steps, 2),
      model=replace(config.model, preset="micro", dtype="float32", remat=False, tokenizer="bytes", random_init=True,
                    checkpoint=None, critic_checkpoint=None),
      algo=replace(config.algo, value_pretrain_steps=min(config.algo.value_pretrain_steps, 1), mini_batch_responses=16,
                   micro_batch_responses=None,
                   dynamic_sampling_max_rounds=min(config.algo.dynamic_sampling_max_rounds, 1),
                   overlong_buffer_tokens=min(config.algo.overlong_buffer_tokens, 4)),
      optim=replace(config.optim, actor_lr=1e-3, critic_lr=3e-3, warmup_updates=0, weight_decay=0.0),
      # The rollout layout keeps tensor-parallel groups, of a size that splits the micro model's KV heads.
      rollout=replace(config.rollout, prompts_per_step=32 // group, samples_per_prompt=group, max_prompt_tokens=16,
                      max_response_tokens=16, prompts_per_generation=None,
                      tensor_parallel=math.gcd(config.rollout.tensor_parallel, preset("micro").num_kv_heads)),
      reward=replace(config.reward, answer_forms=("answer_line",), verifier_workers=1),
      data=replace(config.data, train_path=TRAIN, template="raw", chat_template=False),
      eval=replace(config.eval, path=EVAL if config.eval.path else None, samples_per_problem=2, every_steps=0,
                   max_problems=None),
      sft=replace(config.sft, path=SFT, steps=min(config.sft.steps, 2), batch_size=8, lr=1e-3),
      mesh=replace(config.mesh, preset="dp", data=-1, fsdp=1, tensor=1, device_memory_gib=None))
