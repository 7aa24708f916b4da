"""Collective matmuls: a tensor group's gather (or reduction) of activations split into steps around the
matmul's chunks, so that each step's transfer to the next device of the group runs while the device multiplies
the chunk it already holds ("Overlap communication with dependent computation via decomposition", Wang et al.,
ASPLOS 2023; JAX's shard_map collective-matmul example).

Under sequence parallelism (`sharding.PRESETS["fsdp_tp"]`) a block's normed input is split along the sequence
over the tensor group, `[B, T/n, D]` a device, and its kernels by output (heads, MLP width):

  q, k = gather_matmul(x, ("BTD,DNH->BTNH", wq, ("embed", "heads", "head_dim")),
                       ("BTD,DKH->BTKH", wk, ("embed", "kv_heads", "head_dim")), axis="tensor")  # [B, T, N/n, H]
  y = matmul_scatter(h, "BTF,FD->BTD", down, ("mlp", "embed"), axis="tensor")  # [B, T/n, D], summed

`gather_matmul` passes the sequence chunks round the group's ring in n − 1 steps: at step s a device multiplies
the chunk it holds (its own at s = 0) while sending it on, and writes the product into that chunk's rows.
`matmul_scatter` multiplies the other devices' chunks first, each product sent straight to its chunk's device
while the next is multiplied, then its own chunk, to which the n − 1 products that arrived are added.
`gather_map_scatter` is a block of both whose middle (an MLP's silu(gate) · up) is never assembled. Each equals
the plain matmuls of the gathered input (the gathered product row by row, the scattered one up to the order of
the n partial sums), the oracle in tests/test_collective_matmul.py. The TPU compiler issues each transfer as an
asynchronous `collective-permute` around a chunk's matmul; the backward pass, by JAX's transposes, runs the same
steps the other way. These run inside `shard_map` over the whole mesh: each kernel is gathered over FSDP before
the steps (`jax.lax.all_gather`, in the compute dtype), so that its gradient is reduced once after them rather
than once a chunk (a split left to XLA inside the steps reduced each chunk's). `active` says when a block takes
them (`mesh.collective_matmul`: training and scoring, never a decode). Compiled for `aime` they hide most of the
tensor groups' activation transfers, but the compiler prices the chunked backward's matmuls and sums above the
seconds hidden, so `aime` keeps them off (docs/pod.md). Pure JAX.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from vapo_jax.models import int8_weights, sharding


def active(tokens: int, *widths: int) -> str | None:
  """The tensor axis a block's matmuls gather and scatter over in steps, or None: under `sharding.use_rules`
  whose rules name one (`sharding.COLLECTIVE_MATMUL`, the axis the residual stream's sequence is split over,
  "act_seq"), for a sequence of `tokens` and kernels' split `widths` (heads, MLP width) that the group's size
  divides."""
  context = sharding.context()
  if context is None:
    return None
  mesh, rules = context
  axis = rules.get(sharding.COLLECTIVE_MATMUL)
  if axis is None or rules.get("act_seq") != axis or mesh.shape[axis] < 2:
    return None
  return None if any(w % mesh.shape[axis] for w in (tokens, *widths)) else axis


def _ring(n: int) -> list[tuple[int, int]]:
  return [(i, (i + 1) % n) for i in range(n)]


def _specs(rows: int, kernels):
  """(mesh, the rows' mesh axes, each kernel's spec) under the context's rules, as the model places them."""
  mesh, rules = sharding.context()
  spec = lambda logical, shape: sharding.partition_spec(logical, rules, mesh.shape, shape)
  batch = spec(("batch",), (rows,))
  return mesh, batch[0] if batch else None, [spec(logical, kernel.shape) for kernel, logical in kernels]


def _whole(kernel, spec: P, axis: str, dtype):
  """Inside `shard_map`: this device's block of a kernel in the compute dtype, gathered over every mesh axis its
  spec splits it over but `axis` (FSDP's split of the weights: its gradient reduced once, after the steps)."""
  kernel = kernel.astype(dtype)
  for dim, entry in enumerate(spec):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != axis)
    if axes:
      kernel = jax.lax.all_gather(kernel, axes, axis=dim, tiled=True)
  return kernel


def _gather_steps(x, kernels, specs, axis: str, n: int):
  """Inside `shard_map`: [(the chunk's index, its product with each kernel) for each step] of the ring that passes
  x `[B, T/n, D]`, this device's chunk, round the group (each kernel whole but for its split over `axis`)."""
  i = jax.lax.axis_index(axis)
  steps, held = [], x
  for s in range(n):
    sent = jax.lax.ppermute(held, axis, _ring(n)) if s < n - 1 else None
    steps.append(((i - s) % n, [int8_weights.einsum(spec, held, k) for spec, k in zip(specs, kernels)]))
    held = sent  # The chunk held at step s came from device i − s.
  return steps


