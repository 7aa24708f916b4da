"""The KV cache: one interface, two layouts.

  cache = KVCache.zeros(cfg, batch, slots, dtype)                    # contiguous: each row owns S slots
  cache = PagedKVCache.zeros(cfg, rows=R, queues=Q, pages=Pq, page_tokens=Tg, table_pages=W, dtype=...)
  cache, key_mask, query_slots = cache.prepare(attention_mask, steps)   # before a call's layers
  cache = cache.write(layer, k, v)         # the call's keys and values `[B, T, K, H]` into layer `layer`
  out = cache.attend_one(q, layer, key_mask, query_slots)   # one query per row `[B, N, H]` → `[B, N, H]`
  cache = cache.advance(key_mask, steps)   # after the call: the rows hold their new tokens
  cache.bytes_per_token(cfg, dtype)        # memory of one cached token (keys and values, every layer)

With `dtype` int8 (`rollout.kv_cache_dtype`), either layout holds int8 keys and values with per-token, per-KV-head
float32 scales beside them (`models/paged_int8.py`: s = max|x| / 127, x ≈ q·s): a token costs 2·L·K·(H + 4)
bytes instead of 2·L·K·H·2 (bfloat16). Writes quantise each token on its own; reads dequantise (the gather,
the blocks of `decode_attention.attend_one`, a prefill's whole layer) or read the int8 pages directly
(`paged_int8.attend`, the TPU kernel).

Both carry every layer's keys and values in one array each, carried whole through the layer scan
(`transformer.Backbone`): layer l writes its new tokens in place and reads its own part, so no layer's
cache is ever copied.

Contiguous (`KVCache`): keys and values `[L, B, K, S, H]` (layers stacked, then heads-major: split over
KV heads, each chip's share keeps (slots, head dim) as its minor dimensions), a slot mask `[B, S]` and
the slots written, one length for the call or `[B]` (one length per row, one token per call: what lets
the refill engines put a new sequence into a row whose sequence has ended). Row b's tokens sit at its
own slots, padding and all: the prefill's cache, the static engine's, and the contiguous refill
engine's (`rollout/refill/contiguous.py`, the reference). A one-token call reads blocks of slots up to the
batch's longest row (`decode_attention.attend_one`), or every slot with `decode_block` 0 (the dense
oracle).

Paged (`PagedKVCache`): a pool of pages of Tg tokens, keys and values `[K, L, Q, Pq, Tg, H]` (KV heads,
layers, Q queues of Pq pages each: a queue's pages live with its rows, on its data-parallel devices), a
page table `[R, W]` (row r's logical token t sits at offset t mod Tg of its page `table[r, t // Tg]`, a
page id local to the row's queue, rows [q·R/Q, (q+1)·R/Q) being queue q's), each row's tokens `[R]`
and which rows hold a sequence `[R]`. Tokens are stored compactly from logical slot 0 (no padding), so
a row's keys are exactly its first `lengths[r]` tokens and a query reads only those
(`paged_attention`: the Pallas kernels on TPU and GPU, a gather over pages elsewhere, a dense gather as
the oracle). Pages are handed out by the rollout (`rollout/refill/pages.py`); the cache only reads and writes
them. A row that holds no sequence writes nothing and reads nothing.

Pure JAX; no flax modules.
"""

import jax
import jax.numpy as jnp
from flax import struct

from vapo_jax.models import decode_attention, paged_attention, paged_int8, sharding
from vapo_jax.models.attention import note
from vapo_jax.models.config import TransformerConfig
from vapo_jax.models.sharding import constrain

LAYER_AXIS = "layers"  # Logical name of the stacked layer axis: no preset maps it (models/sharding.py).
# Logical axes of a contiguous cache's keys and values `[L, B, K, S, H]` (models/sharding.py rules map them).
CACHE_AXES = (LAYER_AXIS, "batch", "cache_kv_heads", None, None)
# Logical axes of a paged pool `[K, L, Q, Pq, Tg, H]`: queues over the batch axes, KV heads over the tensor
# axis (an int8 pool's scales `[K, L, Q, P8, Tg]` the same but the last).
POOL_AXES = ("cache_kv_heads", LAYER_AXIS, "batch", None, None, None)
SCALE_BYTES = 4  # An int8 cache's float32 scale per token and KV head (of keys, and of values).


