"""The refill engine's state and its steps on the slots: pages taken back under pressure, sequences admitted,
pages handed out, prompts given back (`engine.py` runs them in its decode loop; `prefill.py` fills the
prompts' pages).

State (`Slots`): R decode rows over a pool of pages split into Q queues, the N = P·G sequences of the call
(queue q serves sequences [q·N/Q, (q+1)·N/Q) in order, and so prompts [q·P/Q, (q+1)·P/Q)), and the call's
`Prompts`. A prompt holds pages only while it is *resident*: from the start of its prefill (all its ⌈length /
page⌉ pages taken at once) until its last sample ends, or until the pool needs them back while none of its
samples is decoding. Each iteration, before a token is sampled:

  1. `preempt`: when the live rows need more pages this iteration than are free, the queue gives back, in this
     order until the rest fit: resident prompts none of whose samples is decoding, prompts being prefilled
     (latest started first), then rows (latest started first; a row's prompt goes back with its last live
     row). A preempted row's sequence waits to restart from its prompt, a prompt given back is prefilled again
     when next needed: the same keys, values and tokens. A queue that gave anything back admits nothing.
  2. `admit`: free slots take the queue's next sequences, the preempted ones first, in order, while the next
     one's prompt is resident and a page is free for each (beyond the live rows' needs); a new row's page
     table points at its prompt's full pages.
  3. `allocate`: a page for each live row whose next token starts one and for each row just taken (its first
     own page, into which its prompt's last, partly filled page is copied).

Pure JAX, batched over queues (each queue's part of an array on its own devices, `queues.gather`/`scatter`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax.models.kv_cache import PagedKVCache
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import pages as pages_lib
from vapo_jax.rollout.refill import queues as q_lib

# Counters [7] int32 of `Slots.counters`, by index: iterations of the decode loop, those in which a row
# decoded (a partial rollout's budget counts these: a call's first iterations may only prefill), preempted
# rows, their tokens, prompts prefilled, prefill chunks run (lanes × iterations), prompt tokens prefilled.
ITERATIONS, DECODED, PREEMPTIONS, RECOMPUTED, PREFILLS, CHUNKS, PREFILLED = range(7)
_IDLE, _PREFILLING = 2**30 + 2**29, 2**30  # Preemption order keys: idle prompts, then prefills (+ start), then rows.


class Prompts(NamedTuple):
  """The call's P prompts (a partial rollout's: each a problem's prompt and the tokens carried so far)."""

  tokens: jax.Array  # [P, Wp] int32 left-padded.
  lengths: jax.Array  # [P] int32 real tokens.
  table: jax.Array  # [P, Wq] int32 its pages (within its queue) while resident; Pq: none.
  done: jax.Array  # [P] int32 tokens prefilled into them (resident and prefilled: done == lengths).
  logits: jax.Array  # [P, V] float32 next-token logits after the prompt, set when its prefill ends.
  started: jax.Array  # [P] int32 the iteration its (latest) prefill started; -1: not resident.
  users: jax.Array  # [P] int32 samples not yet ended (its pages go back at 0).

  def ready(self) -> jax.Array:
    """`[P]` resident and prefilled: its samples may take slots."""
    return (self.started >= 0) & (self.done >= self.lengths)

  def held(self, pages: int) -> jax.Array:
    """`[P]` int32 pages it holds."""
    return jnp.sum(self.table < pages, axis=1, dtype=jnp.int32)


class Slots(NamedTuple):
  """The decode slots (R rows), the queues (Q), the free pages, the prompts and the outputs (N = P·G)."""

  cache: PagedKVCache  # The pool, each row's page table [R, W] and tokens [R].
  logits: jax.Array  # [R, V] next-token logits of each slot's sequence.
  sequence: jax.Array  # [R] int32 the sequence in the slot (meaningful where live).
  step: jax.Array  # [R] int32 tokens that sequence has generated.
  live: jax.Array  # [R] bool.
  started: jax.Array  # [R] int32 the iteration its sequence started in (the latest are preempted first).
  shared: jax.Array  # [R] int32 the prompt's full pages at the head of its table (not its own).
  queued: jax.Array  # [Q] int32 each queue's next new sequence (queue q serves [q·N/Q, (q+1)·N/Q)).
  waiting: jax.Array  # [Q, N/Q] int32 preempted sequences (within their queue) to restart, a stack...
  waiting_count: jax.Array  # [Q] int32 ...this deep.
  free: pages_lib.FreePages  # Each queue's free pages.
  prompts: Prompts
  lanes: jax.Array  # [Q, Lq] int32 the prompt (within its queue) each prefill lane fills; P/Q: none.
  counters: jax.Array  # [7] int32, by `ITERATIONS`, `DECODED`, ... (module constants).
  outputs: q_lib.Outputs


