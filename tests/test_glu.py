"""The MLP's gated middle (`models/glu.py`): silu(gate) · up as `jax.nn.silu(gate) * up` gives it, and its gradient
against the definition differentiated numerically (central differences in float64, element by element), in float32
and in bfloat16 (each gradient within 2⁻⁷ of its size of the float64 one); compiled for
v5p, no weight gradient's fusion and no matmul making ∂(silu(gate) · up) takes an exponential (the TPU compiler
would compute the gradient again in each output tile's prologue, or in the epilogue of that matmul), which the
weight gradients do with the gradient that autodiff writes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from vapo_jax.memory import hlo, topologies
from vapo_jax.models import glu


def silu_times(g, u):  # The definition, in float64.
  return g / (1.0 + np.exp(-g)) * u


def numeric_gradients(g, u, d, h=1e-6):
  """∂/∂g and ∂/∂u of Σ d · silu(g) · u, one element at a time by central differences."""
  d_gate, d_up = np.zeros_like(g), np.zeros_like(u)
  for i in np.ndindex(g.shape):
    step = np.zeros_like(g)
    step[i] = h
    d_gate[i] = np.sum(d * (silu_times(g + step, u) - silu_times(g - step, u))) / (2 * h)
    d_up[i] = np.sum(d * (silu_times(g, u + step) - silu_times(g, u - step))) / (2 * h)
  return d_gate, d_up


def draws(dtype, seed=0, shape=(3, 7)):
  rng = np.random.default_rng(seed)
  g, u, d = (rng.normal(scale=3.0, size=shape) for _ in range(3))
  g[0, :4] = [0.0, -30.0, 30.0, 1e-3]  # σ's ends and its middle.
  cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float64 if jax.config.x64_enabled else jnp.float32))
  return tuple(jnp.asarray(a, dtype) for a in (g, u, d)), tuple(cast(a).astype(np.float64) for a in (g, u, d))


def test_value_is_silu_times_up():
  (g, u, _), _ = draws(jnp.bfloat16)
  for dtype in (jnp.float32, jnp.bfloat16):
    a, b = g.astype(dtype), u.astype(dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(glu.gated_silu)(a, b)), np.asarray(jax.jit(
        lambda a, b: jax.nn.silu(a) * b)(a, b)))


def test_gradients_in_float32_against_the_definition():
  (g, u, d), (g64, u64, d64) = draws(jnp.float32)
  _, vjp = jax.vjp(glu.gated_silu, g, u)
  d_gate, d_up = jax.jit(vjp)(d)
  want_gate, want_up = numeric_gradients(g64, u64, d64)
  np.testing.assert_allclose(np.asarray(d_gate), want_gate, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(d_up), want_up, rtol=1e-5, atol=1e-6)


def test_gradients_in_bfloat16_against_the_definition():
  (g, u, d), (g64, u64, d64) = draws(jnp.bfloat16, seed=1, shape=(4, 9))
  _, vjp = jax.vjp(glu.gated_silu, g, u)
  got = [np.asarray(a.astype(jnp.float32)) for a in jax.jit(vjp)(d)]
  for got_one, want in zip(got, numeric_gradients(g64, u64, d64)):
    ulp = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16).astype(jnp.float32))) * 2.0**-7
    np.testing.assert_array_less(np.abs(got_one - want), ulp + 1e-30)


@pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
def test_no_weight_gradient_computes_the_exponential_on_v5p():
  """An MLP's gradients compiled for one v5p chip: with `gated_silu` neither the weight gradients' matmul fusions
  nor the one making ∂(silu(gate) · up) hold an exponential; with autodiff's gradient of `jax.nn.silu(gate) * up`
  the weight gradients do (the test can fail)."""
  device = topologies.named("v5p:2x2x1").devices[0]
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))
  tokens, width, mlp = 2048, 512, 1024

  def exponentials_in_matmuls(middle):
    def loss(weights, x):
      gate, up, down = weights
      return jnp.sum((middle(x @ gate, x @ up) @ down).astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss)).lower((spec(width, mlp), spec(width, mlp), spec(mlp, width)),
                                         spec(tokens, width)).compile().as_text()
    _, computations, _ = hlo.parse(text)
    calls = lambda body: re.findall(r"calls=%?([\w.\-]+)", body)
    # (result type, called computation, body) of each fusion: the backward's are named "transpose(jvp(...))".
    fusions = [(kind, called, body) for rows in computations.values() for _, kind, opcode, body in rows
               if opcode == "fusion" for called in calls(body)[:1]]
    of_shape = lambda *shapes: [(name, body) for kind, name, body in fusions if kind.lstrip("(").startswith(shapes)]
    weight_shaped = [name for name, _ in of_shape(f"bf16[{width},{mlp}]", f"bf16[{mlp},{width}]")]
    # ∂(silu(gate) · up) = ∂out · downᵀ: `[tokens, mlp]` in the backward.
    middle = [name for name, body in of_shape(f"bf16[{tokens},{mlp}]") if "transpose(" in body]

    def holds(name, seen=()):  # An exponential in the computation or in the fusions it calls.
      rows = computations.get(name, [])
      return any(opcode == "exponential" for _, _, opcode, _ in rows) or any(
          holds(c, seen + (c,)) for _, _, _, body in rows for c in calls(body) if c not in seen)
    matmul = lambda names: [name for name in names if any(row[2] == "convolution" for row in computations[name])]
    assert len(matmul(weight_shaped)) == 3, weight_shaped  # The three weight gradients, each a matmul fusion.
    return sum(holds(name) for name in matmul(weight_shaped) + matmul(middle))

  assert exponentials_in_matmuls(lambda gate, up: jax.nn.silu(gate) * up) > 0
  assert exponentials_in_matmuls(glu.gated_silu) == 0