def quantized(dtype) -> bool:
  """Whether a cache of `dtype` holds int8 keys and values with scales."""
  return jnp.dtype(dtype) == jnp.int8


def token_bytes(cfg: TransformerConfig, dtype=jnp.bfloat16) -> int:
  """Keys and values of one token at every layer: 2·L·K·H·itemsize, or 2·L·K·(H + 4) in int8 (its scales)."""
  per_head = cfg.head_dim + SCALE_BYTES if quantized(dtype) else cfg.head_dim * jnp.dtype(dtype).itemsize
  return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def _rows(x: jax.Array) -> jax.Array:
  return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


@struct.dataclass
class KVCache:
  """Keys and values `[L, B, K, S, H]` (stacked layers, heads-major), slot validity `[B, S]`, and slots used so far."""

  keys: jax.Array
  values: jax.Array
  mask: jax.Array  # [B, S] true where a slot holds a real (non-padding) token.
  length: jax.Array  # int32 scalar (slots [0, length) are written), or [B] per row (one-token calls).
  # One-token calls read key/value blocks of this many slots up to the longest row; 0: every slot;
  # None: the platform's default (`decode_attention.default_block`).
  decode_block: int | None = struct.field(pytree_node=False, default=None)
  # int8 keys and values: their scales `[L, B, K, S]` (float32); None otherwise.
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None

  @classmethod
  def zeros(cls, cfg: TransformerConfig, batch: int, slots: int, dtype=jnp.bfloat16, *,
            decode_block: int | None = None) -> "KVCache":
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim)
    scales = (lambda: jnp.zeros(shape[:4], jnp.float32)) if quantized(dtype) else lambda: None
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, slots), bool),
               jnp.zeros((), jnp.int32), decode_block, scales(), scales()).constrained()

  def constrained(self) -> "KVCache":
    """This cache with its arrays constrained to their logical axes (`CACHE_AXES`; a no-op outside
    `sharding.use_rules`)."""
    scales = lambda x: None if x is None else constrain(x, CACHE_AXES[:4])
    return KVCache(constrain(self.keys, CACHE_AXES), constrain(self.values, CACHE_AXES), _rows(self.mask),
                   _rows(self.length) if self.length.ndim else self.length, self.decode_block,
                   scales(self.key_scales), scales(self.value_scales))

  def repeated(self, samples: int, slots: int) -> "KVCache":
    """Each row repeated `samples` times (a prompt's cache shared by its samples), with `slots` empty slots
    after its own: rows are axis 1 of the keys, values (and scales), 0 of the mask; slots axis 3, 1 of the mask."""
    pad = lambda x, rows, axis: jnp.pad(jnp.repeat(x, samples, axis=rows),
                                        [(0, slots * (i == axis)) for i in range(x.ndim)])
    stack = lambda x: None if x is None else pad(x, 1, 3)
    return KVCache(stack(self.keys), stack(self.values), pad(self.mask, 0, 1), self.length, self.decode_block,
                   stack(self.key_scales), stack(self.value_scales)).constrained()

  @staticmethod
  def bytes(cfg: TransformerConfig, batch: int, slots: int, dtype=jnp.bfloat16) -> int:
    """Memory of a cache of this size, before allocating it."""
    return batch * slots * KVCache.bytes_per_token(cfg, dtype) + batch * slots

  @staticmethod
  def bytes_per_token(cfg: TransformerConfig, dtype=jnp.bfloat16) -> int:
    """Keys and values of one token at every layer, scales included (the slot mask's byte aside)."""
    return token_bytes(cfg, dtype)

  def prepare(self, attention_mask: jax.Array, steps: int):
    """(this cache, the keys' validity `[B, S]` with the call's tokens, the queries' slots `[T]` or `[B, 1]`)."""
    if self.length.ndim and steps != 1:
      raise ValueError(f"a cache with one length per row takes one token per call, got {steps}")
    positions = self.length[..., None] + jnp.arange(steps)
    return self, write_slots(self.mask, attention_mask, self.length), positions

  def write(self, layer, k: jax.Array, v: jax.Array) -> "KVCache":
    """The call's keys and values `[B, T, K, H]` written into layer `layer` from slot `length` (per row: its own)."""
    heads_major = lambda t: t.transpose(0, 2, 1, 3)  # [B, T, K, H] -> [B, K, T, H].
    if self.key_scales is None:
      return self.replace(keys=write_layer(self.keys, heads_major(k), layer, self.length),
                          values=write_layer(self.values, heads_major(v), layer, self.length))
    (qk, sk), (qv, sv) = (paged_int8.quantize(heads_major(t)) for t in (k, v))  # Scales [B, K, T].
    return self.replace(keys=write_layer(self.keys, qk, layer, self.length),
                        values=write_layer(self.values, qv, layer, self.length),
                        key_scales=write_layer(self.key_scales, sk, layer, self.length),
                        value_scales=write_layer(self.value_scales, sv, layer, self.length))

  def _layer(self, layer) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s keys and values `[B, K, S, H]`, dequantised (float32) when int8."""
    if self.key_scales is None:
      return self.keys[layer], self.values[layer]
    return tuple(paged_int8.dequantize(q[layer], s[layer])
                 for q, s in ((self.keys, self.key_scales), (self.values, self.value_scales)))

  def layer_keys_values(self, layer) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s keys and values `[B, S, K, H]` (a multi-token call's attention reads them whole)."""
    return tuple(x.transpose(0, 2, 1, 3) for x in self._layer(layer))

  def attend_one(self, q: jax.Array, layer, key_mask: jax.Array, query_slots: jax.Array) -> jax.Array:
    """One query per row, q `[B, N, H]` at slot `query_slots[..., 0]`, against layer `layer`: `[B, N, H]`."""
    slots = jnp.broadcast_to(query_slots[..., 0], q.shape[:1])
    note("decode")
    if self.decode_block == 0:
      return decode_attention.attend_one_reference(q, *self._layer(layer), key_mask, slots)
    block = self.decode_block or decode_attention.default_block(sharding.platform())  # The platform traced for.
    return decode_attention.attend_one(q, self.keys, self.values, key_mask, slots, block=block, layer=layer,
                                       key_scales=self.key_scales, value_scales=self.value_scales)

  def advance(self, key_mask: jax.Array, steps: int) -> "KVCache":
    return self.replace(mask=key_mask, length=self.length + steps)


