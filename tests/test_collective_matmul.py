"""Collective matmuls (`models/collective_matmul.py`, `mesh.collective_matmul`) on 8 CPU devices: the steps equal
the plain matmuls of the gathered input, forward and backward, against an oracle written from the definition (each
chunk of rows multiplied on its own; each device's share of the contraction summed over the group), in both forms
(a gather and a scatter; a block of both, its middle chunk by chunk); the decoder under
`fsdp_tp` with them computes the hidden states and gradients it computes without them, under `aime`'s remat policy
on packed rows; they run only where a tensor group splits the sequence. Compiled for v5p (skipped without libtpu),
the compiler issues each step's transfer asynchronously around a chunk's matmul, and the HLO walk prices what the
transfers overlap (`memory/overlap.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model_utils import MESHES, TP_CFG, place_module, training_layout_model
from test_remat import packed_rows, with_policy
from vapo_jax.config import MeshConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import hlo_walk, topologies
from vapo_jax.models import collective_matmul as cm
from vapo_jax.models import sharding

B, T, D, N, H, F = 4, 16, 8, 4, 3, 12  # T split 4 ways; N and F split 4 ways.


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, D), (D, N, H), (D, F), (F, D)))


def _oracle(x, q, g, dn, n=4):
  """From the definition, in float64: the gathered input's rows chunk by chunk through each kernel; the output
  projection as the sum over the n devices of each one's share of the contraction (F split n ways)."""
  x, q, g, dn = (np.asarray(a, np.float64) for a in (x, q, g, dn))
  chunk = T // n
  a, b = np.zeros((B, T, N, H)), np.zeros((B, T, F))
  for c in range(n):
    rows = slice(c * chunk, (c + 1) * chunk)
    a[:, rows] = np.einsum("btd,dnh->btnh", x[:, rows], q)
    b[:, rows] = np.einsum("btd,df->btf", x[:, rows], g)
  share = F // n
  y = sum(np.einsum("btf,fd->btd", np.tanh(b)[..., d * share:(d + 1) * share], dn[d * share:(d + 1) * share])
          for d in range(n))
  return a, b, y


def _steps(x, q, g, dn):
  axis = cm.active(x.shape[1], q.shape[1], g.shape[1])
  assert axis == "tensor"
  x = sharding.constrain(x, ("batch", "act_seq", "embed"))
  a, b = cm.gather_matmul(x, ("BTD,DNH->BTNH", q, ("embed", "heads", "head_dim")), ("BTD,DF->BTF", g, ("embed", "mlp")),
                          axis=axis)
  y = cm.matmul_scatter(jnp.tanh(b), "BTF,FD->BTD", dn, ("mlp", "embed"), axis=axis)
  down = ("BTF,FD->BTD", dn, ("mlp", "embed"))
  return a, b, y, cm.gather_map_scatter(x, [("BTD,DF->BTF", g, ("embed", "mlp"))], jnp.tanh, down, axis=axis)


def _plain(x, q, g, dn):
  a, b = jnp.einsum("BTD,DNH->BTNH", x, q), jnp.einsum("BTD,DF->BTF", x, g)
  y = jnp.einsum("BTF,FD->BTD", jnp.tanh(b), dn)
  return a, b, y, y


MESH = dict(data=1, fsdp=2, tensor=4)


def test_the_steps_equal_the_oracle_and_come_out_split_like_their_kernels():
  mesh, rules = sharding.make_mesh(**MESH), sharding.rules("fsdp_tp", collective_matmul=True)
  inputs = _inputs()
  with sharding.use_rules(mesh, rules):
    got = jax.jit(_steps)(*inputs)
  a, b, y = _oracle(*inputs)
  for found, want in zip(got, (a, b, y, y), strict=True):  # The block's two forms: the same sum.
    np.testing.assert_allclose(np.asarray(found), want, rtol=1e-5, atol=1e-5)
  assert [a.sharding.spec[1:3] for a in got] == [(None, "tensor"), (None, "tensor"), ("tensor",), ("tensor",)]


def test_their_gradients_are_the_plain_matmuls_gradients():
  mesh, rules = sharding.make_mesh(**MESH), sharding.rules("fsdp_tp", collective_matmul=True)
  inputs = _inputs(1)
  loss = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o)) for o in f(*a))
  with sharding.use_rules(mesh, rules):
    got = jax.jit(jax.grad(loss(_steps), argnums=(0, 1, 2, 3)))(*inputs)
  want = jax.jit(jax.grad(loss(_plain), argnums=(0, 1, 2, 3)))(*inputs)
  for a, b in zip(got, want, strict=True):
    scale = float(jnp.abs(b).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6 * scale)


