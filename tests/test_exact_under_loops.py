"""Reports stay exact when the decoder layers are a scan (`model.scan_layers`), on a model small enough
that its unrolled program compiles too: the roofline's FLOPs count every layer (`step.every_layer`
equals the unrolled program's `cost_analysis`), and the compile report's largest reshard program writes the
largest rollout shard, a stacked `[L, ...]` parameter's, L layers of it, as the real rollout copy holds.
(The weight-collective check under scan needs TPU devices: `tests/test_compile_tpu.py`.)"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from vapo_jax.config import AlgoConfig, ExperimentConfig, RolloutConfig
from vapo_jax.config.sections import MeshConfig, ModelConfig
from vapo_jax.memory import topologies, xla_report
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM
from vapo_jax.rollout.layout import layout_for
from vapo_jax.roofline import step

SMALL = {"eval.path": None, "sft.steps": 0, "model.preset": "small"}  # 4 decoder layers.


@pytest.mark.slow  # For time (20 s): three compiles of the scoring program at four layers.
def test_every_layer_counts_the_scan_as_the_unrolled_program_does(smoke_config):
  """cost_analysis counts the layer scan's body once; r1 + (L − 1)(r2 − r1), r2 compiled with two layers
  per iteration, is the unrolled program's count (within 1 %), for the rollout's generate and scoring."""
  target = topologies.named("cpu:8")
  compile_run = lambda **model: xla_report.compile_run(
      smoke_config(SMALL | {f"model.{k}": v for k, v in model.items()}), target, phases=("scoring",))
  scanned, unrolled = compile_run(scan_layers=True), compile_run(scan_layers=False)
  twice = xla_report.compile_run(step.twice_unrolled(scanned.config), target, phases=("scoring",))
  assert scanned.architecture.num_layers == 4 and twice.config.model.scan_unroll == 2
  counted = step.every_layer(scanned, twice)
  for name in ("generate", "score"):
    want = unrolled.program(name).flops
    assert abs(counted.program(name).flops - want) <= 0.01 * want, (name, counted.program(name).flops, want)
    assert scanned.program(name).flops < 0.9 * want, name  # Uncorrected, three layers are missing.


def _layout_config(model: str) -> ExperimentConfig:
  return ExperimentConfig(
      name="reshard_test", model=ModelConfig(preset=model, dtype="bfloat16", random_init=True),
      algo=AlgoConfig(value_pretrain_steps=0, mini_batch_responses=128),
      rollout=RolloutConfig(prompts_per_step=16, samples_per_prompt=8, max_prompt_tokens=32, max_response_tokens=992,
                            engine="refill", tensor_parallel=2),
      mesh=MeshConfig(preset="fsdp", data=2, fsdp=4))


def test_the_reshard_in_flight_is_the_largest_shard_of_a_stacked_parameter():
  """The reshard moves one array at a time; the largest is a stacked decoder-layer parameter, L layers of
  it (the `small` model: its MLP kernels, 4 x 128 x 176 per chip in the tensor-parallel layout): XLA's output
  of the largest reshard program is the largest of the real rollout copy's shards on a chip."""
  shape = {"data": 2, "fsdp": 4, "tensor": 1}
  config, cfg = _layout_config("small"), preset("small")
  mesh, rules = sharding.make_mesh(**shape), sharding.PRESETS["fsdp"]
  layout = layout_for(config.rollout, mesh, compute_dtype="bfloat16", training_rules=rules)
  copy = layout.reshard(nnx.state(sharding.create_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)))
  device = jax.devices()[0]
  shards = [s.data.nbytes for x in jax.tree.leaves(copy) for s in x.addressable_shards if s.device == device]
  report = xla_report.compile_run(config, topologies.named("cpu:8"), phases=("reshard",))
  assert [p.name for p in report.phases] == ["reshard"] and report.mesh_shape == shape
  in_flight = max(p.memory.outputs for p in report.phases[0].programs)
  layer = cfg.hidden_size * cfg.intermediate_size // 2 * jnp.dtype(jnp.bfloat16).itemsize  # One layer's MLP shard.
  assert in_flight == max(shards) == cfg.num_layers * layer and cfg.num_layers == 4
  assert in_flight > cfg.vocab_size * cfg.hidden_size * 2  # Larger than the embedding: the stack governs.