def start(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, samples_per_prompt: int, slots: int,
          queues: int,
          queue_pages: int, page_tokens: int, block_pages: int, implementation: str, max_response_tokens: int,
          pad_id: int, cache_dtype, lanes: int) -> Slots:
  """R empty slots, an empty pool of `queue_pages` pages per queue, the prompts not yet resident."""
  count, width = prompt_tokens.shape
  table_width = common.table_pages(width, max_response_tokens, page_tokens, block_pages)
  cache = PagedKVCache.zeros(model.cfg, rows=slots, queues=queues, pages=queue_pages, page_tokens=page_tokens,
                             table_pages=table_width, dtype=cache_dtype, implementation=implementation,
                             block_pages=block_pages)
  n, rows = count * samples_per_prompt, lambda shape, dtype, fill=0: q_lib.rows(shape, dtype, fill)
  prompts = Prompts(prompt_tokens.astype(jnp.int32), jnp.sum(prompt_mask, -1).astype(jnp.int32),
                    rows((count, prompt_table_pages(width, page_tokens, block_pages)), jnp.int32,
                         queue_pages),
                    rows((count,), jnp.int32), rows((count, model.cfg.vocab_size), jnp.float32),
                    rows((count,), jnp.int32, -1), rows((count,), jnp.int32, samples_per_prompt))
  zeros = lambda shape: jnp.zeros(shape, jnp.int32)
  return Slots(cache, rows((slots, model.cfg.vocab_size), jnp.float32), rows((slots,), jnp.int32),
               rows((slots,), jnp.int32), rows((slots,), bool), rows((slots,), jnp.int32),
               rows((slots,), jnp.int32),
               jnp.arange(queues, dtype=jnp.int32) * (n // queues), rows((queues, n // queues), jnp.int32),
               zeros((queues,)), pages_lib.initial(queues, queue_pages, zeros((queues,))), prompts,
               rows((queues, lanes), jnp.int32, count // queues), zeros((7,)),
               q_lib.empty_outputs(n, max_response_tokens, pad_id))


def prompt_table_pages(width: int, page_tokens: int, block_pages: int) -> int:
  """A prompt's page table width: its bucket's pages, in whole blocks."""
  pages = -(-width // page_tokens)
  return -(-pages // block_pages) * block_pages


def drained(s: Slots) -> jax.Array:
  return jnp.all(s.queued >= q_lib.queue_ends(s.queued,
                                              s.outputs.lengths.shape[0])) & jnp.all(s.waiting_count == 0)


def finished(s: Slots) -> jax.Array:
  """Every sequence has been started and none is live or waiting to restart."""
  return ~jnp.any(s.live) & drained(s)


def local_sequence(s: Slots) -> jax.Array:
  """`[R]` each slot's sequence within its queue."""
  n, queues, rows = s.outputs.lengths.shape[0], s.queued.shape[0], s.live.shape[0]
  return jnp.clip(s.sequence - q_lib.first_sequence(rows, n, queues), 0, n // queues - 1)


def own_pages(s: Slots) -> jax.Array:
  """`[R, W]` bool: the entries of each row's page table that are its own pages."""
  tg = s.cache.page_tokens
  return pages_lib.row_pages(s.cache.table, s.shared, (s.cache.lengths + tg - 1) // tg)


def release(s: Slots, rows: jax.Array) -> Slots:
  """`s` with the own pages of `rows` `[R]` back in their queues' free lists and their tables cleared."""
  queues, none = s.queued.shape[0], s.cache.pages
  returned = q_lib.by_queue(own_pages(s) & rows[:, None], queues)
  free = pages_lib.give_back(s.free, q_lib.by_queue(s.cache.table, queues), returned)
  table = jnp.where(rows[:, None], none, s.cache.table)
  return s._replace(free=free,
                    cache=s.cache.replace(table=table, lengths=jnp.where(rows, 0, s.cache.lengths)))


def release_prompts(s: Slots, gone: jax.Array) -> Slots:
  """`s` with the prompts `gone` `[P]` no longer resident: their pages back, their prefill lanes free."""
  queues, none = s.queued.shape[0], s.cache.pages
  p = s.prompts
  free = pages_lib.give_back(s.free, q_lib.by_queue(p.table, queues), q_lib.by_queue(
      gone[:, None] & (p.table < none), queues))
  prompts = p._replace(table=jnp.where(gone[:, None], none, p.table), done=jnp.where(gone, 0, p.done),
                       started=jnp.where(gone, -1, p.started))
  per_queue = gone.shape[0] // queues
  lane_gone = jnp.take_along_axis(q_lib.by_queue(gone, queues), jnp.minimum(s.lanes, per_queue - 1),
                                  axis=1) & (
      s.lanes < per_queue)
  return s._replace(free=free, prompts=prompts, lanes=jnp.where(lane_gone, per_queue, s.lanes))


def page_wants(s: Slots) -> jax.Array:
  """`[R]` live rows whose next token starts a page."""
  return s.live & (s.cache.lengths % s.cache.page_tokens == 0)


def live_members(s: Slots, live: jax.Array, samples_per_prompt: int) -> jax.Array:
  """`[P]` int32 each prompt's rows among `live` `[R]`."""
  queues, per_queue = s.queued.shape[0], s.prompts.users.shape[0] // s.queued.shape[0]
  prompt = jnp.where(live, local_sequence(s) // samples_per_prompt, per_queue)  # per_queue: dropped.
  count = jax.vmap(lambda p: jnp.zeros(per_queue, jnp.int32).at[p].add(1, mode="drop"))(q_lib.by_queue(prompt,
                                                                                                       queues))
  return count.reshape(-1)


def preempt(s: Slots, *, samples_per_prompt: int) -> tuple[Slots, jax.Array]:
  """Step 1 of the module docstring (only where a queue's live rows need more pages than it has free). Returns
  the state and which queues gave anything back `[Q]`."""
  queues = s.queued.shape[0]
  need = page_wants(s).astype(jnp.int32)
  short = jnp.sum(q_lib.by_queue(need, queues), axis=1) > s.free.count
  return lax.cond(jnp.any(short), lambda s: _preempt(s, samples_per_prompt=samples_per_prompt),
                  lambda s: (s, jnp.zeros(queues, bool)), s)


def _preempt(s: Slots, *, samples_per_prompt: int) -> tuple[Slots, jax.Array]:
  queues, rows = s.queued.shape[0], s.live.shape[0]
  per, p = s.outputs.lengths.shape[0] // queues, s.prompts
  per_prompt, pages = p.users.shape[0] // queues, s.cache.pages
  need, own = page_wants(s).astype(jnp.int32), jnp.sum(own_pages(s), axis=1, dtype=jnp.int32)
  held, members = p.held(pages), live_members(s, s.live, samples_per_prompt)
  idle, prefilling = (held > 0) & p.ready() & (members == 0), (held > 0) & ~p.ready()
  prompt_order = jnp.where(idle, _IDLE, jnp.where(prefilling, _PREFILLING + p.started, -1))
  row_order = jnp.where(s.live, s.started * rows + jnp.arange(rows, dtype=jnp.int32), -1)
  prompt_of = jnp.where(s.live, local_sequence(s) // samples_per_prompt, per_prompt)
  by_queue = lambda x: q_lib.by_queue(x, queues)

  def choose(prompt_order, held, row_order, need, own, prompt_of, count):  # One queue's prompts, then rows.
    order = jnp.concatenate([prompt_order, row_order])
    is_row = jnp.arange(order.shape[0]) >= per_prompt
    freed = jnp.concatenate([held, own])
    needed = jnp.concatenate([jnp.zeros(per_prompt, jnp.int32), need])
    of = jnp.concatenate([jnp.full(per_prompt, per_prompt), prompt_of])
    ranked = jnp.argsort(-order)
    valid, position = order[ranked] >= 0, jnp.arange(order.shape[0])
    row = valid & is_row[ranked]
    last = jnp.full(per_prompt + 1, -1).at[jnp.where(row, of[ranked], per_prompt)].max(position)
    extra = jnp.where(row & (last[of[ranked]] == position), jnp.append(held, 0)[of[ranked]],
                      0)  # Its prompt too.
    freed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.where(valid, freed[ranked] + extra, 0))])
    removed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.where(valid, needed[ranked], 0))])
    k = jnp.argmax(jnp.sum(needed) - removed <= count + freed)  # Giving back the first k suffices.
    chosen = jnp.zeros(order.shape[0], bool).at[ranked].set((position < k) & valid)
    return chosen[:per_prompt], chosen[per_prompt:]

  gone, chosen = jax.vmap(choose)(*(by_queue(x) for x in (prompt_order, held, row_order, need, own,
                                                          prompt_of)),
                                  s.free.count)
  gone, chosen = gone.reshape(-1), chosen.reshape(-1) & s.live
  local = local_sequence(s)
  rank = jnp.cumsum(by_queue(chosen), axis=1, dtype=jnp.int32) - 1
  at = jnp.where(by_queue(chosen), s.waiting_count[:, None] + rank, per)
  waiting = jax.vmap(lambda w, i, x: w.at[i].set(x, mode="drop"))(s.waiting, at, by_queue(local))
  counters = (s.counters.at[PREEMPTIONS].add(jnp.sum(chosen, dtype=jnp.int32))
              .at[RECOMPUTED].add(jnp.sum(jnp.where(chosen, s.step, 0), dtype=jnp.int32)))
  s = release(s, chosen)._replace(live=s.live & ~chosen, waiting=waiting, counters=counters,
                                  waiting_count=s.waiting_count + jnp.sum(by_queue(chosen), axis=1))
  gone = gone | ((members > 0) & (live_members(s, s.live,
                                               samples_per_prompt) == 0))  # A prompt with its last live row.
  blocked = jnp.any(by_queue(chosen), axis=1) | jnp.any(by_queue(gone), axis=1)
  return release_prompts(s, gone), blocked


def candidates(s: Slots, count: int) -> tuple[jax.Array, jax.Array]:
  """Each queue's next `count` sequences to start, the preempted ones first (latest preempted first), then new
  ones in order: (within their queue `[Q, count]` int32, which exist `[Q, count]` bool)."""
  queues, n = s.queued.shape[0], s.outputs.lengths.shape[0]
  per = n // queues
  rank = jnp.arange(count, dtype=jnp.int32)[None]
  fresh = q_lib.queue_ends(s.queued, n) - s.queued
  waited = jnp.take_along_axis(s.waiting, jnp.clip(s.waiting_count[:, None] - 1 - rank, 0, per - 1), axis=1)
  first = jnp.arange(queues, dtype=jnp.int32)[:, None] * per
  fresh_local = s.queued[:, None] - first + rank - s.waiting_count[:, None]
  local = jnp.where(rank < s.waiting_count[:, None], waited, fresh_local)
  return jnp.clip(local, 0, per - 1), rank < (s.waiting_count + fresh)[:, None]


def admit(s: Slots, blocked: jax.Array, *, samples_per_prompt: int) -> tuple[Slots, jax.Array]:
  """Step 2 of the module docstring; none where `blocked` `[Q]`. Returns the state and the rows taken `[R]`."""
  queues, rows = s.queued.shape[0], s.live.shape[0]
  n, tg, p = s.outputs.lengths.shape[0], s.cache.page_tokens, s.prompts
  free = q_lib.by_queue(~s.live, queues)  # [Q, R/Q]
  need = jnp.sum(q_lib.by_queue(page_wants(s), queues), axis=1, dtype=jnp.int32)
  next_local, exists = candidates(s, rows // queues)
  ready = jnp.take_along_axis(q_lib.by_queue(p.ready(), queues), next_local // samples_per_prompt, axis=1)
  startable = jnp.sum(jnp.cumprod((exists & ready).astype(jnp.int32), axis=1),
                      axis=1)  # In order, to a not ready.
  limit = jnp.where(blocked, 0, jnp.minimum(startable, jnp.maximum(s.free.count - need, 0)))
  rank = jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
  take = free & (rank < limit[:, None])
  local = jnp.take_along_axis(next_local, jnp.clip(rank, 0, rows // queues - 1), axis=1)
  taken = jnp.sum(take, axis=1, dtype=jnp.int32)
  from_stack = jnp.minimum(taken, s.waiting_count)
  take, local = take.reshape(rows), local.reshape(rows)
  prompt = lambda x: q_lib.gather(x, local // samples_per_prompt, queues)  # The queue's own prompt's.
  length = prompt(p.lengths)
  shared = length // tg
  column = jnp.arange(s.cache.table.shape[1], dtype=jnp.int32)[None]
  head = jnp.pad(prompt(p.table), ((0, 0), (0, s.cache.table.shape[1] - p.table.shape[1])),
                 constant_values=s.cache.pages)
  table = jnp.where(take[:, None], jnp.where(column < shared[:, None], head, s.cache.pages), s.cache.table)
  cache = s.cache.replace(table=table, lengths=jnp.where(take, length, s.cache.lengths))
  where = lambda new, old: jnp.where(take.reshape(take.shape + (1,) * (old.ndim - 1)), new, old)
  s = s._replace(cache=cache, logits=where(prompt(p.logits), s.logits),
                 sequence=where(local + q_lib.first_sequence(rows, n, queues), s.sequence),
                 step=where(0, s.step), live=s.live | take, started=where(s.counters[ITERATIONS], s.started),
                 shared=where(shared, s.shared), queued=s.queued + taken - from_stack,
                 waiting_count=s.waiting_count - from_stack)
  return s, take


def allocate(s: Slots, taken: jax.Array, *, samples_per_prompt: int) -> Slots:
  """Step 3 of the module docstring."""
  queues, tg = s.queued.shape[0], s.cache.page_tokens
  want = page_wants(s) | taken
  free, got = pages_lib.take(s.free, q_lib.by_queue(want, queues))
  got = got.reshape(-1)
  column = jnp.minimum(s.cache.lengths // tg, s.cache.table.shape[1] - 1)
  table = jnp.where(want[:, None] & (jnp.arange(s.cache.table.shape[1])[None] == column[:, None]),
                    got[:, None], s.cache.table)
  partial = taken & (s.cache.lengths % tg != 0)
  prompt_table = q_lib.gather(s.prompts.table, local_sequence(s) // samples_per_prompt, queues)
  source = jnp.take_along_axis(prompt_table, jnp.minimum(s.shared, prompt_table.shape[1] - 1)[:, None],
                               axis=1)[:, 0]
  by_queue = lambda x: q_lib.by_queue(x, queues)
  copy = lambda pool: pages_lib.copy_pages(pool, by_queue(source), by_queue(got), by_queue(partial))
  cache = s.cache.replace(**{name: copy(pool) for name, pool in s.cache.pool_arrays().items()}, table=table)
  return s._replace(cache=cache, free=free)


def finish_prompts(s: Slots, ended: jax.Array, *, samples_per_prompt: int) -> Slots:
  """One fewer user for each ended row's prompt; a prompt left with none goes back (`release_prompts`)."""
  queues = s.queued.shape[0]
  per_queue = s.prompts.users.shape[0] // queues
  prompt = jnp.where(ended, local_sequence(s) // samples_per_prompt, per_queue)  # per_queue: dropped.
  users = jax.vmap(lambda u, p: u.at[p].add(-1, mode="drop"))(q_lib.by_queue(s.prompts.users, queues),
                                                               q_lib.by_queue(prompt, queues)).reshape(-1)
  done = (users == 0) & (s.prompts.users > 0)
  return release_prompts(s._replace(prompts=s.prompts._replace(users=users)), done)
