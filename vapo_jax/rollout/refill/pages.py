"""The pages of a paged KV cache (`models/kv_cache.PagedKVCache`), handed out and taken back on the device.

Each queue (`rollout/refill/queues.py`) owns Pq pages of the pool; its free pages are a stack `[Q, Pq]` with a
depth `[Q]`, updated inside the decode loop with no host round trip:

  free = initial(queues, pages, used)           # pages [used_q, Pq) of queue q free
  free, got = take(free, want)                  # want `[Q, M]` bool: each wanting entry pops one page
  free, got = take_many(free, counts, width)    # counts `[Q, M]`: entry m pops counts[q, m] (a prompt's pages)
  free = give_back(free, pages, returned)       # pages `[Q, M]` int32 pushed where `returned`

and `copy_pages`, which copies a prompt's last, partly filled page into a new row's own page (in place, every
layer).

A row's page table entry Pq means "no page" (`PagedKVCache` drops writes there). `take` never hands out more
pages than are free: an entry beyond the depth gets Pq, and the caller plans its wants from `count`
(the refill engine preempts before it would ask for more). `peak` is the most pages in use at once.
Pure JAX, batched over queues.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


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


def take_many(free: FreePages, counts: jax.Array, width: int) -> tuple[FreePages, jax.Array]:
  """`counts[q, m]` pages for each entry of `[Q, M]`, in order, while free pages last (the caller asks only
  for what is free): (the free pages left, the pages `[Q, M, width]`, Pq past each entry's count)."""
  pages = free.pages
  queues, entries = counts.shape
  column = jnp.arange(width, dtype=jnp.int32)
  rank = (jnp.cumsum(counts, axis=1, dtype=jnp.int32) - counts)[..., None] + column  # [Q, M, width]
  granted = (column < counts[..., None]) & (rank < free.count[:, None, None])
  index = jnp.clip(free.count[:, None, None] - 1 - rank, 0, pages - 1).reshape(queues, -1)
  got = jnp.take_along_axis(free.stack, index, axis=1).reshape(queues, entries, width)
  count = free.count - jnp.sum(granted, axis=(1, 2), dtype=jnp.int32)
  return FreePages(free.stack, count, jnp.maximum(free.peak, pages - count)), jnp.where(granted, got, pages)


def give_back(free: FreePages, pages: jax.Array, returned: jax.Array) -> FreePages:
  """`free` with `pages[q, i]` pushed for every `returned[q, i]` (`[Q, M]`, any M)."""
  size = free.pages
  flat_pages, flat = pages.reshape(pages.shape[0], -1), returned.reshape(returned.shape[0], -1)
  position = free.count[:, None] + jnp.cumsum(flat, axis=1, dtype=jnp.int32) - flat
  position = jnp.where(flat, position, size)  # size: dropped.
  stack = jax.vmap(lambda s, at, p: s.at[at].set(p, mode="drop"))(free.stack, position,
                                                                  flat_pages.astype(jnp.int32))
  return FreePages(stack, free.count + jnp.sum(flat, axis=1, dtype=jnp.int32), free.peak)


def row_pages(table: jax.Array, first: jax.Array, held: jax.Array) -> jax.Array:
  """`[R, W]` bool: which entries of each row's page table `[R, W]` are its own pages: [first[r], held[r])."""
  column = jnp.arange(table.shape[1], dtype=jnp.int32)[None]
  return (column >= first[:, None]) & (column < held[:, None])


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
