"""One-token decode attention over a paged KV cache: each row reads its own pages, up to its own length.

A pool of pages `[K, L, Q, Pq, Tg, H]` (KV heads, layers, queues, pages per queue, tokens per page, head
dim) holds every row's keys and values; row r (of queue q = r // (R/Q)) holds its logical tokens
[0, lengths[r]) compactly, token t at offset t mod Tg of page `table[r, t // Tg]` (a page id within its
queue). Row r's query sees exactly those tokens:

  out[r] = Σ_{t < lengths[r]} softmax_t(q_r·k_t / √H) v_t;   0 where lengths[r] = 0.

Three implementations (`attend(..., implementation=)`), equal up to float rounding:

  reference  gathers every page of every row into a contiguous `[R, K, W·Tg, H]` and runs the dense
             masked softmax (`decode_attention.attend_one_reference`): the oracle of the tests.
  gather     pure JAX, any platform: blocks of `block_pages` pages, gathered from the pool by the page
             table (a gather batched over queues: split over the data-parallel devices with them, it
             stays on each device), combined by an online softmax in float32 (`decode_attention`'s); the
             loop runs to the batch's longest row (a dynamic trip count), shorter rows masked.
  kernel     the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.paged_attention` (decode only): each
             row reads its own pages up to its own length (double-buffered DMA of `block_pages` pages at a
             time) and nothing else; per-row reads are what make the paged cache fast on TPU. On a mesh it
             runs under `jax.shard_map`, each device on its rows, its queues' pages and its KV heads (no
             communication); the pool is passed whole, its (layer, queue, page) axes flattened into the
             kernel's page axis (a reshape, no copy) and the page ids offset to layer `layer`. It reads
             keys and values in bfloat16 (`pltpu` rounds them as it loads). On a chip of two TensorCores
             (v4, v5p) its grid is split over both (`megacore_mode`: by KV heads when a device holds an
             even number, else by rows); elsewhere it runs on one. The tests run it in the Pallas
             interpreter (`jax.experimental.pallas.tpu.force_tpu_interpret_mode`, both cores interpreted).
  gpu_kernel the Pallas GPU kernel `jax.experimental.pallas.ops.gpu.paged_attention` (`pallas_gpu.paged_decode`):
             split-K over each row's own pages, partitions past its length skipped; the same pool layout,
             page ids and `jax.shard_map` as the TPU kernel. The tests run it in the Pallas interpreter
             (`pallas_gpu.interpret`).

`default_implementation` chooses per platform: the kernel on TPU, the GPU kernel on GPU, each where its shape
rules hold; the gather elsewhere.

An int8 pool (`models/paged_int8.py`) comes with scales: the gather and a chunk dequantise each block read; its
kernel (`paged_int8.attend`) runs under `attend_kernel`, its writes under `write_on_devices`.

`read_tokens` is what a decode step reads from the pool, row by row (the roofline's model of the kernel).
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from vapo_jax.models import decode_attention, pallas_gpu, sharding

IMPLEMENTATIONS = ("kernel", "gpu_kernel", "gather", "reference")
MEGACORE_CHIPS = frozenset({"TPU v4", "TPU v5",
                            "TPU v5p"})  # Two TensorCores the kernel can split its grid over.


def default_implementation(platform: str | None = None, *, head_dim: int = 128,
                           page_tokens: int = 128, int8: bool = False) -> str:
  """The kernel on TPU where Mosaic takes its blocks (head dim a multiple of 128, pages of a multiple of 8
  tokens); the GPU kernel on GPU where Triton takes its tiles (`pallas_gpu.paged_rule`); the gather elsewhere
  (and, with a warning, on TPU or GPU otherwise). An int8 pool (`int8`) on GPU: the gather, with a warning
  (JAX's GPU kernel reads no scales)."""
  platform = platform or jax.default_backend()
  if platform in ("gpu", "cuda") and int8:
    warnings.warn("paged attention: the GPU kernel reads no int8 pages (rollout.kv_cache_dtype='int8'); the "
                  "gather runs instead", stacklevel=2)
    return "gather"
  if platform in ("gpu", "cuda"):
    if reason := pallas_gpu.paged_rule(head_dim=head_dim, page_tokens=page_tokens):
      warnings.warn(f"paged attention: the GPU kernel needs {reason}; the gather runs instead", stacklevel=2)
      return "gather"
    return "gpu_kernel"
  if platform != "tpu":
    return "gather"
  if head_dim % 128 or page_tokens % 8:
    warnings.warn("paged attention: the TPU kernel needs a head dim that is a multiple of 128 and pages of "
                  f"a multiple of 8 tokens (here {head_dim} and {page_tokens}); the gather runs instead",
                  stacklevel=2)
    return "gather"
  return "kernel"


def default_block_pages(page_tokens: int, platform: str | None = None) -> int:
  """Pages per block: about `decode_attention.default_block` tokens (64 on a CPU, 512 on GPU / TPU)."""
  return max(1, decode_attention.default_block(platform) // page_tokens)


def attend(q, keys, values, table, lengths, layer, *, implementation: str = "gather", block_pages: int = 1):
  """q `[R, N, H]`; pool keys and values `[K, L, Q, Pq, Tg, H]`; table `[R, W]` int32; lengths `[R]` int32
  (the tokens each row's query sees); layer a scalar. Returns `[R, N, H]` in q's dtype."""
  match implementation:
    case "reference":
      return attend_reference(q, keys, values, table, lengths, layer)
    case "gather":
      return attend_gather(q, keys, values, table, lengths, layer, block_pages=block_pages)
    case "kernel":
      local = functools.partial(_kernel_local, block_pages=block_pages, device_kind=_device_kind())
      return attend_kernel(q, (keys, values), table, lengths, layer, local=local)
    case "gpu_kernel":
      local = functools.partial(pallas_gpu.paged_decode, block_pages=block_pages)
      return attend_kernel(q, (keys, values), table, lengths, layer, local=local)
    case _:
      raise ValueError(f"unknown paged attention {implementation!r}; one of {', '.join(IMPLEMENTATIONS)}")


def contiguous(pool: jax.Array, table: jax.Array, layer) -> jax.Array:
  """Every row's pages of layer `layer` side by side: `[R, K, W·Tg, H]` (row r's token t at slot t)."""
  kv_heads, _, queues, pages, tg, h = pool.shape
  rows, width = table.shape
  queue = jnp.arange(rows) // (rows // queues)
  got = pool[:, layer][:, queue[:, None], jnp.minimum(table, pages - 1)]  # [K, R, W, Tg, H]
  return got.transpose(1, 0, 2, 3, 4).reshape(rows, kv_heads, width * tg, h)


def attend_reference(q, keys, values, table, lengths, layer) -> jax.Array:
  """The dense oracle: `contiguous` pages, then `attend_one_reference` over the slots below each row's length."""
  k, v = contiguous(keys, table, layer), contiguous(values, table, layer)
  slots = jnp.arange(k.shape[2])[None] < lengths[:, None]
  return decode_attention.attend_one_reference(q, k, v, slots, lengths - 1)


def attend_gather(q, keys, values, table, lengths, layer, *, block_pages: int, key_scales=None,
                  value_scales=None) -> jax.Array:
  """Blocks of `block_pages` pages gathered by the page table, online softmax (module docstring); the table's
  width must be a multiple of `block_pages`. An int8 pool's pages are dequantised as they are gathered, by
  their scales `[K, L, Q, P8, Tg]` (`models/paged_int8.py`)."""
  queues, width = keys.shape[2], table.shape[1]
  if width % block_pages:
    raise ValueError(f"the page table's width {width} is not a multiple of block_pages={block_pages}")
  by_queue = lambda x: x.reshape((queues, -1) + x.shape[1:])
  one = functools.partial(_gather_queue, layer=jnp.asarray(layer, jnp.int32), block_pages=block_pages)
  out = jax.vmap(one, in_axes=(0, 2, 2, 0, 0, 2, 2))(by_queue(q), keys, values, by_queue(table), by_queue(lengths),
                                                     key_scales, value_scales)
  return out.reshape(q.shape)


def _read_block(pool, scales, layer, ids, dtype) -> jax.Array:
  """One queue's pages `ids` `[Rq, Bp]` of layer `layer` from its pool `[K, L, Pq, Tg, H]` as `[K, Rq, Bp·Tg, H]`
  in `dtype`, dequantised by its scales `[K, L, P8, Tg]` where given."""
  kv_heads, _, _, tg, h = pool.shape
  rows, count = ids.shape
  block = pool[:, layer, ids].reshape(kv_heads, rows, count * tg, h)
  if scales is None:
    return block.astype(dtype)
  return (block.astype(jnp.float32) * scales[:, layer, ids].reshape(kv_heads, rows, count * tg, 1)).astype(dtype)


def _gather_queue(q, keys, values, table, lengths, key_scales, value_scales, *, layer, block_pages: int) -> jax.Array:
  """One queue: q `[Rq, N, H]`, its pages `[K, L, Pq, Tg, H]` (scales `[K, L, P8, Tg]` or None), table
  `[Rq, W]`, lengths `[Rq]`."""
  kv_heads, _, pages, tg, h = keys.shape
  rows, n, _ = q.shape
  block, dtype = block_pages * tg, q.dtype
  qg = q.reshape(rows, kv_heads, n // kv_heads, h)

  def step(j, carry):
    ids = jnp.minimum(lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1), pages - 1)
    k, v = _read_block(keys, key_scales, layer, ids, dtype), _read_block(values, value_scales, layer, ids, dtype)
    visible = (j * block + jnp.arange(block))[None] < lengths[:, None]
    return decode_attention.accumulate(carry, qg, k, v, visible, heads="KBSH")

  blocks = jnp.minimum((jnp.max(lengths) + block - 1) // block, table.shape[1] // block_pages)
  return decode_attention.finish(lax.fori_loop(0, blocks, step, decode_attention.start_carry(qg)), dtype)


def attend_chunk(q, keys, values, table, starts, layer, *, implementation: str = "gather",
                 block_pages: int = 1, key_scales=None, value_scales=None) -> jax.Array:
  """A chunk of C queries per row, q `[R, C, N, H]`, query i of row r at its token `starts[r] + i`, each
  seeing that row's tokens [0, starts[r] + i] (causal: the chunk's own keys are written before it is read);
  the pool and table as `attend`'s. Returns `[R, C, N, H]` in q's dtype. "reference" (dense: the oracle) or
  the gather, which reads each block of a row's pages once for its C queries (a prefill chunk's attention on
  every platform). An int8 pool comes with its scales (`attend_gather`'s; the reference takes it dequantised)."""
  if implementation == "reference":
    if key_scales is not None:
      raise ValueError("the reference chunk takes an int8 pool dequantised (`paged_int8.dequantize`)")
    k, v = contiguous(keys, table, layer), contiguous(values, table, layer)
    rows, chunk = q.shape[:2]
    visible = starts[:, None] + jnp.arange(chunk)[None] + 1  # [R, C] tokens each query sees.
    flat = lambda x: x.reshape((rows * chunk,) + x.shape[2:])
    out = decode_attention.attend_one_reference(
        flat(q), jnp.repeat(k, chunk, axis=0), jnp.repeat(v, chunk, axis=0),
        jnp.arange(k.shape[2])[None] < flat(visible)[:, None], flat(visible) - 1)
    return out.reshape(q.shape)
  queues, width = keys.shape[2], table.shape[1]
  if width % block_pages:
    raise ValueError(f"the page table's width {width} is not a multiple of block_pages={block_pages}")
  by_queue = lambda x: x.reshape((queues, -1) + x.shape[1:])
  one = functools.partial(_chunk_queue, layer=jnp.asarray(layer, jnp.int32), block_pages=block_pages)
  out = jax.vmap(one, in_axes=(0, 2, 2, 0, 0, 2, 2))(by_queue(q), keys, values, by_queue(table), by_queue(starts),
                                                     key_scales, value_scales)
  return out.reshape(q.shape)


def _chunk_queue(q, keys, values, table, starts, key_scales, value_scales, *, layer, block_pages: int) -> jax.Array:
  """One queue: q `[Rq, C, N, H]`, its pages `[K, L, Pq, Tg, H]`, table `[Rq, W]`, starts `[Rq]`: blocks of
  pages up to the chunk's last token, an online softmax (float32) per query with its own causal bound."""
  kv_heads, _, pages, tg, h = keys.shape
  rows, chunk, n, _ = q.shape
  block, dtype = block_pages * tg, q.dtype
  qg = q.reshape(rows, chunk, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)  # [Rq, K, G, C, H]
  bound = starts[:, None] + jnp.arange(chunk,
                                       dtype=jnp.int32)[None]  # [Rq, C] each query's last visible token.

  def step(j, carry):
    m, l, acc = carry  # [Rq, K, G, C] (×H for acc), float32.
    ids = jnp.minimum(lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1), pages - 1)
    k, v = _read_block(keys, key_scales, layer, ids, dtype), _read_block(values, value_scales, layer, ids, dtype)
    visible = (j * block + jnp.arange(block))[None, None] <= bound[..., None]  # [Rq, C, S]
    s = jnp.einsum("RKGCH,KRSH->RKGCS", qg, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(m - m_ref)
    pv = jnp.einsum("RKGCS,KRSH->RKGCH", p.astype(dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

  shape = qg.shape[:4]
  carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
           jnp.zeros(qg.shape, jnp.float32))
  blocks = jnp.minimum((jnp.max(bound) + block) // block, table.shape[1] // block_pages)
  _, l, acc = lax.fori_loop(0, blocks, step, carry)
  out = jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [Rq, K, G, C, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(rows, chunk, n, h).astype(dtype)


def megacore_mode(device_kind: str, rows: int, kv_heads: int) -> str | None:
  """How the TPU kernel splits its grid over a chip's two TensorCores (`megacore_mode`): by KV heads when
  the device holds an even number, else by rows when even; None on a chip of one core (or an odd split),
  where the grid runs on one core. `rows`, `kv_heads`: the device's own."""
  if device_kind not in MEGACORE_CHIPS:
    return None
  return "kv_head" if kv_heads % 2 == 0 else "batch" if rows % 2 == 0 else None


def _device_kind() -> str:
  """The device kind of the mesh traced for (`sharding.use_rules`), else of JAX's first device."""
  found = sharding.context()
  devices = found[0].devices.flat if found is not None else jax.devices()
  return getattr(next(iter(devices)), "device_kind", "")


def attend_kernel(q, pools: tuple, table, lengths, layer, *, local) -> jax.Array:
  """A Pallas kernel (module docstring; `local(q, *pools, table, lengths, layer)`: the one-device call, as
  `_kernel_local`) over `pools`, each `[K, L, Q, Pq, ...]` (keys and values; an int8 pool's scales beside them):
  under `jax.shard_map` on a mesh (`sharding.use_rules`), each device on its rows, queues and KV heads."""
  found = sharding.context()
  layer = jnp.asarray(layer, jnp.int32)
  if found is None or found[0].size == 1:
    return local(q, *pools, table, lengths, layer)
  mesh, rules = found
  keys = pools[0]
  rows = sharding.partition_spec(("batch",), rules, mesh.shape, (q.shape[0],))
  heads = sharding.partition_spec(("cache_kv_heads",), rules, mesh.shape, (keys.shape[0],))
  row_axes, head_axes = (rows[0] if len(rows) else None), (heads[0] if len(heads) else None)
  if row_axes is not None and keys.shape[2] % math.prod(mesh.shape[a] for a in _axes(row_axes)):
    raise ValueError(f"the paged kernel needs the pool's {keys.shape[2]} queues split over the data-parallel "
                     f"devices ({row_axes}) with the rows: one queue per data-parallel group")
  q_spec = PartitionSpec(row_axes, head_axes, None)
  pool_specs = tuple(PartitionSpec(head_axes, None, row_axes, *(None,) * (p.ndim - 3)) for p in pools)
  run = lambda q, pools, table, lengths, layer: local(q, *pools, table, lengths, layer)
  return jax.shard_map(run, mesh=mesh, check_vma=False, out_specs=q_spec,
                       in_specs=(q_spec, pool_specs, PartitionSpec(row_axes, None),
                                 PartitionSpec(row_axes), PartitionSpec()))(q, tuple(pools), table, lengths, layer)


def _axes(axes) -> tuple:
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _kernel_local(q, keys, values, table, lengths, layer, *, block_pages: int, device_kind: str = "",
                  megacore: str | None = None) -> jax.Array:
  """The kernel on one device's rows `[r, n, H]`, pool `[k, L, q, Pq, Tg, H]`, table `[r, W]`, lengths `[r]`;
  its grid over both TensorCores of a megacore chip (`megacore_mode` of `device_kind`, or `megacore`)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  kv_heads, layers, queues, pages, tg, h = keys.shape
  rows = q.shape[0]
  flat = lambda pool: pool.reshape(kv_heads, layers * queues * pages, tg,
                                   h)  # (layer, queue, page) → one axis.
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  ids = (layer * queues + queue[:, None]) * pages + jnp.minimum(table, pages - 1)
  scaled = q * jnp.asarray(h ** -0.5, q.dtype)  # The kernel takes its queries scaled.
  # Its matmuls take float32 queries against bfloat16 keys, which Mosaic compiles at the default precision
  # only: a run's (or the tests') global "highest" must not reach them.
  with jax.default_matmul_precision("default"):
    return paged_attention(scaled, flat(keys), flat(values), lengths.astype(jnp.int32), ids.astype(jnp.int32),
                           pages_per_compute_block=block_pages,
                           megacore_mode=megacore or megacore_mode(device_kind, rows, kv_heads))


def write(pool, new, page, offset, layer, *, implementation: str):
  """`new` `[R, K, H]` written into the pool `[K, L, Q, Pq, Tg, H]` at (layer, row r's queue, `page[r]`,
  `offset[r]`), in place, a page ≥ Pq dropped. With the kernel (TPU): under `jax.shard_map` on a mesh, each
  device scatters its own rows into its own pages as rows of the pool flattened to token slots, a scatter the
  TPU compiler keeps whole (one batched over queues it expands into a loop over the rows, per layer); else
  `write_token`, batched over queues."""
  if implementation != "kernel":
    return write_token(pool, new, layer, page, offset, pool.shape[2])
  return write_on_devices(_write_local, pool, new, page, offset, layer)


def write_on_devices(local, pool, new, page, offset, layer):
  """`local(pool, new, page, offset, layer)` on each device's rows `[r, k, ...]` and pool `[k, L, q, Pq, ...]`:
  under `jax.shard_map` on a mesh (`sharding.use_rules`), alone otherwise."""
  layer = jnp.asarray(layer, jnp.int32)
  found = sharding.context()
  if found is None or found[0].size == 1:
    return local(pool, new, page, offset, layer)
  mesh, rules = found
  rows = sharding.partition_spec(("batch",), rules, mesh.shape, (new.shape[0],))
  heads = sharding.partition_spec(("cache_kv_heads",), rules, mesh.shape, (pool.shape[0],))
  row_axes, head_axes = (rows[0] if len(rows) else None), (heads[0] if len(heads) else None)
  pool_spec = PartitionSpec(head_axes, None, row_axes, *(None,) * (pool.ndim - 3))
  new_spec = PartitionSpec(row_axes, head_axes, *(None,) * (new.ndim - 2))
  return jax.shard_map(local, mesh=mesh, check_vma=False, out_specs=pool_spec,
                       in_specs=(pool_spec, new_spec, PartitionSpec(row_axes), PartitionSpec(row_axes),
                                 PartitionSpec()))(pool, new, page, offset, layer)


def _write_local(pool, new, page, offset, layer):
  """One device's rows `[r, k, H]` into its pool `[k, L, q, Pq, Tg, H]`, as rows of `[k, L·q·Pq·Tg, H]`."""
  kv_heads, layers, queues, pages, tg, h = pool.shape
  rows = new.shape[0]
  total = layers * queues * pages * tg
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  slot = ((layer * queues + queue) * pages + page) * tg + offset
  slot = jnp.where(page < pages, slot,
                   total + jnp.arange(rows, dtype=jnp.int32))  # Out of range, each its own.
  flat = pool.reshape(kv_heads, total, h)
  flat = flat.at[:, slot, :].set(new.transpose(1, 0, 2).astype(pool.dtype), mode="drop", unique_indices=True)
  return flat.reshape(pool.shape)


def write_token(pool: jax.Array, new: jax.Array, layer, page: jax.Array, offset: jax.Array,
                queues: int) -> jax.Array:
  """`new` `[R, K, H]` written into the pool `[K, L, Q, Pq, Tg, H]` at (layer, row r's queue, `page[r]`,
  `offset[r]`): a scatter batched over the queue axis (split over the data-parallel devices with the rows, it
  stays on each device), in place, a page ≥ Pq dropped."""
  rows = new.shape[0]
  at = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (rows,)), page.astype(jnp.int32),
                  offset.astype(jnp.int32)], axis=1).reshape(queues, rows // queues, 3)
  updates = new.astype(pool.dtype).reshape(queues, rows // queues, *new.shape[1:])  # [Q, Rq, K, H]
  numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(1, 3, 4),
                                            scatter_dims_to_operand_dims=(1, 3, 4),
                                            operand_batching_dims=(2,), scatter_indices_batching_dims=(0,))
  return jax.lax.scatter(pool, at, updates, numbers, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def read_tokens(lengths, *, page_tokens: int, block_pages: int) -> int:
  """Cached tokens the kernel reads in one decode step: each row the blocks of `block_pages` pages up to its
  own `lengths[r]` (the tokens its query sees); × a token's keys and values at every layer: its bytes."""
  block = page_tokens * block_pages
  return int(np.sum(-(-np.asarray(lengths, np.int64) // block)) * block)
