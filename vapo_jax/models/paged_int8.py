"""int8 pages of a paged KV cache: per-token, per-head scales, and a Pallas TPU decode kernel that reads them.

A token's keys (or values) of one KV head, a vector x `[H]`, are stored as

  s = max|x| / 127,    q = round(x / s) ∈ [−127, 127]    (s = 0 and q = 0 for a zero vector)

and read back as q·s: each entry within s/2 of x. A pool of int8 pages `[K, L, Q, Pq, Tg, H]` has float32 scales
`[K, L, Q, P8, Tg]` (P8: Pq rounded up to a multiple of 8, `scale_pages`), a page's Tg scales one row of 4·Tg
bytes against the page's Tg·H (3 % at H = 128). That layout is the TPU's own: (pages, tokens) tile by (8, 128)
with no padding, so the pool's scales stay in one layout from the writes to the kernel (a `[..., 1, Tg]` row per
page is tiled (1, 128) by the compiler, re-laid out around the kernel and copied whole at every layer). The
writes (`write`, `write_scales`) quantise each token on its own.

`attend` is one-token decode attention over such a pool, as `paged_attention.attend`'s kernel is over a
bfloat16 one: row r's query sees its tokens [0, lengths[r]), token t at offset t mod Tg of page
`table[r, t // Tg]`. The kernel runs one grid step per (row, KV head, page of the table): the page's int8 keys
and values `[Tg, H]` are copied to VMEM by Pallas's pipeline (double-buffered; a step past the row's last page maps
to that last page again, which the pipeline does not copy twice), and the page's key and value scale rows `[1, Tg]`
by the kernel's own DMAs from HBM (a Pallas block's rows come in eights, so a pipelined block would copy 8 pages'
rows to read one), each page's started while the page before it is read; the logits are q·kᵀ (float32) times the
key scales, the probabilities times the value scales meet the int8 values, and an online softmax in float32 runs
across the row's pages. Per token and head it reads H + 4 bytes of keys (and as many of values) where a bfloat16
page reads 2·H: 0.52× at H = 128. JAX's own kernel (`jax.experimental.pallas.ops.tpu.
paged_attention` with `QuantizedTensor` pages) takes its scales broadcast to the page's `[Tg, H]` and copies them
whole: more bytes than bfloat16 (docs/pod.md).

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
KERNEL_SCALE_ROWS = 8  # The scales' page axis comes in multiples of this (the TPU's (8, 128) tile).


def scale_pages(pages: int) -> int:
  """The scales' page axis for a pool of `pages` pages a queue: rounded up to a multiple of 8 (the TPU's tile)."""
  return -(-pages // KERNEL_SCALE_ROWS) * KERNEL_SCALE_ROWS


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`x` `[..., H]` → (int8 `[..., H]`, float32 scales `[...]`): per vector of H the scale max|x| / 127 and
  x / scale rounded (module docstring)."""
  amax = jnp.max(jnp.abs(x.astype(_F32)), axis=-1)
  scale = amax / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(x.astype(_F32) / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def quantize_pool(pool: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A pool `[K, L, Q, Pq, Tg, H]` → (int8 pool, scales `[K, L, Q, P8, Tg]`, the pages past Pq zero)."""
  q, scales = quantize(pool)
  pad = scale_pages(pool.shape[3]) - pool.shape[3]
  return q, jnp.pad(scales, [(0, 0)] * 3 + [(0, pad), (0, 0)])


def dequantize(q: jax.Array, scales: jax.Array, dtype=_F32) -> jax.Array:
  """int8 `[..., H]` and scales `[...]` → `[..., H]` in `dtype`; a pool `[K, L, Q, Pq, Tg, H]` with its scales
  `[K, L, Q, P8, Tg]` (the pages past Pq dropped)."""
  if scales.ndim == 5 and q.ndim == 6:
    scales = scales[:, :, :, :q.shape[3]]
  return (q.astype(_F32) * scales[..., None]).astype(dtype)


def write(pool, scales, new, page, offset, layer, *, implementation: str = "gather") -> tuple[jax.Array, jax.Array]:
  """`new` `[R, K, H]` quantised (per row and KV head) into the int8 pool `[K, L, Q, Pq, Tg, H]` and its scales
  `[K, L, Q, P8, Tg]` at (layer, row r's queue, `page[r]`, `offset[r]`), in place, a page ≥ Pq dropped: the
  int8 vectors as `paged_attention.write` puts a bfloat16 pool's (under `implementation`), the scales by
  `write_scales`."""
  q, s = quantize(new)  # [R, K, H], [R, K]
  pool_pages = pool.shape[3]
  pool = paged_attention.write(pool, q, page, offset, layer, implementation=implementation)
  return pool, write_scales(scales, s, page, offset, layer, pages=pool_pages, implementation=implementation)


def write_scales(scales, new, page, offset, layer, *, pages: int, implementation: str = "gather") -> jax.Array:
  """`new` `[R, K]` written into the scales `[K, L, Q, P8, Tg]` at (layer, row r's queue, `page[r]`,
  `offset[r]`), in place, a page ≥ `pages` (the pool's Pq) dropped: with the kernel (TPU) each device's own rows
  into its own scales under `jax.shard_map` (`paged_attention.write_on_devices`, as the int8 vectors are
  written), else a scatter batched over the queue axis (split over the data-parallel devices with the rows, it
  stays on each device)."""
  rows = new.shape[0]
  page = jnp.where(page < pages, page, scales.shape[3] + jnp.arange(rows, dtype=jnp.int32))  # Past P8: dropped.
  if implementation == "kernel":
    return paged_attention.write_on_devices(_write_scales_local, scales, new, page, offset, layer)
  queues = scales.shape[2]
  at = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (rows,)), page.astype(jnp.int32),
                  offset.astype(jnp.int32)], axis=1).reshape(queues, rows // queues, 3)
  updates = new.astype(scales.dtype).reshape(queues, rows // queues, new.shape[1])  # [Q, Rq, K]
  numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(1, 3, 4),
                                            scatter_dims_to_operand_dims=(1, 3, 4),
                                            operand_batching_dims=(2,), scatter_indices_batching_dims=(0,))
  return jax.lax.scatter(scales, at, updates, numbers, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _write_scales_local(scales, new, page, offset, layer) -> jax.Array:
  """One device's rows `[r, k]` into its scales `[k, L, q, P8, Tg]`: a plain scatter (a dropped row's page is
  its own past P8, so the indices stay unique)."""
  queues, rows = scales.shape[2], new.shape[0]
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  return scales.at[:, layer, queue, page, offset].set(new.T.astype(scales.dtype), mode="drop", unique_indices=True)


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
  """The oracle: the pools `[K, L, Q, Pq, Tg, H]` (scales `[K, L, Q, P8, Tg]`) dequantised, then
  `paged_attention.attend_reference`. q `[R, N, H]`; returns `[R, N, H]` in q's dtype."""
  return paged_attention.attend_reference(q, dequantize(keys, key_scales), dequantize(values, value_scales), table,
                                          lengths, layer)


def attend(q, keys, key_scales, values, value_scales, table, lengths, layer) -> jax.Array:
  """The kernel on one device: q `[R, N, H]`, int8 pools `[K, L, Q, Pq, Tg, H]` with scales `[K, L, Q, P8, Tg]`,
  table `[R, W]` (page ids within the row's queue), lengths `[R]`, layer a scalar. Returns `[R, N, H]` in q's
  dtype; 0 for a row of length 0."""
  kv_heads, layers, queues, pages, tg, h = keys.shape
  rows, n, _ = q.shape
  width, groups, eights = table.shape[1], n // kv_heads, key_scales.shape[3]
  if eights % KERNEL_SCALE_ROWS or eights < pages:
    raise ValueError(f"the scales' page axis ({eights}) must hold the pool's {pages} pages in a multiple of "
                     f"{KERNEL_SCALE_ROWS} (scale_pages)")
  flat = lambda pool: pool.reshape(kv_heads, -1, tg, h)  # (layer, queue, page) → one axis: a bitcast.
  flat_scales = lambda scales: scales.reshape(kv_heads, -1, tg)  # The same, P8 pages each (whole tiles).
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  base = jnp.asarray(layer, jnp.int32) * queues + queue[:, None]  # [R, 1]
  page_ids = jnp.minimum(table, pages - 1)
  ids = (base * pages + page_ids).reshape(-1).astype(jnp.int32)  # Into the flat pool.
  scale_ids = (base * eights + page_ids).reshape(-1).astype(jnp.int32)  # Into the flat scales.
  scaled = (q.astype(_F32) * h ** -0.5).reshape(rows, kv_heads, groups, h)

  def step(b, i, lengths_ref):
    """Grid step i's entry of row b's table: past the row's last page, the last page again (not copied twice)."""
    last = jnp.maximum(jax.lax.div(lengths_ref[b] + tg - 1, tg) - 1, 0)  # Non-negative: `div`, no floor's sign.
    return b * width + jnp.minimum(i, last)

  pool_spec = pl.BlockSpec((None, None, tg, h), lambda b, k, i, lr, ir, sr: (k, ir[step(b, i, lr)], 0, 0))
  scale_spec = pl.BlockSpec(memory_space=pl.ANY)  # Left in HBM: the kernel copies each page's row itself.
  row_spec = pl.BlockSpec((None, None, groups, h), lambda b, k, i, lr, ir, sr: (b, k, 0, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, tg=tg, width=width),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(rows, kv_heads, width),
          in_specs=[row_spec, pool_spec, scale_spec, pool_spec, scale_spec], out_specs=row_spec,
          scratch_shapes=[pltpu.VMEM((groups, LANES), _F32), pltpu.VMEM((groups, LANES), _F32),
                          pltpu.VMEM((groups, h), _F32),
                          pltpu.VMEM((2, KERNEL_SCALE_ROWS, tg), _F32),  # Two pages' key scales (row 0 of each).
                          pltpu.VMEM((2, KERNEL_SCALE_ROWS, tg), _F32),  # And their value scales.
                          pltpu.SemaphoreType.DMA((2, 2))]),
      out_shape=jax.ShapeDtypeStruct((rows, kv_heads, groups, h), _F32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
  )(lengths.astype(jnp.int32), ids, scale_ids, scaled, flat(keys), flat_scales(key_scales), flat(values),
    flat_scales(value_scales))
  return out.reshape(rows, n, h).astype(q.dtype)


def _kernel(lengths_ref, ids_ref, scale_ids_ref, q_ref, k_ref, ks_hbm, v_ref, vs_hbm, out_ref, m_ref, l_ref, acc_ref,
            ks_buf, vs_buf, sems, *, tg: int, width: int):
  """One (row, KV head, page) step: q `[G, H]`, the page's int8 keys and values `[Tg, H]` (pipelined by Pallas),
  its key and value scales `[1, Tg]` copied from HBM by the kernel into slot i mod 2 of `ks_buf`/`vs_buf` (the next
  page's started before this page's is awaited); running max and sum `[G, LANES]` (every lane the same) and
  output `[G, H]` in float32 across the pages."""
  b, k, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = lengths_ref[b]

  def scale_copies(page):
    """The DMAs of page `page`'s key and value scale rows into slot page mod 2."""
    slot, at = jax.lax.rem(page, 2), scale_ids_ref[b * width + page]
    return [pltpu.make_async_copy(hbm.at[k, pl.ds(at, 1), :], buf.at[slot, pl.ds(0, 1), :], sems.at[slot, j])
            for j, (hbm, buf) in enumerate(((ks_hbm, ks_buf), (vs_hbm, vs_buf)))]

  @pl.when(i == 0)
  def _start():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

  @pl.when(jnp.logical_and(i == 0, length > 0))
  def _first():
    for copy in scale_copies(0):
      copy.start()

  @pl.when(i * tg < length)
  def _page():
    @pl.when(jnp.logical_and(i + 1 < width, (i + 1) * tg < length))
    def _next():
      for copy in scale_copies(i + 1):
        copy.start()

    for copy in scale_copies(i):
      copy.wait()
    slot = jax.lax.rem(i, 2)
    keys = k_ref[...].astype(_F32)  # int8 → float32 is exact.
    key_scales = ks_buf[slot, pl.ds(0, 1), :]  # [1, Tg]
    s = jax.lax.dot_general(q_ref[...], keys, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * key_scales
    visible = i * tg + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) < length
    s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[...][:, :1]  # [G, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)  # The page's first token is visible: m_new is finite.
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p * vs_buf[slot, pl.ds(0, 1), :], v_ref[...].astype(_F32), preferred_element_type=_F32)  # [G, H]
    acc_ref[...] = alpha * acc_ref[...] + pv
    m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

  @pl.when(i == width - 1)
  def _finish():
    total = l_ref[...][:, :1]
    out_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0)
