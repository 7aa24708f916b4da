"""The rollout layout (rollout/layout.py): the reshard round-trips the parameters bit for bit, one program
per array kind; tensor_parallel 1 is the training layout itself; the tensor groups are physical blocks;
the compiled decode loop holds no weight-sized collective (read by memory/hlo.py, tested on a module
written by hand)."""

import dataclasses
import itertools
import math
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import MESHES, TP_CFG, refill_plan, training_layout_model
from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import hlo
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM
from vapo_jax.rollout import common
from vapo_jax.rollout.layout import layout_for
from vapo_jax.rollout.refill import engine as refill

IS_VARIABLE = lambda x: isinstance(x, nnx.Variable)


def _layout(mesh, rules, tensor_parallel=4, compute_dtype="float32"):
  return layout_for(RolloutConfig(tensor_parallel=tensor_parallel), mesh, compute_dtype=compute_dtype,
                    training_rules=rules)


@pytest.fixture(scope="module")
def trained():
  """(unsharded model, the model in the training layout fsdp: data 2 x fsdp 4, mesh, rules)."""
  return training_layout_model()


def test_reshard_round_trips_the_parameters_bit_for_bit(trained):
  _, model, mesh, rules = trained
  state = nnx.state(model)
  layout = _layout(mesh, rules)
  assert dict(layout.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4} and layout.data_devices == 2
  assert list(layout.mesh.devices.flat) == list(mesh.devices.flat)  # The same devices, in the same order.
  moved = layout.reshard(state)
  for v, w in zip(jax.tree.leaves(state, is_leaf=IS_VARIABLE), jax.tree.leaves(moved, is_leaf=IS_VARIABLE)):
    x, y = v.get_value(), w.get_value()
    axes = v.get_metadata()["logical_axes"]
    assert y.sharding == jax.sharding.NamedSharding(layout.mesh,
                                                    sharding.partition_spec(axes, sharding.PRESETS["tp"],
                                                                                          layout.mesh.shape,
                                                                            x.shape))
    assert not x.is_deleted() and y.dtype == x.dtype  # Not donated; float32 stays float32.
    back = jax.device_put(y, x.sharding)
    assert back.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  kernel = moved["model"]["layers"]["mlp"]["gate_proj"].get_value()  # [L, D, F]: the layer axis never split.
  assert kernel.addressable_shards[0].data.shape == (TP_CFG.num_layers, TP_CFG.hidden_size,
                                                     TP_CFG.intermediate_size // 4)
  # Cast to the compute dtype on the way.
  half = _layout(mesh, rules, compute_dtype="bfloat16").reshard(state)
  for v, w in zip(jax.tree.leaves(state), jax.tree.leaves(half)):
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w), np.asarray(v.astype(jnp.bfloat16)))


def test_tensor_parallel_one_is_the_training_layout(trained):
  _, model, mesh, rules = trained
  state = nnx.state(model)
  layout = _layout(mesh, rules, tensor_parallel=1)
  assert layout.mesh is mesh and layout.rules is rules and layout.data_devices == 8
  assert layout.reshard(state) is state and layout.reshard_programs(state) == []  # No copy.
  tree = {"x": jnp.ones(8)}
  assert layout.to_training(tree) is tree


