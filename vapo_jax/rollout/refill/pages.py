"""The pages of a paged KV cache (`models/kv_cache.PagedKVCache`), handed out and taken back on the device.

Each queue (`rollout/refill/queues.py`) owns Pq pages of the pool; its free pages are a stack `[Q, Pq]` with a
depth `[Q]`, updated inside the decode loop with no host round trip:

  free = initial(queues, pages, used)           # pages [used_q, Pq) of queue q free (the prompts hold the rest)
  free, got = take(free, want)                  # want `[Q, M]` bool: each wanting entry pops one page
  free = give_back(free, pages, returned)       # pages `[Q, M]` int32 pushed where `returned`

and the prompts' pages: `prompt_pages` lays each queue's prompts end to end from page 0, `write_prompts` puts the
prefill's keys and values there (padding dropped), and `copy_pages` copies a prompt's last, partly filled page
into a new row's own page (in place, every layer).

A row's page table entry Pq means "no page" (`PagedKVCache` drops writes there). `take` never hands out more
pages than are free: an entry beyond the depth gets Pq, and the caller plans its wants from `count`
(the refill engine preempts before it would ask for more). `peak` is the most pages in use at once.
Pure JAX, batched over queues.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax.rollout.refill import queues as q_lib


class FreePages(NamedTuple):
  stack: jax.Array  # [Q, Pq] int32: entries [0, count) are free page ids.
  count: jax.Array  # [Q] int32 free pages.
  peak: jax.Array  # [Q] int32: the most pages in use at once so far.

  @property
  def pages(self) -> int:
    return self.stack.shape[1]


def initial(queues: int, pages: int, used: jax.Array) -> FreePages:
  """Queue q's pages [used[q], Pq) free (its first used[q] pages hold its prompts)."""
  used = jnp.asarray(used, jnp.int32)
  stack = (used[:, None] + jnp.arange(pages, dtype=jnp.int32)[None]).astype(jnp.int32)
  return FreePages(jnp.where(stack < pages, stack, pages), pages - used, used)


def take(free: FreePages, want: jax.Array) -> tuple[FreePages, jax.Array]:
  """One page for each wanting entry of `want` `[Q, M]`, in order, while free pages last: (the free pages
  left, the pages `[Q, M]`: Pq where none was wanted or none was left)."""
  pages = free.pages
  rank = jnp.cumsum(want, axis=1, dtype=jnp.int32) - 1
  granted = want & (rank < free.count[:, None])
  index = jnp.clip(free.count[:, None] - 1 - rank, 0, pages - 1)
  got = jnp.where(granted, jnp.take_along_axis(free.stack, index, axis=1), pages)
  count = free.count - jnp.sum(granted, axis=1, dtype=jnp.int32)
  return FreePages(free.stack, count, jnp.maximum(free.peak, pages - count)), got


def give_back(free: FreePages, pages: jax.Array, returned: jax.Array) -> FreePages:
  """`free` with `pages[q, i]` pushed for every `returned[q, i]` (`[Q, M]`, any M)."""
  size = free.pages
  flat_pages, flat = pages.reshape(pages.shape[0], -1), returned.reshape(returned.shape[0], -1)
  position = free.count[:, None] + jnp.cumsum(flat, axis=1, dtype=jnp.int32) - flat
  position = jnp.where(flat, position, size)  # size: dropped.
  stack = jax.vmap(lambda s, at, p: s.at[at].set(p, mode="drop"))(free.stack, position, flat_pages.astype(jnp.int32))
  return FreePages(stack, free.count + jnp.sum(flat, axis=1, dtype=jnp.int32), free.peak)


def row_pages(table: jax.Array, first: jax.Array, held: jax.Array) -> jax.Array:
  """`[R, W]` bool: which entries of each row's page table `[R, W]` are its own pages: [first[r], held[r])."""
  column = jnp.arange(table.shape[1], dtype=jnp.int32)[None]
  return (column >= first[:, None]) & (column < held[:, None])


def prompt_pages(lengths: jax.Array, queues: int, pages: int, page_tokens: int, width: int):
  """Each prompt's pages, laid end to end in its queue from page 0: (table `[P, Wp]`, pages used `[Q]`)."""
  held = (lengths + page_tokens - 1) // page_tokens
  by_queue = q_lib.by_queue(held, queues)
  first = (jnp.cumsum(by_queue, axis=1, dtype=jnp.int32) - by_queue).reshape(-1)
  column = jnp.arange(width, dtype=jnp.int32)[None]
  table = jnp.where(column < held[:, None], first[:, None] + column, pages).astype(jnp.int32)
  return table, jnp.sum(by_queue, axis=1, dtype=jnp.int32)


def write_prompts(pool: jax.Array, padded: jax.Array, lengths: jax.Array, table: jax.Array) -> jax.Array:
  """The prefill's left-padded keys or values `[L, P, K, Tp, H]` into the pool `[K, L, Q, Pq, Tg, H]`: prompt p's
  real tokens from logical slot 0, at its pages `table[p]` (a scatter batched over queues)."""
  layers, count, kv_heads, tp, h = padded.shape
  queues, tg, width = pool.shape[2], pool.shape[4], table.shape[1]
  source = tp - lengths[:, None] + jnp.arange(width * tg)[None]  # [P, Wp·Tg]; ≥ Tp past the prompt.
  tokens = jnp.take_along_axis(padded, jnp.minimum(source, tp - 1)[None, :, None, :, None], axis=3)
  tokens = tokens.reshape(layers, queues, count // queues, kv_heads, width, tg, h)

  def put(part, new, ids):  # part [K, L, Pq, Tg, H]; new [L, P/Q, K, Wp, Tg, H]; ids [P/Q, Wp].
    new = new.transpose(2, 0, 1, 3, 4, 5).reshape(kv_heads, layers, -1, tg, h)
    return part.at[:, :, ids.reshape(-1)].set(new.astype(part.dtype), mode="drop")
  return jax.vmap(put, in_axes=(2, 1, 0), out_axes=2)(pool, tokens, q_lib.by_queue(table, queues))


def copy_pages(pool: jax.Array, source: jax.Array, target: jax.Array, copies: jax.Array) -> jax.Array:
  """`pool` `[K, L, Q, Pq, Tg, H]` with page `source[q, i]` copied to `target[q, i]` (every layer) for each
  `copies[q, i]`, one page per queue at a time in place: no iteration when nothing is copied."""
  order = jnp.argsort(~copies, axis=1, stable=True)
  source, target = (jnp.take_along_axis(x, order, axis=1) for x in (source, target))
  counts = jnp.sum(copies, axis=1, dtype=jnp.int32)

  def one(i, pool):
    s, t = source[:, i], jnp.where(i < counts, target[:, i], pool.shape[3])  # Pq: dropped.
    copy = lambda part, s, t: part.at[:, :, t].set(part[:, :, s], mode="drop")
    return jax.vmap(copy, in_axes=(2, 0, 0), out_axes=2)(pool, s, t)
  return lax.fori_loop(0, jnp.max(counts), one, pool)
