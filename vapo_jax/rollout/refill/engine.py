"""The refill engine: decode slots over a paged KV cache, refilled as sequences end (continuous batching).

Response lengths in long chain-of-thought RL are long-tailed: most responses end early, a few run to the
cap. R decode slots (rows) run the N = P·G sequences of a step as Q queues (`rollout/refill/queues.py`), and their
keys and values live in a pool of pages (`models/kv_cache.PagedKVCache`, `rollout/refill/pages.py`), so memory
follows the live tokens rather than R × the longest possible sequence, and each row's attention reads
only its own pages (`models/paged_attention.py`: the Pallas kernel on TPU):

  1. prefill the P prompts once (`common.prefill`) and write each prompt's real tokens into pages of its
     queue (`start`); a group's G samples share them: the prompt is stored once;
  2. each iteration: free slots take the next sequences of their queue (preempted ones first) while pages
     last; a new row's page table points at its prompt's full pages and one page of its own, into which
     the prompt's last, partly filled page is copied (one page per layer: at most one copy per refill);
     a row whose next token starts a page takes a page from the queue's free list; every live row
     samples one token and writes it at its own position (`Slots.cache.lengths`); a row that sampled a
     stop token or reached its length gives its own pages back, and a prompt whose samples have all
     ended gives back its pages;
  3. out of pages: before a step would need more pages than are free, the queue preempts its rows that
     started last until the rest fit: their pages go back and their sequences are queued again, to
     restart from the prompt (`rollout/preemptions`, and the tokens to decode again,
     `rollout/recomputed_tokens`); a queue that preempted takes no new sequence in that iteration.
     Sequence n samples its step t with `fold_in(fold_in(key, n), t)`, so a restarted sequence samples
     the same tokens, and a row's numbers depend on neither its slot nor its neighbours: the static
     engine's tokens, whatever the slots, pages or preemptions;
  4. the step ends when every queue is empty and no slot is live; in the tail (queues empty, at most
     half the slots live) the rows shrink to `min_slots`·2^k (a gather of each row's table and state:
     the pool does not move) so stragglers decode in a small batch.

Slots and pages are separate settings (`rollout/plan.py`); a sequence that cannot fit a queue's pool even
alone beside its queue's prompts is refused before anything runs (`common.check_pool`).

Iterations run on the device, `steps_per_call` of them per host call (`lax.while_loop`, leaving early
when everything has finished or the slots can shrink; `queues.drive` is the host loop). Outputs are
written by sequence (`[N, Tr]`, split over the batch axes): the `Rollout` has the static engine's row
order. `contiguous.py` is the same engine over a contiguous cache: the reference.
"""

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vapo_jax import distributed
from vapo_jax.models.kv_cache import PagedKVCache
from vapo_jax.models.sharding import constrain
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import pages as pages_lib
from vapo_jax.rollout.refill import queues as q_lib
from vapo_jax.rollout.refill import resumed as resumed_lib


class Prompts(NamedTuple):
  """The prefilled prompts, read when a slot takes a new sequence."""

  table: jax.Array  # [P, Wp] int32 page ids (within the prompt's queue) of each prompt's pages; Pq past them.
  lengths: jax.Array  # [P] int32 real prompt tokens: the position of the first response token.
  logits: jax.Array  # [P, V] next-token logits after the prompt.


class Slots(NamedTuple):
  """The decode slots (R rows), the queues (Q), the free pages and the outputs (N = P·G sequences)."""

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
  users: jax.Array  # [P] int32 samples of the prompt not yet ended (its pages go back at 0).
  counters: jax.Array  # [3] int32: decode iterations, preemptions, tokens decoded again after them.
  outputs: q_lib.Outputs