# make test-slow, for time (9 s and 5 s: two programs each): make test holds the steps to the oracle; the option is
# off in every shipped experiment.
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_the_decoder_with_them_computes_its_gradients_without_them(policy):
  """`aime`'s policy (and `full`'s second forward through the rings) on packed rows: the logits and the gradients
  of a loss on them, with and without collective matmuls, within 1e-6 (float32): the logits each element, each
  gradient of its leaf's largest element (a weight's gradient sums its tokens chunk by chunk, float32 sums in
  another order)."""
  model, _, mesh, _ = training_layout_model(mesh_shape=MESHES["fsdp_tp"], scale=0.1)
  model = with_policy(model, policy)
  tokens, positions, segments = packed_rows(TP_CFG, rows=4, length=16)

  def loss(m):
    logits = m(tokens, positions, None, segment_ids=segments)[0]
    return jnp.sum(jnp.sin(logits)), logits

  found = {}
  for steps in (False, True):
    rules = sharding.rules("fsdp_tp", collective_matmul=steps)
    lowered = sharding.jit(nnx.value_and_grad(loss, has_aux=True), mesh, rules).lower(
        place_module(model, mesh, rules))
    assert ("collective_permute" in lowered.as_text()) == steps
    (_, logits), grads = lowered.compile()(place_module(model, mesh, rules))
    found[steps] = logits, grads
  np.testing.assert_allclose(np.asarray(found[True][0]), np.asarray(found[False][0]), rtol=1e-6, atol=1e-6)
  reference = jax.tree.leaves(found[False][1])
  for a, b in zip(jax.tree.leaves(found[True][1]), reference, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6 * float(jnp.abs(b).max()), rtol=1e-6)
  assert max(float(jnp.abs(g).max()) for g in reference) > 1e-3


def test_they_run_only_where_a_tensor_group_splits_the_sequence():
  with pytest.raises(ConfigError, match="collective_matmul needs a sequence split over tensor: mesh.preset=fsdp_tp"):
    MeshConfig(preset="fsdp", fsdp=8, collective_matmul=True)
  with pytest.raises(ConfigError, match="tensor 1"):
    MeshConfig(preset="fsdp_tp", fsdp=8, collective_matmul=True)
  assert MeshConfig(preset="fsdp_tp", fsdp=4, tensor=2, collective_matmul=True).collective_matmul
  mesh = sharding.make_mesh(**MESH)
  assert cm.active(16) is None  # Outside any rules.
  assert sharding.rules("fsdp", collective_matmul=True) == sharding.PRESETS["fsdp"]  # No sequence split.
  with sharding.use_rules(mesh, sharding.PRESETS["fsdp_tp"]):
    assert cm.active(16) is None  # Not asked for.
  with sharding.use_rules(mesh, sharding.rules("fsdp_tp", collective_matmul=True)):
    assert cm.active(16, 8, 12) == "tensor"
    assert cm.active(18) is None and cm.active(16, 6) is None  # The group of 4 divides neither.


@pytest.mark.slow  # For time (about 40 s: four compiles for v5p).
@pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
def test_compiled_for_v5p_each_transfer_overlaps_a_chunks_matmul():
  """An MLP block's steps over a tensor group of 4 v5p chips (bfloat16, 2,048 tokens a chip, width 4,096), as two
  calls and as one: every collective-permute is asynchronous; the walk finds the gather's three transfers (half
  the forward's) under the matmuls that run between their starts and dones (the compiler issues the scatter's
  three after its products, beside the sum that waits for them), and two thirds of the backward's."""
  mesh = jax.sharding.Mesh(np.array(topologies.named("v5p:2x2x1").devices).reshape(1, 1, 4), sharding.MESH_AXES)
  rules = sharding.rules("fsdp_tp", collective_matmul=True)
  on = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))
  x, gate, down = on((1, 8192, 4096), None, "tensor"), on((4096, 8192), None, "tensor"), on((8192, 4096), "tensor")

  def block(x, gate, down):
    h, = cm.gather_matmul(x, ("BTD,DF->BTF", gate, ("embed", "mlp")), axis="tensor")
    return cm.matmul_scatter(jax.nn.silu(h), "BTF,FD->BTD", down, ("mlp", "embed"), axis="tensor")

  def fused(x, gate, down):  # The decoder's MLP: its middle chunk by chunk.
    return cm.gather_map_scatter(x, [("BTD,DF->BTF", gate, ("embed", "mlp"))], jax.nn.silu,
                                 ("BTF,FD->BTD", down, ("mlp", "embed")), axis="tensor")

  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
  chip = topologies.CHIPS[topologies.named("v5p:2x2x1").devices[0].device_kind]
  for fn, share in ((block, 0.5), (jax.grad(loss(block), argnums=(0, 1, 2)), 2 / 3), (fused, 0.5),
                    (jax.grad(loss(fused), argnums=(0, 1, 2)), 2 / 3)):
    text = sharding.jit(fn, mesh, rules).lower(x, gate, down).compile().as_text()
    assert text.count("collective-permute-start(") == text.count("collective-permute-done(") > 0
    assert " collective-permute(" not in text  # None synchronous.
    walked = hlo_walk.walk(text, chip=chip)
    assert walked.collective_s > 0 and walked.hidden_s >= share * walked.collective_s * (1 - 1e-9)
    assert walked.hidden_cycles_s >= share * walked.collective_s * (1 - 1e-9)