def test_one_reshard_program_per_array_kind_whatever_the_depth():
  mesh, rules = sharding.make_mesh(**MESHES["fsdp"]), sharding.PRESETS["fsdp"]
  layout = _layout(mesh, rules, compute_dtype="bfloat16")
  counts = []
  for layers in (2, 5):
    cfg = dataclasses.replace(TP_CFG, num_layers=layers)
    abstract = nnx.state(nnx.eval_shape(lambda: sharding.create_sharded(lambda: CausalLM(cfg,
                                                                                         rngs=nnx.Rngs(0)),
                                                                        mesh, rules)))
    kinds = {(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(abstract)}
    programs = layout.reshard_programs(abstract)
    assert len(programs) == len(kinds) < len(jax.tree.leaves(abstract))
    counts.append(len(programs))
  assert counts[0] == counts[1]
  for program, x in programs:  # Each lowers from its abstract input alone, without allocating it.
    compiled = program.lower(x).compile()
    assert compiled.output_shardings.mesh.shape == layout.mesh.shape


def test_layout_refuses_groups_that_do_not_divide(trained):
  _, _, mesh, rules = trained
  with pytest.raises(ConfigError, match=r"rollout.tensor_parallel=3 must divide the mesh's 8 devices: choose "
                                        r"one of "
                                        r"\[1, 2, 4, 8\]"):
    _layout(mesh, rules, tensor_parallel=3)
  with pytest.raises(ConfigError, match=r"rollout.tensor_parallel=4 must divide the model's 2 KV heads .* "
                                        r"choose one of \[1, 2\]"):
    _layout(mesh, rules).check_model(preset("tiny"))
  _layout(mesh, rules).check_model(TP_CFG)
  with pytest.raises(ConfigError, match=r"RolloutConfig.tensor_parallel must be an integer in \[1, "
                                        r"2147483647\]"):
    RolloutConfig(tensor_parallel=0)


def test_tensor_groups_are_physical_blocks_with_each_process_together():
  # A 4x4x4 torus whose hosts hold 2x2x1 chips, listed z, y, x (not in block order).
  chips = [types.SimpleNamespace(coords=(x, y, z), core_on_chip=0, process_index=z * 4 + y // 2 * 2 + x // 2)
           for z, y, x in itertools.product(range(4), repeat=3)]
  ordered = sharding.tensor_groups(chips, 8)
  assert sorted(map(id, ordered)) == sorted(map(id, chips))
  for g in range(0, 64, 8):
    coords = np.array([d.coords for d in ordered[g:g + 8]])
    assert np.all(coords.max(0) - coords.min(0) == 1) and np.all(coords.min(0) % 2 == 0)  # A 2x2x2 cube.
  processes = [d.process_index for d in ordered]
  assert len([p for p, _ in itertools.groupby(processes)]) == 16  # Each host's 4 chips next to each other.
  pairs = sharding.tensor_groups(chips, 2)
  assert all(np.abs(np.subtract(a.coords, b.coords)).sum() == 1 for a, b in zip(pairs[::2], pairs[1::2]))
  assert sharding.tensor_groups(chips, 1) == chips and sharding.tensor_groups(jax.devices(),
                                                                              4) == jax.devices()


def _decode_hlo(model, layout):
  """The refill decode program (8 slots: one per device, 4 per rollout group; 2 queues; prefill chunks of 2 lanes ×
  4 tokens, activations smaller than any weight) compiled in `layout`, and its plan."""
  tokens, mask = common.pad_prompts([[5, 6, 7], [9, 10], [40], [3, 3, 8, 21]] * 2, pad_id=0)
  chosen = refill_plan(prompts=8, samples_per_prompt=2, prompt_tokens=tokens.shape[1], max_response_tokens=4,
                       slots=8, queues=2,
                       steps_per_call=4, min_slots=2, queue_pages=12, page_tokens=16, lanes=2,
                       prefill_chunk=4)
  fns = refill.programs(chosen, sampling=common.Sampling(max_response_tokens=4, stop_token_ids=(2,)),
                        pad_id=0, cache_dtype=jnp.float32, jit=layout.jit)
  state = fns.start(model, *layout.place((tokens, mask)))
  return fns.decode.lower(model, state, layout.place(jax.random.key(0)), None).compile().as_text(), chosen


@pytest.mark.slow  # For time (12 s): make test checks the TPU decode's weight collectives (test_compile_tpu.py).
def test_decode_program_moves_no_weight_in_the_rollout_layout(trained):
  """Compiled on 8 CPU devices: in the rollout layout (data 2 x tensor 4) no collective moves as many bytes as
  the smallest weight, only `[rows, 1, D]` activations and the sampler's scalars. Decoding in the training
  layout (fsdp) gathers the weights (XLA:CPU hoists the gathers out of the loop; on a pod they are inside)."""
  _, model, mesh, rules = trained
  graphdef, state = nnx.split(model)
  kernels = [v for v in jax.tree.leaves(state, is_leaf=IS_VARIABLE) if v.get_value().ndim >= 2
             and "embed" in v.get_metadata()["logical_axes"]]  # Projections, embedding and output; not biases.
  # One layer's weight (a stacked parameter holds L of them), the embedding and output whole.
  per_layer = lambda v: v.get_value().nbytes // (TP_CFG.num_layers if "layers" in v.get_metadata()["logical_axes"]
                                                 else 1)
  smallest = min(map(per_layer, kernels))
  kernels = [v.get_value() for v in kernels]
  layout = _layout(mesh, rules)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rollout_hlo, chosen = _decode_hlo(nnx.merge(graphdef, layout.reshard(state)), layout)
    training_hlo, _ = _decode_hlo(model, _layout(mesh, rules, tensor_parallel=1))
  found = hlo.collectives(rollout_hlo)
  activation = 4 * TP_CFG.hidden_size * 4  # One reduction of a layer's output: 4 slots per group, float32.
  # The prefill in the loop reduces a chunk's: `[lanes, chunk, D]` of a queue (its embedding lookup, its layers).
  chunk = chosen.lanes * chosen.prefill_chunk * TP_CFG.hidden_size * 4
  # Nothing weight-sized; nor a refill's prompt cache or logits (one queue per group: with one queue for all,
  # XLA all-gathers every layer's prompt keys and values across the groups).
  assert found and max(max(c.operand_bytes, c.result_bytes) for c in found) <= max(2 * activation,
                                                                                   chunk) < smallest, (
      found, smallest)
  assert any(c.conditional and c.operand_bytes == chunk for c in found)  # The prefill, on refill steps only.
  loop = {c.loops[0][0] for c in found if c.loops}
  assert len(loop) == 1  # The decode while loop; the attention's block loops hold none.
  reductions = [c for c in found if c.loops and c.op == "all-reduce" and c.operand_bytes >= activation]
  runs = lambda c: math.prod(trips or 1 for _,
                             trips in c.loops[1:])  # Once per layer inside the layers' scan.
  assert sum(map(runs, reductions)) >= 2 * TP_CFG.num_layers  # Attention and MLP outputs of every layer.
  moved = [max(c.operand_bytes, c.result_bytes) for c in hlo.collectives(training_hlo)]
  assert max(moved) >= smallest and sum(moved) >= sum(x.size * x.dtype.itemsize for x in kernels) // 2


HAND_WRITTEN = """HloModule decode, entry_computation_layout={(f32[8,64]{1,0})->f32[8,64]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%body (carry: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %carry = (s32[], f32[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8,64]{1,0}) %carry), index=0
  %h = f32[8,64]{1,0} get-tuple-element((s32[], f32[8,64]{1,0}) %carry), index=1
  %both = (f32[8,64]{1,0}, s32[]) all-reduce(f32[8,64]{1,0} %h, s32[] %i), replica_groups={{0,1}}, to_apply=%add
  %ag = bf16[16,32]{1,0:T(8,128)(2,1)} all-gather-start(bf16[4,32]{1,0} %w), dimensions={0}
  %agd = bf16[16,32]{1,0} all-gather-done(bf16[16,32]{1,0} %ag)
  ROOT %out = (s32[], f32[8,64]{1,0}) tuple(s32[] %i, f32[8,64]{1,0} %h)
}

%cond (carry.1: (s32[], f32[8,64])) -> pred[] {
  %carry.1 = (s32[], f32[8,64]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (p: f32[8,64], w: bf16[4,32]) -> f32[8,64] {
  %p = f32[8,64]{1,0} parameter(0)
  %w = bf16[4,32]{1,0} parameter(1)
  %g = bf16[16,32]{1,0} all-gather(bf16[4,32]{1,0} %w), dimensions={0}, replica_groups=[2,4]<=[8]
  %init = (s32[], f32[8,64]{1,0}) tuple(s32[] %zero, f32[8,64]{1,0} %p)
  %loop = (s32[], f32[8,64]{1,0}) while((s32[], f32[8,64]{1,0}) %init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"7"}}
  ROOT %r = f32[8,64]{1,0} get-tuple-element((s32[], f32[8,64]{1,0}) %loop), index=1
}
"""


def test_hlo_collectives_by_hand():
  """A tuple all-reduce (operands summed) and an async all-gather (counted once) inside a while loop of 7 known
  trips, and an all-gather outside it."""
  found = {c.name: c for c in hlo.collectives(HAND_WRITTEN)}
  assert set(found) == {"g", "both", "ag"}
  assert found["g"] == hlo.Collective("all-gather", "g", 4 * 32 * 2, 16 * 32 * 2, ("bf16[4,32]",), ())
  both = found["both"]
  assert (both.op, both.operand_bytes, both.result_bytes, both.loops) == ("all-reduce", 8 * 64 * 4 + 4,
                                                                          8 * 64 * 4,
                                                                           (("loop", 7),))
  assert both.shapes == ("f32[8,64]",
                         "s32[]") and found["ag"].op == "all-gather" and found["ag"].result_bytes == 1024
  assert hlo.bytes_per_iteration(list(found.values()), "loop") == 8 * 64 * 4 + 4 + 16 * 32 * 2
  assert hlo.arrays("(f32[2,3]{1,0}, pred[])") == [("f32", (2, 3), 24), ("pred", (), 1)]
