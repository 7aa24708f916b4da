"""One-token decode attention that reads only the filled part of a KV cache.

A decode step appends one token per row to a cache of S slots and attends over it. Row b's query
sits at slot `query_slots[b]` (its cache length before the step) and sees slot s iff
`key_mask[b, s]` and s ≤ query_slots[b]:

  out[b] = Σ_s softmax_s(q_b·k_s / √H) v_s   over the visible s;   0 where nothing is visible.

`attend_one` visits key/value blocks of `block` slots from slot 0 up to the block holding the
largest query slot of the batch — a dynamic trip count (`lax.fori_loop` with a traced bound), so
a step costs what has been written, not what was allocated (a 4,096-slot cache with 256 live
tokens reads 256–512 slots, not 4,096). Blocks are combined with an online softmax (Milakov &
Gimelshein 2018; the decode half of FlashAttention, Dao et al. 2022) in float32. When S is not a
multiple of `block`, the last block is read shifted back to end at slot S and its repeated
slots are masked. Keys and values are read in the cache's heads-major `[B, K, S, H]` layout: a block
is a slice of the slot axis, no transpose or copy of the cache (split over K, each chip reads its own
heads).

`attend_one_reference` is the dense masked softmax over all S slots: the oracle of the tests and
the "full-cache" baseline of the benchmark. Pure JAX; no flax, no config.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def default_block(platform: str | None = None) -> int:
  """Slots per key/value block on `platform` (default: JAX's backend): 64 on a CPU (a block of keys and
  values stays in cache: at batch 16, 2 kv heads of 64 dims and 768 live slots, 5.6 ms per layer
  against 10 ms with blocks of 256 and 12.6 ms reading every slot), 512 on GPU / TPU (each loop
  iteration costs kernel launches)."""
  return 64 if (platform or jax.default_backend()) == "cpu" else 512


def attend_one_reference(q: jax.Array, keys: jax.Array, values: jax.Array, key_mask: jax.Array,
                         query_slots: jax.Array) -> jax.Array:
  """Dense decode attention. q `[B, N, H]`; keys/values `[B, K, S, H]`; key_mask `[B, S]`;
  query_slots `[B]` int. Returns `[B, N, H]` in q's dtype."""
  b, n, h = q.shape
  kv_heads = keys.shape[1]
  dtype = q.dtype
  qg = q.reshape(b, kv_heads, n // kv_heads, h)  # [B, K, G, H]
  scores = jnp.einsum("BKGH,BKSH->BKGS", qg, keys.astype(dtype)).astype(jnp.float32) * (h ** -0.5)
  visible = key_mask.astype(bool) & (jnp.arange(keys.shape[2])[None] <= query_slots[:, None])  # [B, S]
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("BKGS,BKSH->BKGH", probs, values.astype(dtype)).reshape(b, n, h)
  return jnp.where(visible.any(-1)[:, None, None], out, 0).astype(dtype)


def attend_one(q: jax.Array, keys: jax.Array, values: jax.Array, key_mask: jax.Array, query_slots: jax.Array,
               *, block: int | None = None, layer: jax.Array | int | None = None, key_scales=None,
               value_scales=None) -> jax.Array:
  """Length-bounded decode attention: `attend_one_reference` reading only blocks [0, ⌈(max slot + 1)/block⌉)
  (`block` None: `default_block()`). With `layer`, keys and values are a stack of layers `[L, B, K, S, H]`
  and each block is read as a (layer, block) slice of it: the layer's cache is never copied. int8 keys and
  values come with their scales `[L, B, K, S]` (`[B, K, S]` without `layer`): each block is dequantised
  (q·s in float32) as it is read."""
  if layer is None:
    keys, values, layer = keys[None], values[None], 0
    key_scales, value_scales = (None if x is None else x[None] for x in (key_scales, value_scales))
  b, n, h = q.shape
  kv_heads, slots = keys.shape[2], keys.shape[3]
  zero, layer = jnp.zeros((), jnp.int32), jnp.asarray(layer, jnp.int32)
  block = min(block or default_block(), slots)
  dtype = q.dtype
  qg = q.reshape(b, kv_heads, n // kv_heads, h)  # [B, K, G, H]
  key_mask = key_mask.astype(bool)
  query_slots = query_slots.astype(jnp.int32)

  def step(j, carry):
    nominal = j * block
    start = jnp.minimum(nominal, slots - block)  # The last block ends at slot S.
    def read(x, scales):
      got = lax.dynamic_slice(x, (layer, zero, zero, start, zero), (1, b, kv_heads, block, h))[0]
      if scales is None:
        return got.astype(dtype)
      scale = lax.dynamic_slice(scales, (layer, zero, zero, start), (1, b, kv_heads, block))[0]
      return (got.astype(jnp.float32) * scale[..., None]).astype(dtype)
    slot = start + jnp.arange(block)
    visible = (lax.dynamic_slice_in_dim(key_mask, start, block, axis=1) & (slot >= nominal)[None]
               & (slot[None] <= query_slots[:, None]))  # [B, block]
    return accumulate(carry, qg, read(keys, key_scales), read(values, value_scales), visible, heads="BKSH")

  live_blocks = jnp.minimum((jnp.max(query_slots) + block) // block, -(-slots // block))
  return finish(lax.fori_loop(0, live_blocks, step, start_carry(qg)), dtype)


def start_carry(qg: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The online softmax's start for grouped queries `[B, K, G, H]`: running max, normaliser, output (float32)."""
  rows = qg.shape[:3]
  return (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
          jnp.zeros(rows + qg.shape[3:], jnp.float32))


def accumulate(carry, qg: jax.Array, kb: jax.Array, vb: jax.Array, visible: jax.Array, *, heads: str):
  """One block of keys and values into the online softmax: queries `[B, K, G, H]`, the block's keys and
  values `[B, K, S, H]` (`heads="BKSH"`) or `[K, B, S, H]` (`"KBSH"`: gathered pages), `visible` `[B, S]`."""
  m, l, acc = carry  # Running max [B, K, G], normaliser [B, K, G], output [B, K, G, H] (float32).
  h = qg.shape[-1]
  s = jnp.einsum(f"BKGH,{heads}->BKGS", qg, kb, preferred_element_type=jnp.float32) * (h ** -0.5)
  s = jnp.where(visible[:, None, None], s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(-1))
  m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # Rows with nothing visible yet stay at 0.
  p = jnp.exp(s - m_ref[..., None])
  alpha = jnp.exp(m - m_ref)
  pv = jnp.einsum(f"BKGS,{heads}->BKGH", p.astype(qg.dtype), vb, preferred_element_type=jnp.float32)
  return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv


def finish(carry, dtype) -> jax.Array:
  """The online softmax's output `[B, N, H]` in `dtype`: 0 for rows that saw nothing."""
  _, l, acc = carry
  seen = l > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  b, k, g, h = out.shape
  return out.reshape(b, k * g, h).astype(dtype)


def read_tokens(query_slots, *, rows: int, block: int, slots: int | None = None) -> int:
  """Cache slots `attend_one` reads in one decode step of `rows` rows: every row the blocks up to the batch's
  longest (`query_slots`: each live row's query slot), at most the cache's `slots`; × a slot's keys and values
  at every layer: its bytes."""
  longest = int(np.max(query_slots, initial=-1))
  read = -(-(longest + 1) // block) * block
  return rows * (read if slots is None else min(read, slots))