def _gather_matmul(x, kernels, specs, kernel_specs, axis: str, n: int):
  """Inside `shard_map`: each kernel's product with the gathered x, written chunk by chunk into its rows."""
  kernels = [_whole(k, s, axis, x.dtype) for k, s in zip(kernels, kernel_specs)]
  outs = None
  for index, parts in _gather_steps(x, kernels, specs, axis, n):
    if outs is None:
      outs = [jnp.zeros((p.shape[0], n * x.shape[1]) + p.shape[2:], p.dtype) for p in parts]
    outs = [jax.lax.dynamic_update_slice_in_dim(o, p, index * x.shape[1], axis=1) for o, p in zip(outs, parts)]
  return tuple(outs)


def gather_matmul(x: jax.Array, *triples, axis: str) -> tuple[jax.Array, ...]:
  """`einsum(spec, gather(x), kernel)` for each (spec, kernel, the kernel's logical axes) of `triples`, with x
  `[B, T, D]` split along T over `axis` (the residual stream's layout) and each kernel split over `axis` along its
  first output axis; each result `[B, T, ...]` split like its kernel's outputs (module docstring)."""
  mesh, rows, kernel_specs = _specs(x.shape[0], [(k, logical) for _, k, logical in triples])
  n = mesh.shape[axis]
  specs = tuple(t[0] for t in triples)
  body = lambda x, *kernels: _gather_matmul(x, kernels, specs, kernel_specs, axis, n)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(rows, axis), *kernel_specs),
                       out_specs=tuple(P(rows, None, axis) for _ in triples))(x, *(k for _, k, _ in triples))


def _scatter_steps(chunk_for, kernel, spec: str, axis: str, n: int):
  """Inside `shard_map`: the sum over the group of this device's chunk of einsum(spec, h, kernel), where
  `chunk_for(s)` is this device's h for chunk (i − s) mod n. Each other chunk's product goes straight to its
  device (a shift of −s), sent while the next one is multiplied; the own chunk's product comes last, with the
  n − 1 that arrived added to it."""
  arrived = []
  for s in range(1, n):
    part = int8_weights.einsum(spec, chunk_for(s), kernel)
    arrived.append(jax.lax.ppermute(part, axis, [(k, (k - s) % n) for k in range(n)]))
  return sum(arrived, int8_weights.einsum(spec, chunk_for(0), kernel))


def _matmul_scatter(h, kernel, spec: str, kernel_spec: P, axis: str, n: int):
  """Inside `shard_map`: h `[B, T, ...]` with this device's share of the contraction."""
  i = jax.lax.axis_index(axis)
  chunk = h.shape[1] // n
  chunk_for = lambda s: jax.lax.dynamic_slice_in_dim(h, ((i - s) % n) * chunk, chunk, axis=1)
  return _scatter_steps(chunk_for, _whole(kernel, kernel_spec, axis, h.dtype), spec, axis, n)


def matmul_scatter(h: jax.Array, spec: str, kernel: jax.Array, logical, *, axis: str) -> jax.Array:
  """`einsum(spec, h, kernel)` with the contraction's first axis split over `axis` (h `[B, T, F, ...]` along F,
  the kernel `[F, ..., D]` along its first axis; `logical`: its logical axes), summed over the group and returned
  split along T over `axis`: `[B, T, D]` in the residual stream's layout (module docstring)."""
  mesh, rows, (kernel_spec,) = _specs(h.shape[0], [(kernel, logical)])
  n = mesh.shape[axis]
  body = lambda h, kernel: _matmul_scatter(h, kernel, spec, kernel_spec, axis, n)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(rows, None, axis), kernel_spec), out_specs=P(rows, axis))(
      h, kernel)


def gather_map_scatter(x: jax.Array, triples, fn, out: tuple, *, axis: str) -> jax.Array:
  """A block of both: `matmul_scatter(fn(*gather_matmul(x, *triples)), *out)`, with `fn` elementwise, chunk by
  chunk: the scatter's steps take the gather's products as they come (the gather's step s holds the chunk the
  scatter's step s is for), so that the block's `[B, T, F/n]` middle is never assembled (an MLP: gate and up in,
  silu(gate) · up, down out). `out`: (spec, kernel, logical axes) of the output kernel."""
  kernels = [(k, logical) for _, k, logical in triples] + [(out[1], out[2])]
  mesh, rows, kernel_specs = _specs(x.shape[0], kernels)
  n = mesh.shape[axis]
  specs = tuple(t[0] for t in triples)

  def body(x, *kernels):
    kernels = [_whole(k, s, axis, x.dtype) for k, s in zip(kernels, kernel_specs)]
    middles = [fn(*parts) for _, parts in _gather_steps(x, kernels[:-1], specs, axis, n)]
    return _scatter_steps(lambda s: middles[s], kernels[-1], out[0], axis, n)

  return jax.shard_map(body, mesh=mesh, in_specs=(P(rows, axis), *kernel_specs), out_specs=P(rows, axis))(
      x, *(k for k, _ in kernels))
