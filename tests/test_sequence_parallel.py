"""Sequence parallelism under `fsdp_tp` on 8 CPU devices: the residual stream between the decoder's blocks is
split along the sequence over the tensor axis ("act_seq", models/sharding.py), the forward pass is the
single-device one, and the log-probs gather the hidden states once before their loop over vocabulary blocks
(a split hidden would otherwise be gathered, and its gradient reduced, at every block)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from model_utils import MESHES, place_module
from model_utils import SHARDED_CFG as CFG
from vapo_jax.memory import hlo, topologies
from vapo_jax.models import logprobs as lp
from vapo_jax.models import sharding
from vapo_jax.models.transformer import CausalLM, positions_from_mask


def _inputs(rows=8, length=16, seed=0, vocab=CFG.vocab_size):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32)
  mask = jnp.asarray(np.arange(length)[None] >= rng.integers(0, 4, (rows, 1)))
  return tokens, positions_from_mask(mask), mask


def test_the_residual_stream_is_split_along_the_sequence_over_tensor():
  """The backbone's hidden states come out split along the sequence over tensor (under `fsdp`, whose rules map no
  "act_seq", they are whole: tests/test_sharding.py), and equal the single device's."""
  model = CausalLM(CFG, rngs=nnx.Rngs(0))
  tokens, positions, mask = _inputs()
  hidden = lambda m, *a: m.hidden_states(*a)[0]
  mesh, rules = sharding.make_mesh(**MESHES["fsdp_tp"]), sharding.PRESETS["fsdp_tp"]
  rows = NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  with sharding.use_rules(mesh, rules):
    got = jax.jit(hidden)(place_module(model, mesh, rules), *(jax.device_put(x, rows) for x in
                                                               (tokens, positions, mask)))
  assert got.sharding.spec == PartitionSpec(("data", "fsdp"), "tensor")
  np.testing.assert_allclose(got, jax.jit(hidden)(model, tokens, positions, mask), atol=1e-5, rtol=1e-5)


def _log_probs_step(rows=8, length=24, response=16, chunk=1):
  """(model, tokens, mask, step, blocks, local): the gradient of a model's response log-probs, the vocabulary's
  blocks, and the float32 hidden states a device holds on MESHES["fsdp_tp"] (the batch split 4 ways)."""
  cfg = dataclasses.replace(CFG, vocab_size=256)  # Blocks of 16 columns: 8 on each device of tensor.
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  tokens, _, mask = _inputs(rows, length, vocab=cfg.vocab_size)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=(rows, response)), jnp.float32)
  loss = lambda m, tokens, mask: jnp.sum(weights * lp.response_logprobs(m, tokens, mask, response, chunk=chunk)[0])
  size = lp.blocks(cfg.vocab_size, response, chunk)
  local = rows // 4 * response * cfg.hidden_size * 4
  assert cfg.hidden_size * size * 4 < local  # A block's kernel gradient is smaller than that.
  return model, tokens, mask, lambda m, *a: nnx.grad(loss)(m, *a), -(-cfg.vocab_size // size), local


@pytest.mark.slow  # For time (10 s): make test holds the split's forward pass, and the loop's collectives on TPU.
def test_sharded_log_probs_of_a_split_hidden_equal_single_device():
  model, tokens, mask, step, _, _ = _log_probs_step()
  mesh, rules = sharding.make_mesh(**MESHES["fsdp_tp"]), sharding.PRESETS["fsdp_tp"]
  placed = NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  got = sharding.jit(step, mesh, rules)(place_module(model, mesh, rules),
                                        *(jax.device_put(x, placed) for x in (tokens, mask)))
  for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(jax.jit(step)(model, tokens, mask))):
    b = b.get_value()
    np.testing.assert_allclose(a.get_value(), b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9,
                               err_msg=str(path))


@pytest.mark.slow  # For time (11 s): a property of the compiled program's speed, not of its results.
@pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
def test_the_log_probs_gather_a_split_hidden_once_not_once_a_block_on_tpu():
  """Compiled for 8 v5p chips (the TPU compiler's passes, which the CPU's lack, move a loop's reduction out of
  it): no collective inside the loops over vocabulary blocks moves as much as the hidden states a device holds
  (the hidden gathered and its gradient reduced once, not once a block)."""
  model, tokens, mask, step, blocks, local = _log_probs_step()
  devices = np.asarray(topologies.tpu("v5p:2x2x2").devices).reshape(2, 2, 2)
  mesh, rules = jax.sharding.Mesh(devices, sharding.MESH_AXES), sharding.PRESETS["fsdp_tp"]
  graphdef, state = sharding.abstract_sharded(lambda: model, mesh, rules)
  placed = NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed) for x in (tokens, mask)]
  with sharding.use_rules(mesh, rules), warnings.catch_warnings():
    warnings.filterwarnings("ignore", "attention: splash rejected")  # Rows of 24 tokens: the chunked attention.
    text = jax.jit(lambda s, *a: step(nnx.merge(graphdef, s), *a)).lower(state, *args).compile().as_text()
  in_loop = [c for c in hlo.collectives(text) if any(trips == blocks for _, trips in c.loops)]
  assert in_loop and not [c for c in in_loop if max(c.operand_bytes, c.result_bytes) >= local], in_loop


def test_a_sequence_the_tensor_axis_does_not_divide_stays_whole_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    spec = sharding.partition_spec(("batch", "act_seq", "embed"), sharding.PRESETS["fsdp_tp"],
                                   {"data": 2, "fsdp": 2, "tensor": 2}, (8, 13, 48))
  assert spec == PartitionSpec(("data", "fsdp"))
