"""Prefill lanes: the refill engine fills its prompts' pages chunk by chunk, inside its decode loop.

Each queue has Lq lanes. Each iteration, after the pool has given back what its live rows need and before the
slots take new sequences (`slots.py`):

  1. `begin`: the queue's free lanes take the prompts of its next sequences (`slots.candidates`, in order)
     that are not resident, each with all its ⌈length / page⌉ pages at once while the pages the live rows do
     not need this iteration last, so long as the queue holds at most Lq prompts ahead of its slots (being
     prefilled, or prefilled with none of their samples decoding yet);
  2. `chunk`: every lane holding a prompt runs its next C tokens through the model, all lanes in one call
     (`PagedKVCache`'s chunk: each token's keys and values written to the prompt's pages, each query reading
     the prompt's pages up to itself, `paged_attention.attend_chunk`); a prompt whose last token went through
     keeps its next-token logits and is ready for its samples (`Prompts.ready`).

No program holds more than a chunk of Q·Lq × C tokens of a prompt: a 32,768-token prompt is prefilled in
32,768 / C chunks, each reading the pages the earlier ones wrote. A chunk is run only in an iteration where
some lane holds a prompt.
"""

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax.rollout.refill import pages as pages_lib
from vapo_jax.rollout.refill import queues as q_lib
from vapo_jax.rollout.refill import slots as slots_lib
from vapo_jax.rollout.refill.slots import Slots


def begin(s: Slots, blocked: jax.Array, *, samples_per_prompt: int, window: int) -> Slots:
  """Step 1 of the module docstring over each queue's next `window` sequences; none where `blocked` `[Q]`."""
  queues, lanes = s.lanes.shape
  p, tg = s.prompts, s.cache.page_tokens
  per_prompt = p.users.shape[0] // queues
  by_queue = lambda x: q_lib.by_queue(x, queues)
  next_local, exists = slots_lib.candidates(s, window)
  prompt = next_local // samples_per_prompt  # [Q, M]
  needs = exists & (jnp.take_along_axis(by_queue(p.started), prompt, axis=1) < 0)
  position = jnp.arange(window, dtype=jnp.int32)
  first = jax.vmap(lambda pr, nd: jnp.full(per_prompt + 1, window, jnp.int32).at[
      jnp.where(nd, pr, per_prompt)].min(position))(prompt, needs)
  firsts = needs & (jnp.take_along_axis(first, prompt,
                                        axis=1) == position[None])  # Each prompt once, in order.
  idle = p.ready() & (slots_lib.live_members(s, s.live, samples_per_prompt) == 0) & (p.users > 0)
  ahead = jnp.sum(s.lanes < per_prompt, axis=1) + jnp.sum(by_queue(idle), axis=1)
  allowed = jnp.where(blocked, 0, jnp.maximum(lanes - ahead, 0))
  cost = jnp.where(firsts, -(-jnp.take_along_axis(by_queue(p.lengths), prompt, axis=1) // tg), 0)
  rank = jnp.cumsum(firsts, axis=1, dtype=jnp.int32) - 1
  need = jnp.sum(by_queue(slots_lib.page_wants(s)), axis=1, dtype=jnp.int32)  # The live rows' first.
  start = firsts & (rank < allowed[:, None]) & (jnp.cumsum(cost, axis=1) <= (s.free.count - need)[:, None])
  pick = jnp.argsort(~start, axis=1, stable=True)[:, :lanes]  # The starts first, in order: [Q, Lq].
  chosen = jnp.take_along_axis(start, pick, axis=1)
  which = jnp.where(chosen, jnp.take_along_axis(prompt, pick, axis=1), per_prompt)  # per_prompt: none.
  free, got = pages_lib.take_many(s.free, jnp.where(chosen, jnp.take_along_axis(cost, pick, axis=1), 0),
                                  p.table.shape[1])
  put = lambda x, values: jax.vmap(lambda part, i, v: part.at[i].set(v, mode="drop"))(by_queue(x), which,
                                                                                     values).reshape(x.shape)
  iteration = jnp.broadcast_to(s.counters[slots_lib.ITERATIONS], which.shape)
  prompts = p._replace(table=put(p.table, got), done=put(p.done, jnp.zeros_like(which)),
                       started=put(p.started, iteration))
  free_lane = s.lanes >= per_prompt
  lane_rank = jnp.cumsum(free_lane, axis=1, dtype=jnp.int32) - 1
  taken = jnp.take_along_axis(which, jnp.clip(lane_rank, 0, lanes - 1), axis=1)
  new_lanes = jnp.where(free_lane & (lane_rank < jnp.sum(chosen, axis=1)[:, None]), taken, s.lanes)
  counters = s.counters.at[slots_lib.PREFILLS].add(jnp.sum(chosen, dtype=jnp.int32))
  return s._replace(free=free, prompts=prompts, lanes=new_lanes, counters=counters)


def chunk(model, s: Slots, *, tokens: int) -> Slots:
  """Step 2 of the module docstring: `tokens` (C) per lane, in an iteration where some lane holds a prompt."""
  return lax.cond(jnp.any(s.lanes < s.prompts.users.shape[0] // s.lanes.shape[0]),
                  lambda s: _chunk(model, s, tokens=tokens), lambda s: s, s)


def _chunk(model, s: Slots, *, tokens: int) -> Slots:
  queues, lanes = s.lanes.shape
  p = s.prompts
  per_prompt = p.users.shape[0] // queues
  active = (s.lanes < per_prompt).reshape(-1)  # [Q·Lq]
  local = jnp.minimum(s.lanes, per_prompt - 1).reshape(-1)
  get = lambda x: q_lib.gather(x, local, queues)
  done, length, table, prompt_tokens = get(p.done), get(p.lengths), get(p.table), get(p.tokens)
  position = done[:, None] + jnp.arange(tokens, dtype=jnp.int32)[None]  # [Q·Lq, C]
  valid = active[:, None] & (position < length[:, None])
  width = prompt_tokens.shape[1]
  ids = jnp.take_along_axis(prompt_tokens, jnp.clip(width - length[:, None] + position, 0, width - 1), axis=1)
  cache = s.cache.replace(table=table, lengths=done, live=active)
  hidden, cache = model.hidden_states(jnp.where(valid, ids, 0), position, valid, cache)
  finishing = active & (done + tokens >= length)
  last = jnp.clip(length - 1 - done, 0, tokens - 1)
  logits = model.project(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
  at = lambda where: jnp.where(where, local, per_prompt)  # per_prompt: dropped.
  prompts = p._replace(done=q_lib.scatter(p.done, at(active), jnp.minimum(done + tokens, length), queues),
                       logits=q_lib.scatter(p.logits, at(finishing), logits, queues))
  counters = (s.counters.at[slots_lib.CHUNKS].add(jnp.sum(active, dtype=jnp.int32))
              .at[slots_lib.PREFILLED].add(jnp.sum(valid, dtype=jnp.int32)))
  return s._replace(cache=s.cache.replace(**cache.pool_arrays()), prompts=prompts,
                    counters=counters, lanes=jnp.where(finishing.reshape(queues, lanes), per_prompt, s.lanes))
