"""Shared helpers for the model tests."""

import dataclasses
import pathlib

import jax
import numpy as np
from flax import nnx

from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "parity"
PARITY_MODELS = ("qwen2_untied", "qwen2_tied", "llama3")
# The sharding tests' model (a vocabulary that 8 devices split) and meshes, one per preset.
SHARDED_CFG = dataclasses.replace(preset("tiny"), vocab_size=262, num_layers=2)
MESHES = {"dp": dict(data=8), "fsdp": dict(data=2, fsdp=4), "fsdp_tp": dict(data=2, fsdp=2, tensor=2),
          "tp": dict(data=4, tensor=2)}
# The rollout-layout tests' model: 4 KV heads and a vocabulary that a tensor-parallel group of 4 splits.
TP_CFG = dataclasses.replace(preset("tiny"), num_heads=8, num_kv_heads=4, vocab_size=264, num_layers=2)
# The rollout tests' prompts (4 lengths, one of a single token) for the parity checkpoints, and their stop token.
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [40], [3, 3, 8, 21]]
EOS = 2


def reference(name: str) -> dict[str, np.ndarray]:
  with np.load(FIXTURES / name / "reference.npz") as f:
    return dict(f)


def place_module(module: nnx.Module, mesh, rules) -> nnx.Module:
  """A copy of an existing module with each parameter placed by its logical axes (the trainer creates or
  loads its models sharded from the start; tests shard one they already hold, to compare the two)."""
  graphdef, state = nnx.split(module)
  specs = sharding.state_partition_specs(state, rules, mesh)
  state = jax.tree.map(lambda v,
                       s: v.replace(jax.device_put(v.get_value(), jax.sharding.NamedSharding(mesh, s))),
                       state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def training_layout_model(cfg=TP_CFG, *, mesh_shape=None, scale: float = 0.3):
  """(unsharded model, the same parameters in the training layout `fsdp` on 8 devices, the mesh, the rules):
  random weights with `scale` added noise, so that a dropped term or a near-tie is visible."""
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  model = nnx.merge(graphdef,
                    jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), state))
  mesh, rules = sharding.make_mesh(**(mesh_shape or MESHES["fsdp"])), sharding.PRESETS["fsdp"]
  return model, place_module(model, mesh, rules), mesh, rules


def refill_plan(*, prompts: int, samples_per_prompt: int, prompt_tokens: int, max_response_tokens: int,
                slots: int, queue_pages: int, page_tokens: int, queues: int = 1, block_pages: int = 1,
                steps_per_call: int = 256,
                min_slots: int = 0, lanes: int = 4, prefill_chunk: int | None = None,
                attention: str = "gather"):
  """A refill `RolloutPlan` of these sizes as they are (no budget, no sizing: what a test's engine call takes)."""
  from vapo_jax.rollout.plan import RolloutPlan
  return RolloutPlan(engine="refill", prompts=prompts, samples_per_prompt=samples_per_prompt,
                     prompt_tokens=prompt_tokens,
                     max_response_tokens=max_response_tokens, devices=queues, prompts_per_round=prompts,
                     slots=slots,
                     queues=queues, min_slots=min_slots, steps_per_call=steps_per_call, pages=queue_pages,
                     queue_pages=queue_pages, page_tokens=page_tokens, block_pages=block_pages,
                     attention=attention, lanes=lanes, prefill_chunk=prefill_chunk or prompt_tokens)