def start(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, group: int, slots: int, queues: int,
          queue_pages: int, page_tokens: int, block_pages: int, implementation: str, max_response_tokens: int,
          pad_id: int, cache_dtype) -> tuple[Prompts, Slots]:
  """Prefills the prompts into pages of their queues (`queue_pages` each) and builds R empty slots."""
  prompt_mask = prompt_mask.astype(bool)
  logits, prefilled = common.prefill(model, prompt_tokens, prompt_mask, cache_dtype=cache_dtype, decode_block=None)
  lengths = jnp.sum(prompt_mask, -1).astype(jnp.int32)
  count, prompt_len = prompt_tokens.shape
  width = common.table_pages(prompt_len, max_response_tokens, page_tokens, block_pages)
  table, used = pages_lib.prompt_pages(lengths, queues, queue_pages, page_tokens, -(-prompt_len // page_tokens))
  cache = PagedKVCache.zeros(model.cfg, rows=slots, queues=queues, pages=queue_pages, page_tokens=page_tokens,
                             table_pages=width, dtype=cache_dtype, implementation=implementation,
                             block_pages=block_pages)
  cache = cache.replace(keys=pages_lib.write_prompts(cache.keys, prefilled.keys, lengths, table),
                        values=pages_lib.write_prompts(cache.values, prefilled.values, lengths, table))
  n, rows = count * group, lambda dtype: q_lib.rows((slots,), dtype)
  zeros = lambda shape: jnp.zeros(shape, jnp.int32)
  state = Slots(cache, q_lib.rows((slots, logits.shape[-1]), jnp.float32), rows(jnp.int32), rows(jnp.int32),
                rows(bool), rows(jnp.int32), rows(jnp.int32), jnp.arange(queues, dtype=jnp.int32) * (n // queues),
                q_lib.rows((queues, n // queues), jnp.int32), zeros((queues,)),
                pages_lib.initial(queues, queue_pages, used), jnp.full((count,), group, jnp.int32), zeros((3,)),
                q_lib.empty_outputs(n, max_response_tokens, pad_id))
  return Prompts(table, lengths, logits), state


def _drained(s: Slots) -> jax.Array:
  return jnp.all(s.queued >= q_lib.queue_ends(s.queued, s.outputs.lengths.shape[0])) & jnp.all(s.waiting_count == 0)


def finished(s: Slots) -> jax.Array:
  """Every sequence has been started and none is live or waiting to restart."""
  return ~jnp.any(s.live) & _drained(s)


def _own_pages(s: Slots) -> jax.Array:
  """`[R, W]` bool: the entries of each row's page table that are its own pages."""
  tg = s.cache.page_tokens
  return pages_lib.row_pages(s.cache.table, s.shared, (s.cache.lengths + tg - 1) // tg)


def _release(s: Slots, rows: jax.Array) -> Slots:
  """`s` with the own pages of `rows` `[R]` back in their queues' free lists and their tables cleared."""
  queues, none = s.queued.shape[0], s.cache.pages
  returned = q_lib.by_queue(_own_pages(s) & rows[:, None], queues)
  free = pages_lib.give_back(s.free, q_lib.by_queue(s.cache.table, queues), returned)
  table = jnp.where(rows[:, None], none, s.cache.table)
  return s._replace(free=free, cache=s.cache.replace(table=table, lengths=jnp.where(rows, 0, s.cache.lengths)))


def _page_wants(s: Slots) -> jax.Array:
  """`[R]` live rows whose next token starts a page."""
  return s.live & (s.cache.lengths % s.cache.page_tokens == 0)


def preempt(s: Slots) -> tuple[Slots, jax.Array]:
  """Where a queue's live rows need more pages this iteration than it has free, its rows that started last
  (then the highest slots) are preempted until the rest fit: their pages go back, their sequences wait to
  restart. Returns the state and which queues preempted `[Q]`."""
  queues, rows = s.queued.shape[0], s.live.shape[0]
  per = s.outputs.lengths.shape[0] // queues
  need, own = _page_wants(s).astype(jnp.int32), jnp.sum(_own_pages(s), axis=1, dtype=jnp.int32)
  order = jnp.where(s.live, s.started * rows + jnp.arange(rows, dtype=jnp.int32), -1)

  def choose(order, need, own, count):  # One queue: [Rq] each; count scalar. The rows to preempt.
    ranked = jnp.argsort(-order)
    live = order[ranked] >= 0
    removed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.where(live, need[ranked], 0))])
    freed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.where(live, own[ranked], 0))])
    fits = jnp.sum(need) - removed <= count + freed  # Preempting the first k rows suffices: [Rq + 1].
    k = jnp.argmax(fits)
    return jnp.zeros_like(live).at[ranked].set(jnp.arange(ranked.shape[0]) < k)

  chosen = jax.vmap(choose)(*(q_lib.by_queue(x, queues) for x in (order, need, own)), s.free.count)
  chosen = chosen.reshape(rows) & s.live
  local = jnp.clip(s.sequence - q_lib.first_sequence(rows, per * queues, queues), 0, per - 1)
  rank = jnp.cumsum(q_lib.by_queue(chosen, queues), axis=1, dtype=jnp.int32) - 1
  at = jnp.where(q_lib.by_queue(chosen, queues), s.waiting_count[:, None] + rank, per)
  waiting = jax.vmap(lambda w, i, x: w.at[i].set(x, mode="drop"))(s.waiting, at, q_lib.by_queue(local, queues))
  counters = s.counters + jnp.stack([0, jnp.sum(chosen), jnp.sum(jnp.where(chosen, s.step, 0))]).astype(jnp.int32)
  s = _release(s, chosen)._replace(live=s.live & ~chosen, waiting=waiting, counters=counters,
                                   waiting_count=s.waiting_count + jnp.sum(q_lib.by_queue(chosen, queues), axis=1))
  return s, jnp.any(q_lib.by_queue(chosen, queues), axis=1)


