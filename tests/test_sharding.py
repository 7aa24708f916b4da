"""Sharding presets on 8 CPU devices: golden PartitionSpecs and sharded == single-device logits.

Regenerate the golden files after a deliberate change with `UPDATE_GOLDEN=1 make test`.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import MESHES, place_module
from model_utils import SHARDED_CFG as CFG
from vapo_jax.models import sharding
from vapo_jax.models.transformer import CausalLM, ValueModel, positions_from_mask

GOLDEN = pathlib.Path(__file__).parent / "golden"
# Distinct sizes that every preset below divides (vocab 262 = 2·131).


def scaled_model(cls=CausalLM):
  """A model whose parameters are large enough that a dropped term changes the output visibly."""
  model = cls(CFG, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  state = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), state)
  return nnx.merge(graphdef, state)


def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, (8, 11))
  mask = np.ones_like(tokens)
  mask[::2, :4] = 0  # Left padding on half the rows.
  return jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask)


@pytest.mark.parametrize("name", [n if n == "fsdp" else pytest.param(n, marks=pytest.mark.slow) for n in MESHES])
def test_golden_partition_specs(name):  # fsdp (the aime preset) in make test; the others in make test-slow.
  mesh = sharding.make_mesh(**MESHES[name])
  model = sharding.create_sharded(lambda: CausalLM(CFG, rngs=nnx.Rngs(0)), mesh, sharding.PRESETS[name])
  actual = {".".join(map(str, p)): str(v.get_value().sharding.spec)
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  path = GOLDEN / f"sharding_{name}.json"
  if os.environ.get("UPDATE_GOLDEN"):
    path.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
  assert actual == json.loads(path.read_text())


def test_create_sharded_equals_eager_init():
  mesh = sharding.make_mesh(data=2, fsdp=4)
  sharded = sharding.create_sharded(lambda: CausalLM(CFG, rngs=nnx.Rngs(0)), mesh, sharding.PRESETS["fsdp"])
  eager = CausalLM(CFG, rngs=nnx.Rngs(0))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(eager))):
    np.testing.assert_allclose(a.get_value(), b.get_value(), rtol=1e-6, atol=1e-9, err_msg=str(path))
  kernel = sharded.model.layers.mlp.gate_proj[...]  # [L, D, F]: the layer axis never split.
  assert kernel.addressable_shards[0].data.shape == (CFG.num_layers, CFG.hidden_size // 4, CFG.intermediate_size)


# The value model on one mesh in make test (its head is the one difference), on the others in make test-slow; the
# policy on the meshes the experiments ship (dp: tiny; fsdp: math; fsdp_tp: aime) in make test, on tp in make
# test-slow, for time (each preset's split of every weight: test_golden_partition_specs).
@pytest.mark.parametrize("name, cls", [pytest.param(n, CausalLM, marks=pytest.mark.slow if n == "tp" else ())
                                       for n in MESHES] + [
    pytest.param(n, ValueModel, marks=() if n == "fsdp_tp" else pytest.mark.slow) for n in MESHES])
def test_sharded_forward_equals_single_device(name, cls):
  model = scaled_model(cls)
  tokens, positions, mask = batch()
  forward = lambda m, *a: m(*a)[0]
  expected = jax.jit(forward)(model, tokens, positions, mask)
  mesh = sharding.make_mesh(**MESHES[name])
  rules = sharding.PRESETS[name]
  sharded_model = place_module(model, mesh, rules)
  data = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  with sharding.use_rules(mesh, rules):
    out = jax.jit(forward)(sharded_model, *(jax.device_put(x, data) for x in (tokens, positions, mask)))
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_make_mesh_errors():
  with pytest.raises(ValueError, match="need 16 devices, but 8 are available"):
    sharding.make_mesh(data=4, fsdp=4)
  with pytest.raises(ValueError, match="8 devices cannot be split"):
    sharding.make_mesh(data=-1, fsdp=3)
  assert sharding.make_mesh(fsdp=4, data=-1).shape == {"data": 2, "fsdp": 4, "tensor": 1}


def test_indivisible_axis_is_replicated_with_a_warning():
  with pytest.warns(UserWarning, match="'kv_heads' of size 2 is not divisible"):
    spec = sharding.partition_spec(("embed", "kv_heads", "head_dim"), sharding.PRESETS["fsdp_tp"],
                                   {"data": 1, "fsdp": 2, "tensor": 4}, (48, 2, 8))
  assert spec == jax.sharding.PartitionSpec("fsdp")
