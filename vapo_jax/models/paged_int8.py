"""int8 pages of a paged KV cache: per-token, per-head scales, and a Pallas TPU decode kernel that reads them.

A page of int8 keys (or values) `[Tg, H]` comes with its scales `[1, Tg]`, one float32 per token and KV head,
laid out along the lanes so that a page's scales are Tg contiguous floats (4·Tg bytes against the page's
Tg·H: 3 % at H = 128). A token's vector x `[H]` is stored as

  s = max|x| / 127,    q = round(x / s) ∈ [−127, 127]    (s = 0 and q = 0 for a zero vector)

and read back as q·s: each entry within s/2 of x. A pool of int8 pages `[K, L, Q, Pq, Tg, H]` has scales
`[K, L, Q, Pq, 1, Tg]` (`quantize` on `[..., Tg, H]` gives both); `write` puts a decode step's tokens into
both, each quantised on its own.

`attend` is one-token decode attention over such a pool, as `paged_attention.attend`'s kernel is over a
bfloat16 one: row r's query sees its tokens [0, lengths[r]), token t at offset t mod Tg of page
`table[r, t // Tg]`. The kernel runs one grid step per (row, KV head, page of the table): the page's int8
keys and values and their scales are copied to VMEM (Pallas's pipeline, double-buffered; a step past the
row's last page maps to that last page again, which the pipeline does not copy twice), the logits are
q·kᵀ (float32) times the key scales, the probabilities times the value scales meet the int8 values, and an online
softmax in float32 runs across the row's pages. Per token and head it reads H + 4 bytes of keys (and as many
of values) where a bfloat16 page reads 2·H. JAX's own kernel (`jax.experimental.pallas.ops.tpu.
paged_attention` with `QuantizedTensor` pages) takes its scales broadcast to the page's `[Tg, H]` and copies
them whole: more bytes than bfloat16 (docs/pod.md).

`attend_reference` is the oracle: the pages dequantised (`dequantize`), then the dense masked softmax.
The tests run the kernel in the Pallas TPU interpreter.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vapo_jax.models import paged_attention

_F32 = jnp.float32
LANES = 128  # The online softmax's running max and sum are kept as `[G, LANES]` (one vreg row per head).


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`x` `[..., Tg, H]` → (int8 `[..., Tg, H]`, float32 scales `[..., 1, Tg]`): per token (row of H) the scale
  max|x| / 127 and x / scale rounded (module docstring)."""
  amax = jnp.max(jnp.abs(x.astype(_F32)), axis=-1)  # [..., Tg]
  scale = amax / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(x.astype(_F32) / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale[..., None, :]


def dequantize(q: jax.Array, scales: jax.Array, dtype=_F32) -> jax.Array:
  """int8 `[..., Tg, H]` and scales `[..., 1, Tg]` → `[..., Tg, H]` in `dtype`."""
  return (q.astype(_F32) * jnp.swapaxes(scales, -1, -2)).astype(dtype)


def write(pool, scales, new, page, offset, layer, *, implementation: str = "gather") -> tuple[jax.Array, jax.Array]:
  """`new` `[R, K, H]` quantised (per row and KV head) into the int8 pool `[K, L, Q, Pq, Tg, H]` and its scales
  `[K, L, Q, Pq, 1, Tg]` at (layer, row r's queue, `page[r]`, `offset[r]`), in place, a page ≥ Pq dropped: the
  int8 vectors as `paged_attention.write` puts a bfloat16 pool's (under `implementation`), the scales by
  `write_scales`."""
  q, s = quantize(new[:, :, None, :])  # [R, K, 1, H], [R, K, 1, 1]
  pool = paged_attention.write(pool, q[:, :, 0], page, offset, layer, implementation=implementation)
  return pool, write_scales(scales, s[:, :, 0, 0], page, offset, layer, implementation=implementation)


def write_scales(scales, new, page, offset, layer, *, implementation: str = "gather") -> jax.Array:
  """`new` `[R, K]` written into the scales `[K, L, Q, Pq, 1, Tg]` at (layer, row r's queue, `page[r]`, 0,
  `offset[r]`), in place, a page ≥ Pq dropped: with the kernel (TPU) each device's own rows into its own scales
  under `jax.shard_map` (`paged_attention.write_on_devices`, as the int8 vectors are written: the TPU compiler
  keeps a plain scatter in place), else a scatter batched over the queue axis (split over the data-parallel
  devices with the rows, it stays on each device)."""
  if implementation == "kernel":
    return paged_attention.write_on_devices(_write_scales_local, scales, new, page, offset, layer)
  queues, rows = scales.shape[2], new.shape[0]
  zero = jnp.zeros((rows,), jnp.int32)
  at = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (rows,)), page.astype(jnp.int32), zero,
                  offset.astype(jnp.int32)], axis=1).reshape(queues, rows // queues, 4)
  updates = new.astype(scales.dtype).reshape(queues, rows // queues, new.shape[1])  # [Q, Rq, K]
  numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(1, 3, 4, 5),
                                            scatter_dims_to_operand_dims=(1, 3, 4, 5),
                                            operand_batching_dims=(2,), scatter_indices_batching_dims=(0,))
  return jax.lax.scatter(scales, at, updates, numbers, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _write_scales_local(scales, new, page, offset, layer) -> jax.Array:
  """One device's rows `[r, k]` into its scales `[k, L, q, Pq, 1, Tg]`: a plain scatter, each dropped row to a
  page of its own past Pq (the indices stay unique)."""
  queues, pages, rows = scales.shape[2], scales.shape[3], new.shape[0]
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  page = jnp.where(page < pages, page, pages + jnp.arange(rows, dtype=jnp.int32))
  return scales.at[:, layer, queue, page, 0, offset].set(new.T.astype(scales.dtype), mode="drop",
                                                          unique_indices=True)


def attend_pages(q, keys, key_scales, values, value_scales, table, lengths, layer, *, implementation: str,
                 block_pages: int = 1) -> jax.Array:
  """`paged_attention.attend` over an int8 pool: "reference" (`attend_reference`), "gather" (pages dequantised
  block by block, `paged_attention.attend_gather`) or "kernel" (`attend` under `paged_attention.attend_kernel`'s
  `jax.shard_map`, each device on its rows, queues and KV heads). q `[R, N, H]`; returns `[R, N, H]`."""
  match implementation:
    case "reference":
      return attend_reference(q, keys, key_scales, values, value_scales, table, lengths, layer)
    case "gather":
      return paged_attention.attend_gather(q, keys, values, table, lengths, layer, block_pages=block_pages,
                                           key_scales=key_scales, value_scales=value_scales)
    case "kernel":
      return paged_attention.attend_kernel(q, (keys, key_scales, values, value_scales), table, lengths, layer,
                                           local=attend)
    case _:
      raise ValueError(f"an int8 KV cache (rollout.kv_cache_dtype='int8') reads its pages with the TPU kernel, "
                       f"the gather or the reference, not {implementation!r}")


def attend_reference(q, keys, key_scales, values, value_scales, table, lengths, layer) -> jax.Array:
  """The oracle: the pools `[K, L, Q, Pq, Tg, H]` (scales `[K, L, Q, Pq, 1, Tg]`) dequantised, then
  `paged_attention.attend_reference`. q `[R, N, H]`; returns `[R, N, H]` in q's dtype."""
  return paged_attention.attend_reference(q, dequantize(keys, key_scales), dequantize(values, value_scales), table,
                                          lengths, layer)


def attend(q, keys, key_scales, values, value_scales, table, lengths, layer) -> jax.Array:
  """The kernel on one device: q `[R, N, H]`, int8 pools `[K, L, Q, Pq, Tg, H]` with scales
  `[K, L, Q, Pq, 1, Tg]`, table `[R, W]` (page ids within the row's queue), lengths `[R]`, layer a scalar.
  Returns `[R, N, H]` in q's dtype; 0 for a row of length 0."""
  kv_heads, layers, queues, pages, tg, h = keys.shape
  rows, n, _ = q.shape
  width, groups = table.shape[1], n // kv_heads
  flat = lambda pool: pool.reshape((kv_heads, layers * queues * pages) + pool.shape[4:])
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  ids = ((jnp.asarray(layer, jnp.int32) * queues + queue[:, None]) * pages
         + jnp.minimum(table, pages - 1)).reshape(-1).astype(jnp.int32)
  scaled = (q.astype(_F32) * h ** -0.5).reshape(rows, kv_heads, groups, h)

  def page(b, i, lengths_ref, ids_ref):
    """The page of grid step i: past the row's last page, the last page again (not copied twice)."""
    last = jnp.maximum(jax.lax.div(lengths_ref[b] + tg - 1, tg) - 1, 0)  # Non-negative: `div`, no floor's sign.
    return ids_ref[b * width + jnp.minimum(i, last)]

  pool_spec = pl.BlockSpec((None, None, tg, h), lambda b, k, i, lr, ir: (k, page(b, i, lr, ir), 0, 0))
  scale_spec = pl.BlockSpec((None, None, 1, tg), lambda b, k, i, lr, ir: (k, page(b, i, lr, ir), 0, 0))
  row_spec = pl.BlockSpec((None, None, groups, h), lambda b, k, i, lr, ir: (b, k, 0, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, tg=tg, width=width),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(rows, kv_heads, width),
          in_specs=[row_spec, pool_spec, scale_spec, pool_spec, scale_spec], out_specs=row_spec,
          scratch_shapes=[pltpu.VMEM((groups, LANES), _F32), pltpu.VMEM((groups, LANES), _F32),
                          pltpu.VMEM((groups, h), _F32)]),
      out_shape=jax.ShapeDtypeStruct((rows, kv_heads, groups, h), _F32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
  )(lengths.astype(jnp.int32), ids, scaled, flat(keys), flat(key_scales), flat(values), flat(value_scales))
  return out.reshape(rows, n, h).astype(q.dtype)


def _kernel(lengths_ref, ids_ref, q_ref, k_ref, ks_ref, v_ref, vs_ref, out_ref, m_ref, l_ref, acc_ref, *, tg: int,
            width: int):
  """One (row, KV head, page) step: q `[G, H]`, the page's int8 keys and values `[Tg, H]`, their scales `[1, Tg]`;
  running max and sum `[G, LANES]` (every lane the same) and output `[G, H]` in float32 across the pages."""
  b, i = pl.program_id(0), pl.program_id(2)
  length = lengths_ref[b]

  @pl.when(i == 0)
  def _start():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

  @pl.when(i * tg < length)
  def _page():
    keys = k_ref[...].astype(_F32)  # int8 → float32 is exact.
    s = jax.lax.dot_general(q_ref[...], keys, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * ks_ref[...]
    visible = i * tg + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) < length
    s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[...][:, :1]  # [G, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)  # The page's first token is visible: m_new is finite.
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p * vs_ref[...], v_ref[...].astype(_F32), preferred_element_type=_F32)  # [G, H]
    acc_ref[...] = alpha * acc_ref[...] + pv
    m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

  @pl.when(i == width - 1)
  def _finish():
    total = l_ref[...][:, :1]
    out_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0)