@struct.dataclass
class PagedKVCache:
  """A pool of pages `[K, L, Q, Pq, Tg, H]`, each row's page table `[R, W]`, tokens `[R]` and whether it holds
  a sequence `[R]` (see the module docstring)."""

  keys: jax.Array
  values: jax.Array
  table: jax.Array  # [R, W] int32 page ids within the row's queue (≥ Pq: none).
  lengths: jax.Array  # [R] int32 tokens held.
  live: jax.Array  # [R] bool: the row holds a sequence (set by each call from its attention mask).
  # [R, C] bool: a chunk's tokens of each row (a call of C > 1 tokens per row: a prefill chunk); None for one.
  valid: jax.Array | None = None
  # "kernel" (the Pallas TPU kernel), "gpu_kernel" (the Pallas GPU kernel), "gather" (pure JAX, pages gathered
  # block by block) or "reference" (dense).
  implementation: str = struct.field(pytree_node=False, default="gather")
  block_pages: int = struct.field(pytree_node=False, default=1)  # Pages read per block (kernels, gather).
  # An int8 pool's scales `[K, L, Q, P8, Tg]` (float32, a page's along the lanes, P8: `paged_int8.scale_pages`);
  # None otherwise.
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None

  @classmethod
  def zeros(cls, cfg: TransformerConfig, *, rows: int, queues: int, pages: int, page_tokens: int,
            table_pages: int,
            dtype=jnp.bfloat16, implementation: str = "gather", block_pages: int = 1) -> "PagedKVCache":
    """An empty pool of `pages` pages per queue, `rows` rows holding nothing (their tables point nowhere);
    int8 `dtype`: with its scales."""
    shape = (cfg.num_kv_heads, cfg.num_layers, queues, pages, page_tokens, cfg.head_dim)
    pool = lambda shape, dtype: constrain(jnp.zeros(shape, dtype), POOL_AXES[:len(shape)])
    scale_shape = shape[:3] + (paged_int8.scale_pages(pages), page_tokens)
    scales = (lambda: pool(scale_shape, jnp.float32)) if quantized(dtype) else lambda: None
    return cls(pool(shape, dtype), pool(shape, dtype), _rows(jnp.full((rows, table_pages), pages, jnp.int32)),
               _rows(jnp.zeros((rows,), jnp.int32)), _rows(jnp.zeros((rows,), bool)), None, implementation,
               block_pages, scales(), scales())

  def pool_arrays(self) -> dict[str, jax.Array]:
    """The pool's arrays by field: keys and values, and an int8 pool's scales (what a page copy moves)."""
    scales = {} if self.key_scales is None else dict(key_scales=self.key_scales, value_scales=self.value_scales)
    return dict(keys=self.keys, values=self.values) | scales

  @property
  def page_tokens(self) -> int:
    return self.keys.shape[4]

  @property
  def pages(self) -> int:
    """Pages per queue."""
    return self.keys.shape[3]

  @staticmethod
  def bytes_per_token(cfg: TransformerConfig, dtype=jnp.bfloat16) -> int:
    return token_bytes(cfg, dtype)

  @staticmethod
  def pool_bytes(cfg: TransformerConfig, *, queues: int, pages: int, page_tokens: int,
                 dtype=jnp.bfloat16) -> int:
    """Memory of the pool (keys and values, an int8 pool's scales), before allocating it."""
    return queues * pages * page_tokens * token_bytes(cfg, dtype)

  def prepare(self, attention_mask: jax.Array, steps: int):
    """(this cache with `live` from the call's attention mask, None, None): one token per row (`[R, 1]`), or a
    chunk of `steps` per row (`[R, C]`, each row's valid tokens first: `valid`)."""
    mask = attention_mask.astype(bool)
    if steps == 1:
      return self.replace(live=_rows(mask[:, 0]), valid=None), None, None
    return self.replace(live=_rows(jnp.any(mask, axis=1)), valid=_rows(mask)), None, None

  def write(self, layer, k: jax.Array, v: jax.Array) -> "PagedKVCache":
    """Each live row's keys and values `[R, T, K, H]` from its token `lengths[r]`: token t at offset t mod Tg
    of page `table[r, t // Tg]`, layer `layer` (`paged_attention.write`, in place; rows holding nothing, a
    chunk's invalid tokens and tokens past the table write nothing)."""
    tg, rows, steps = self.page_tokens, k.shape[0], k.shape[1]
    tokens = self.lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None]  # [R, T]
    column = jnp.minimum(tokens // tg, self.table.shape[1] - 1)
    page = jnp.take_along_axis(self.table, column, axis=1)
    valid = self.live[:, None] if self.valid is None else self.valid
    page = jnp.where(valid & (tokens < self.table.shape[1] * tg), page, self.pages)  # Out of range: dropped.
    flat = lambda x: x.reshape((rows * steps,) + x.shape[2:])
    at = (flat(page), flat(tokens % tg), layer)
    if self.key_scales is None:
      put = lambda pool, new: paged_attention.write(pool, flat(new), *at, implementation=self.implementation)
      return self.replace(keys=put(self.keys, k), values=put(self.values, v))
    put = lambda pool, scales, new: paged_int8.write(pool, scales, flat(new), *at, implementation=self.implementation)
    (keys, key_scales), (values, value_scales) = (put(self.keys, self.key_scales, k),
                                                  put(self.values, self.value_scales, v))
    return self.replace(keys=keys, values=values, key_scales=key_scales, value_scales=value_scales)

  def attend_chunk(self, q: jax.Array, layer) -> jax.Array:
    """A chunk's queries `[R, C, N, H]`, query i of row r seeing its tokens [0, lengths[r] + i] of layer
    `layer` (this call's written): `[R, C, N, H]` (`paged_attention.attend_chunk`; the reference under
    "reference", the gather otherwise)."""
    note("prefill chunk")
    if self.implementation == "reference":  # The dense oracle, on the dequantised pool where int8.
      read = lambda pool, scales: pool if scales is None else paged_int8.dequantize(pool, scales)
      return paged_attention.attend_chunk(q, read(self.keys, self.key_scales), read(self.values, self.value_scales),
                                          self.table, self.lengths, layer, implementation="reference")
    return paged_attention.attend_chunk(q, self.keys, self.values, self.table, self.lengths, layer,
                                        implementation="gather", block_pages=self.block_pages,
                                        key_scales=self.key_scales, value_scales=self.value_scales)

  def attend_one(self, q: jax.Array, layer, key_mask=None, query_slots=None) -> jax.Array:
    """Each live row's query `[R, N, H]` against its own `lengths[r] + 1` tokens (this call's written) of
    layer `layer`: `[R, N, H]`; 0 for rows holding nothing."""
    note("decode")
    visible = jnp.where(self.live, self.lengths + 1, 0).astype(jnp.int32)
    if self.key_scales is not None:
      return paged_int8.attend_pages(q, self.keys, self.key_scales, self.values, self.value_scales, self.table,
                                     visible, layer, implementation=self.implementation,
                                     block_pages=self.block_pages)
    return paged_attention.attend(q, self.keys, self.values, self.table, visible, layer,
                                  implementation=self.implementation, block_pages=self.block_pages)

  def advance(self, key_mask=None, steps: int = 1) -> "PagedKVCache":
    added = self.live if self.valid is None else jnp.sum(self.valid, axis=1)
    return self.replace(lengths=self.lengths + added.astype(jnp.int32), valid=None)


def write_slots(buffer: jax.Array, new: jax.Array, length: jax.Array, *, axis: int = 1) -> jax.Array:
  """`new` written into `buffer` along its slot axis `axis` at slot `length` (scalar), or row b at
  slot `length[b]` (`[B]`): a mask `[B, S]` (axis 1) from `[B, T]`."""
  new = new.astype(buffer.dtype)
  if jnp.ndim(length) == 0:
    return jax.lax.dynamic_update_slice_in_dim(buffer, new, length, axis=axis)
  row = lambda b, x, at: jax.lax.dynamic_update_slice_in_dim(b, x, at, axis=axis - 1)
  return jax.vmap(row)(buffer, new, length)


def write_layer(stack: jax.Array, new: jax.Array, layer, length: jax.Array) -> jax.Array:
  """`new` `[B, K, T, H]` written into the stacked keys or values `[L, B, K, S, H]` (or `[B, K, T]` into an int8
  cache's scales `[L, B, K, S]`) at layer `layer`, from slot `length` (scalar), or row b from slot `length[b]`
  (`[B]`): an in-place update of T slots."""
  new = new.astype(stack.dtype)
  zero = jnp.zeros((), jnp.int32)
  layer = jnp.asarray(layer, jnp.int32)
  minor = (zero,) * (new.ndim - 3)  # The head dim, where there is one.
  if jnp.ndim(length) == 0:
    return jax.lax.dynamic_update_slice(stack, new[None], (layer, zero, zero, jnp.asarray(length, jnp.int32)) + minor)
  # One token per row at (layer, row, length[row]): a scatter batched over the rows (axis 1, where the stack
  # keeps them: vmapping a slice update over axis 1 would transpose the whole stack), clamped into the slots
  # as a slice update is.
  rows = new.shape[0]
  at = jnp.stack([jnp.broadcast_to(layer, (rows,)), length.astype(jnp.int32)],
                 axis=1)  # [B, 2]: (layer, slot).
  numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(1, new.ndim - 1)),
                                            inserted_window_dims=(0, 3), scatter_dims_to_operand_dims=(0, 3),
                                            operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))
  return jax.lax.scatter(stack, at, new[:, :, 0], numbers, indices_are_sorted=True, unique_indices=True,
                         mode=jax.lax.GatherScatterMode.CLIP)
