"""The trainer's packed path refuses, in one line naming it, a sequence that it cannot score as padded rows
do: a response with no prompt token (a packed row predicts a response's first token from its prompt's last)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vapo_jax.config import AlgoConfig, ExperimentConfig, PackingConfig, RolloutConfig
from vapo_jax.config.sections import MeshConfig, ModelConfig
from vapo_jax.errors import DataError
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout.common import Rollout
from vapo_jax.train.state import TrainState
from vapo_jax.train.steps import Steps

B, TP, TR = 8, 8, 6  # Sequences, prompt bucket, response budget.


def _steps(packed: bool) -> Steps:
  config = ExperimentConfig(
      name="refusal", model=ModelConfig(preset="micro", dtype="float32", random_init=True),
      algo=AlgoConfig(mini_batch_responses=B, value_pretrain_steps=0), packing=PackingConfig(enabled=packed),
      rollout=RolloutConfig(prompts_per_step=B // 4, samples_per_prompt=4, max_prompt_tokens=TP,
                            max_response_tokens=TR),
      mesh=MeshConfig(preset="dp"))
  cfg = preset("micro")
  actor_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
  critic_def = nnx.graphdef(nnx.eval_shape(lambda: ValueModel(cfg, rngs=nnx.Rngs(1))))
  mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
  return Steps(config, mesh, sharding.PRESETS["dp"], actor_def=actor_def, critic_def=critic_def,
               actor_tx=None, critic_tx=None, sft_tx=None)


def _rollout(prompt_lengths, response_lengths) -> Rollout:
  """Left-padded prompts and right-padded responses of the given lengths (token ids 3)."""
  prompt_mask = np.arange(TP)[None] >= TP - np.asarray(prompt_lengths)[:, None]
  response_mask = np.arange(TR)[None] < np.asarray(response_lengths)[:, None]
  logprobs = jnp.zeros((B, TR), jnp.float32)
  return Rollout(jnp.asarray(3 * prompt_mask, jnp.int32), jnp.asarray(prompt_mask), jnp.asarray(3 * response_mask,
                 jnp.int32), jnp.asarray(response_mask), jnp.asarray(response_lengths, jnp.int32),
                 jnp.zeros(B, jnp.int32), logprobs, logprobs)


def test_the_packed_plan_refuses_a_response_with_no_prompt_token_in_one_line_naming_it():
  """Through `Steps.plan_packing` (the trainer's first packed step) with packing enabled: sequence 5 (prompt 0,
  response 3) is named in a one-line DataError; the same rollout with a prompt token there plans, and
  padded rows need no plan."""
  state = TrainState(None, None, None, None, key=jax.random.key(0))
  prompts, responses = np.array([4, 8, 2, 5, 1, 0, 7, 3]), np.array([6, 1, 3, 0, 2, 3, 5, 4])
  steps = _steps(packed=True)
  with pytest.raises(DataError, match=r"^sequence 5 of the batch \(1 in all\) has a response of 3 tokens and no "
                                      r"prompt token[^\n]*$"):
    steps.plan_packing(state, _rollout(prompts, responses))
  assert steps.plan_packing(state, _rollout(np.where(prompts == 0, 1, prompts), responses)) is not None
  assert _steps(packed=False).plan_packing(state, _rollout(prompts, responses)) is None