def admit(prompts: Prompts, s: Slots, blocked: jax.Array, *, group: int) -> tuple[Slots, jax.Array]:
  """Each queue's free slots take its waiting sequences, then its next ones, while its free pages cover one
  page for each (and the pages its live rows need this iteration); none where `blocked` `[Q]`. A new row
  points at its prompt's full pages. Returns the state and the rows taken `[R]`."""
  queues, rows = s.queued.shape[0], s.live.shape[0]
  n = s.outputs.lengths.shape[0]
  per, tg = n // queues, s.cache.page_tokens
  free = q_lib.by_queue(~s.live, queues)  # [Q, R/Q]
  need = jnp.sum(q_lib.by_queue(_page_wants(s), queues), axis=1, dtype=jnp.int32)
  fresh = q_lib.queue_ends(s.queued, n) - s.queued
  limit = jnp.where(blocked, 0, jnp.minimum(s.waiting_count + fresh, jnp.maximum(s.free.count - need, 0)))
  rank = jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
  take = free & (rank < limit[:, None])
  from_waiting = rank < s.waiting_count[:, None]
  waited = jnp.take_along_axis(s.waiting, jnp.clip(s.waiting_count[:, None] - 1 - rank, 0, per - 1), axis=1)
  first = jnp.arange(queues, dtype=jnp.int32)[:, None] * per
  local = jnp.where(from_waiting, waited, s.queued[:, None] - first + rank - s.waiting_count[:, None])
  taken = jnp.sum(take, axis=1, dtype=jnp.int32)
  from_stack = jnp.minimum(taken, s.waiting_count)
  take, local = take.reshape(rows), jnp.clip(local.reshape(rows), 0, per - 1)
  prompt = lambda x: q_lib.gather(x, local // group, queues)  # The queue's own prompt's.
  length, shared = prompt(prompts.lengths), prompt(prompts.lengths) // tg
  column = jnp.arange(s.cache.table.shape[1], dtype=jnp.int32)[None]
  head = jnp.pad(prompt(prompts.table), ((0, 0), (0, s.cache.table.shape[1] - prompts.table.shape[1])),
                 constant_values=s.cache.pages)
  table = jnp.where(take[:, None], jnp.where(column < shared[:, None], head, s.cache.pages), s.cache.table)
  cache = s.cache.replace(table=table, lengths=jnp.where(take, length, s.cache.lengths))
  where = lambda new, old: jnp.where(take.reshape(take.shape + (1,) * (old.ndim - 1)), new, old)
  s = s._replace(cache=cache, logits=where(prompt(prompts.logits), s.logits),
                 sequence=where(local + q_lib.first_sequence(rows, n, queues), s.sequence),
                 step=where(0, s.step), live=s.live | take, started=where(s.counters[0], s.started),
                 shared=where(shared, s.shared), queued=s.queued + taken - from_stack,
                 waiting_count=s.waiting_count - from_stack)
  return s, take


def allocate(prompts: Prompts, s: Slots, taken: jax.Array, *, group: int) -> Slots:
  """A page for every live row whose next token starts one, and for every row just taken (its first own page,
  into which its prompt's partly filled last page is copied)."""
  queues, tg = s.queued.shape[0], s.cache.page_tokens
  want = _page_wants(s) | taken
  free, got = pages_lib.take(s.free, q_lib.by_queue(want, queues))
  got = got.reshape(-1)
  column = jnp.minimum(s.cache.lengths // tg, s.cache.table.shape[1] - 1)
  table = jnp.where(want[:, None] & (jnp.arange(s.cache.table.shape[1])[None] == column[:, None]), got[:, None],
                    s.cache.table)
  per = s.outputs.lengths.shape[0] // queues
  local = jnp.clip(s.sequence - q_lib.first_sequence(s.live.shape[0], per * queues, queues), 0, per - 1)
  partial = taken & (s.cache.lengths % tg != 0)
  source = jnp.take_along_axis(q_lib.gather(prompts.table, local // group, queues),
                               jnp.minimum(s.shared, prompts.table.shape[1] - 1)[:, None], axis=1)[:, 0]
  by_queue = lambda x: q_lib.by_queue(x, queues)
  copy = lambda pool: pages_lib.copy_pages(pool, by_queue(source), by_queue(got), by_queue(partial))
  cache = s.cache.replace(keys=copy(s.cache.keys), values=copy(s.cache.values), table=table)
  return s._replace(cache=cache, free=free)


def _finish_prompts(s: Slots, prompts: Prompts, ended: jax.Array, local: jax.Array, *, group: int) -> Slots:
  """One fewer user for each ended row's prompt; a prompt left with none gives its pages back."""
  queues = s.queued.shape[0]
  per_queue = s.users.shape[0] // queues
  prompt = jnp.where(ended, local // group, per_queue)  # per_queue: dropped.
  users = jax.vmap(lambda u, p: u.at[p].add(-1, mode="drop"))(q_lib.by_queue(s.users, queues),
                                                               q_lib.by_queue(prompt, queues)).reshape(-1)
  done = (users == 0) & (s.users > 0)
  held = prompts.table < s.cache.pages
  free = pages_lib.give_back(s.free, q_lib.by_queue(prompts.table, queues), q_lib.by_queue(held & done[:, None],
                                                                                           queues))
  return s._replace(users=users, free=free)


def decode(model, prompts: Prompts, state: Slots, key: jax.Array, length_limits: jax.Array | None = None,
           resumed: resumed_lib.Resumed | None = None, *, sampling: common.Sampling, group: int, steps: int,
           shrink_at: int = 0) -> tuple[Slots, jax.Array]:
  """Up to `steps` iterations (module docstring, step 2), leaving early when every sequence has finished or the
  slots can shrink (the queues are empty and `rows_needed` ≤ `shrink_at` > 0), or at `resumed.budget`
  iterations in all. Returns the state and its status `[4]` int32: finished, can shrink, rows needed, decode
  iterations run so far."""
  n, max_response_tokens = state.outputs.tokens.shape
  queues, rows = state.queued.shape[0], state.live.shape[0]
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = jnp.full((n,), max_response_tokens, jnp.int32) if length_limits is None else length_limits.astype(jnp.int32)
  first = q_lib.first_sequence(rows, n, queues)

  def one_step(s: Slots) -> Slots:
    s, blocked = preempt(s)
    s, taken = admit(prompts, s, blocked, group=group)
    s = allocate(prompts, s, taken, group=group)
    live, local = s.live, jnp.clip(s.sequence - first, 0, n // queues - 1)
    ids, t = s.sequence, s.step
    if resumed is not None:  # Sequence `ids[n]` continued at its token `offsets[n]`: its key and step as begun.
      ids, t = q_lib.gather(resumed.ids, local, queues), t + q_lib.gather(resumed.offsets, local, queues)
    keys = jax.vmap(lambda seq, t: jax.random.fold_in(jax.random.fold_in(key, seq), t))(ids, t)
    tokens, sampler, policy = common.sample_tokens(keys, s.logits, sampling)
    tokens = jnp.where(live, tokens, 0)
    stop = live & jnp.isin(tokens, stop_ids)
    ended = live & (stop | (s.step + 1 >= q_lib.gather(limits, local, queues)))
    outputs = q_lib.record(s.outputs, local, live, ended, stop, s.step, tokens, sampler, policy, queues)
    logits, cache = model(tokens[:, None], s.cache.lengths[:, None], live[:, None], s.cache)
    s = s._replace(cache=cache, logits=logits[:, -1], step=jnp.where(live, s.step + 1, s.step), live=live & ~ended,
                   outputs=outputs, counters=s.counters.at[0].add(1))
    return _finish_prompts(_release(s, ended), prompts, ended, local, group=group)

  def can_shrink(s: Slots) -> jax.Array:
    return (shrink_at > 0) & _drained(s) & (q_lib.rows_needed(s.live, queues) <= shrink_at)

  def cond(carry):
    i, s = carry
    within = True if resumed is None else s.counters[0] < resumed.budget
    return (i < steps) & ~finished(s) & ~can_shrink(s) & within

  with jax.named_scope(common.DECODE_LOOP):  # Names the loop in the HLO (the compile report reads its traffic).
    _, state = lax.while_loop(cond, lambda carry: (carry[0] + 1, one_step(carry[1])),
                              (jnp.zeros((), jnp.int32), state))
  ended = finished(state) if resumed is None else finished(state) | (state.counters[0] >= resumed.budget)
  status = jnp.stack([ended.astype(jnp.int32), can_shrink(state).astype(jnp.int32),
                      q_lib.rows_needed(state.live, queues), state.counters[0]])
  return state, status


def row_arrays(state: Slots) -> list[tuple[jax.Array, tuple]]:
  """Every row array of `state` (what `compact` gathers), with the logical axes it is laid out by."""
  c = state.cache
  arrays = (c.table, c.lengths, c.live, state.sequence, state.step, state.live, state.started, state.shared)
  return [(state.logits, ("batch", "act_vocab"))] + [(x, q_lib.row_axes(x)) for x in arrays]


def with_rows(state: Slots, arrays: list[jax.Array]) -> Slots:
  """`state` with its row arrays replaced by `arrays` (in `row_arrays`' order)."""
  logits, table, lengths, live_cache, sequence, step, live, started, shared = arrays
  cache = state.cache.replace(table=table, lengths=lengths, live=live_cache)
  return state._replace(cache=cache, logits=logits, sequence=sequence, step=step, live=live, started=started,
                        shared=shared)


@functools.lru_cache(maxsize=32)
def compaction(rows: int, queues: int, jit: Callable) -> Callable:
  """The program `compact` runs: `(state) -> state` with `rows` slots (each queue's live ones first, in slot
  order), the pool passed through untouched (donated)."""
  def fn(state: Slots) -> Slots:
    index = q_lib.kept_rows(state.live, rows, queues)
    take = lambda x, axes: constrain(q_lib.gather(x, index, queues), axes)
    return with_rows(state, [take(x, axes) for x, axes in row_arrays(state)])
  return jit(fn, donate_argnums=0)


def compact(state: Slots, rows: int, *, jit: Callable = jax.jit) -> Slots:
  with warnings.catch_warnings():  # The donated row arrays are freed, not reused: the shapes differ.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    return compaction(rows, state.queued.shape[0], jit)(state)


class Programs(NamedTuple):
  start: Callable
  decode: Callable
  finish: Callable


def programs(*, cache_dtype, **settings) -> Programs:
  """The three jitted programs of one setting (`_programs`), one set whatever order the settings come in."""
  return _programs(cache_dtype=jnp.dtype(cache_dtype), **dict(sorted(settings.items())))


@functools.lru_cache(maxsize=32)
def _programs(*, sampling: common.Sampling, group: int, slots: int, queues: int, queue_pages: int, page_tokens: int,
              block_pages: int, implementation: str, steps_per_call: int, pad_id: int, cache_dtype, min_slots: int = 0,
              jit: Callable = jax.jit) -> Programs:
  """The three jitted programs of one setting (the decode state is donated between calls)."""
  return Programs(
      start=jit(functools.partial(start, group=group, slots=slots, queues=queues, queue_pages=queue_pages,
                                  pad_id=pad_id, page_tokens=page_tokens, block_pages=block_pages,
                                  implementation=implementation,
                                  max_response_tokens=sampling.max_response_tokens, cache_dtype=cache_dtype)),
      decode=jit(functools.partial(decode, sampling=sampling, group=group, steps=steps_per_call,
                                   shrink_at=q_lib.shrink_threshold(slots, min_slots)), donate_argnums=(2,)),
      finish=jit(functools.partial(common.finished_rollout, group=group, pad_id=pad_id)))


def generate_refill(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                    sampling: common.Sampling, group: int, slots: int, queue_pages: int, page_tokens: int,
                    queues: int = 1, block_pages: int = 1, implementation: str = "gather", steps_per_call: int = 256,
                    pad_id: int = 0, cache_dtype=jnp.float32, min_slots: int = 0, jit: Callable = jax.jit,
                    length_limits: jax.Array | None = None, prompt_lengths: np.ndarray | None = None,
                    resumed: resumed_lib.Resumed | None = None) -> tuple[common.Rollout, int, int, dict[str, float]]:
  """`static.generate_static`'s `Rollout` (the same tokens and log-probs) from `slots` refilled decode slots over
  `queue_pages` pages of `page_tokens` tokens per queue, in `queues` queues (dividing the slots, the prompts and
  `min_slots`), `group` samples per prompt; the decode iterations run, the rows decoded (Σ slots × iterations) and
  the pool's figures: `rollout/preemptions`, `rollout/recomputed_tokens`, `rollout/pages_peak` (the most any queue
  held at once) and `rollout/pages_free_after` (the fewest any queue had free at the end).
  `prompt_lengths` `[P]` (host): the prompts' real tokens (default: read from `prompt_mask`), for the check
  that a queue's pool holds its prompts and one whole sequence (`common.check_pool`). `resumed`: a partial
  rollout's call, which stops at its budget; a sequence still decoding or waiting then has the tokens it holds
  (`progress`) as its length and `common.FINISH_UNFINISHED` as its finish reason."""
  count, prompt_len = prompt_tokens.shape
  if slots % queues or count % queues or min_slots % queues:
    raise ValueError(f"{queues} queues must divide the slots ({slots}), the prompts ({count}) and min_slots "
                     f"({min_slots})")
  lengths = np.sum(np.asarray(prompt_mask), axis=-1) if prompt_lengths is None else prompt_lengths
  held = common.most_prompt_pages(lengths, queues=queues, page_tokens=page_tokens)
  common.check_pool(pages=queue_pages, prompts=count // queues, max_response_tokens=sampling.max_response_tokens,
                    held=held, page_tokens=page_tokens)
  settings = dict(sampling=sampling, group=group, queues=queues, queue_pages=queue_pages, page_tokens=page_tokens,
                  block_pages=block_pages, implementation=implementation, steps_per_call=steps_per_call,
                  pad_id=pad_id, cache_dtype=jnp.dtype(cache_dtype), min_slots=min_slots, jit=jit)
  fns, state, steps, row_steps = q_lib.drive(
      lambda rows: programs(slots=rows, **settings), lambda state, rows: compact(state, rows, jit=jit), model,
      prompt_tokens, prompt_mask, key, length_limits, resumed, slots=slots, min_slots=min_slots)
  o = state.outputs
  held = o.lengths if resumed is None else resumed_lib.progress_program(jit)(state)
  out = fns.finish(prompt_tokens, prompt_mask, o.tokens, o.sampler, o.policy, held, o.stopped)
  if resumed is not None:
    out = resumed_lib.unfinished_program(jit)(out, o.lengths)
  counters, free, peak = (np.asarray(x) for x in distributed.to_host((state.counters, state.free.count,
                                                                      state.free.peak)))
  figures = {"rollout/preemptions": float(counters[1]), "rollout/recomputed_tokens": float(counters[2]),
             "rollout/pages_peak": float(peak.max()),
             "rollout/pages_free_after": float(free.min())}
  return out, steps, row_steps, figures
