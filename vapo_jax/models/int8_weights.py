"""Int8 weights for the rollout: the decoder layers' matmul kernels as int8, one float32 scale per output channel.

  kernel = quantize(w, contracted=1, outputs=2)          # q_proj `[L, D, N, H]`: scale `[L, N, H]`
  y = einsum("BTD,DNH->BTNH", x, kernel)                 # (x · values) · scale, in float32, cast to x's dtype
  w_hat = dequantize(kernel)                             # the oracle's weights: values · scale

A kernel's axes are its leading (batch) axes (the layer stack's `[L]`), the axes a matmul contracts, then its
output axes. Each output channel c (one index into the leading and output axes) is quantised symmetrically:
s_c = max |w[..., c]| / 127 over the contracted axes (1 where the channel is all zeros), q = round(w / s_c) in
[-127, 127]. Since the scale is constant along the contraction, x·(q·s) = (x·q)·s: the matmul reads the int8
values (converted to the compute dtype on the way into the MXU, exactly: |q| ≤ 127) and scales its float32 output.
A decode step reads every weight once, so int8 kernels read about half of bfloat16's bytes (FlashRL quantises
its rollout's weights so; the trainer keeps full precision and `algo.tis_cap` corrects the sampler's drift).

`LAYER_KERNELS` names the seven kernels of a decoder layer (models/transformer.py) with their contracted and
output axes; the embedding, the norms, biases and the output projection stay in the compute dtype. Pure JAX.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Axes(NamedTuple):
  contracted: int  # The axes a matmul contracts, after the leading ones.
  outputs: int  # The trailing (output channel) axes.


# Unstacked kernels: q/k/v `[D, N|K, H]`, o `[N, H, D]`, gate/up `[D, F]`, down `[F, D]`.
LAYER_KERNELS = {"q_proj": Axes(1, 2), "k_proj": Axes(1, 2), "v_proj": Axes(1, 2), "o_proj": Axes(2, 1),
                 "gate_proj": Axes(1, 1), "up_proj": Axes(1, 1), "down_proj": Axes(1, 1)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Kernel:
  values: jax.Array  # int8, the kernel's shape.
  scale: jax.Array  # float32, the kernel's shape without its contracted axes.


def _contracted(ndim: int, axes: Axes) -> tuple[int, ...]:
  lead = ndim - axes.contracted - axes.outputs
  if lead < 0:
    raise ValueError(f"a kernel of {ndim} axes has no {axes.contracted} contracted and {axes.outputs} output axes")
  return tuple(range(lead, lead + axes.contracted))


def per_scale(kernel_axes: tuple, axes: Axes) -> tuple:
  """What a kernel's per-axis tuple (its shape, or its logical axis names, which the sharding rules split the
  scale by alike) is for its scale: the kernel's without its contracted axes."""
  dropped = set(_contracted(len(kernel_axes), axes))
  return tuple(a for i, a in enumerate(kernel_axes) if i not in dropped)


def quantize(w: jax.Array, axes: Axes) -> Int8Kernel:
  """`w` as int8 values and one float32 scale per output channel (module docstring)."""
  contracted = _contracted(w.ndim, axes)
  w32 = w.astype(jnp.float32)
  peak = jnp.max(jnp.abs(w32), axis=contracted)
  scale = jnp.where(peak > 0, peak / 127.0, 1.0)
  values = jnp.clip(jnp.round(w32 / jnp.expand_dims(scale, contracted)), -127, 127).astype(jnp.int8)
  return Int8Kernel(values, scale)


def dequantize(kernel: Int8Kernel, axes: Axes, dtype=jnp.float32) -> jax.Array:
  """values · scale: the weights the int8 kernel stands for."""
  contracted = _contracted(kernel.values.ndim, axes)
  return (kernel.values.astype(jnp.float32) * jnp.expand_dims(kernel.scale, contracted)).astype(dtype)


def einsum(spec: str, x: jax.Array, kernel) -> jax.Array:
  """`jnp.einsum(spec, x, kernel)` in x's dtype, for a kernel array (cast to x's dtype) or an `Int8Kernel`
  (its values cast to x's dtype, the product in x's dtype, then scaled per output channel in float32: the
  spec's output ends with the kernel's output axes). The product stays in x's dtype, as the plain kernel's
  does, so that a matmul whose contraction is split over a tensor group reduces what it reduces without int8
  (a float32 product would double the decode's all-reduces)."""
  if isinstance(kernel, Int8Kernel):
    out = jnp.einsum(spec, x, kernel.values.astype(x.dtype))
    return (out.astype(jnp.float32) * kernel.scale).astype(x.dtype)
  return jnp.einsum(spec, x, kernel.astype(x.dtype))
