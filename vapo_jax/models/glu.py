"""The MLP's gated middle, silu(gate) · up, with its gradient written out and materialised once.

Left to XLA, the TPU compiler fuses this elementwise work into the matmuls that read it, as the prologue of
each: the down projection's forward and its weight gradient read silu(gate) · up, the gate's and up's weight
gradients read ∂gate and ∂up. A prologue is computed again for every output tile that reads its operand's
tile (`iteration_bounds` in the compiled fusion: 4 times for a `[5120, 6912]` weight gradient), and each time
it takes an exponential and a division per element in float32. Compiled for v5p at `aime`'s shapes, such a
weight gradient is priced at 0.81 of the MXU's peak against 0.95 alone.

`gated_silu`'s gradient takes ∂(silu(gate) · up) as its matmul wrote it (behind an `optimization_barrier`, so
that the compiler does not make the gradient that matmul's epilogue, which it priced at 0.62 of the MXU's peak),
computes σ(gate) once and both input gradients together in float32 in one elementwise pass, and puts them behind
a barrier: written to memory once, read by the weight gradients (0.95). The forward value is `jax.nn.silu(gate) *
up` as before, left to fusion: behind a barrier too, the compiler fused it into the up projection's epilogue and
priced that matmul and the layer scan's kept outputs higher than the down projection's prologue saved (`make
memory EXP=aime TOPOLOGY=v5p:8x8x4 LAYERS=2`, docs/pod.md). Gradients: ∂u = d · silu(g), ∂g = d · u · σ(g) ·
(1 + g · (1 − σ(g))), each rounded once to the input dtype (autodiff's chain rounds silu(g) and its derivative
first). No flax: a pure function of arrays.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def gated_silu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) · up (`[..., F]` each, one dtype)."""
  return jax.nn.silu(gate) * up


def _forward(gate, up):
  return gated_silu(gate, up), (gate, up)


def _backward(residuals, d):
  gate, up = residuals
  d = jax.lax.optimization_barrier(d)  # As its matmul wrote it: the gradient is not that matmul's epilogue.
  g, u, d32 = gate.astype(jnp.float32), up.astype(jnp.float32), d.astype(jnp.float32)
  s = jax.nn.sigmoid(g)
  d_up = d32 * g * s
  d_gate = d32 * u * s * (1.0 + g * (1.0 - s))
  return jax.lax.optimization_barrier((d_gate.astype(gate.dtype), d_up.astype(up.dtype)))


gated_silu.defvjp(_forward, _backward)
