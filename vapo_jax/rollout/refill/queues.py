"""Queues of sequences served by decode slots, and the tail's shrinking (the refill engine's, `engine.py`).

N = P·G sequences are served by Q queues in R slots: queue q owns slots [q·R/Q, (q+1)·R/Q), sequences
[q·N/Q, (q+1)·N/Q) in order, and so prompts [q·P/Q, (q+1)·P/Q). Split over the batch axes with Q the
data-parallel groups, a queue's slots, prompts, outputs (and pages) sit on its own devices: a row reads
its own queue's part of an array by a gather batched over queues (`gather`), which XLA keeps on each
device, and writes its outputs by a scatter batched the same way (`scatter`).

Outputs are written by sequence (`Outputs`: `[N, Tr]`, split over the batch axes), so a rollout has the
static engine's row order whatever slot a sequence ran in. In the tail (queues empty), the slots shrink
to min_slots·2^k (`shrink_threshold`, `shrunk_slots`), each queue keeping an equal share (`rows_needed`).

`drive` is both engines' host loop: start, then decode `steps_per_call` iterations per call until the engine
says it is done, compacting the rows when it says they can shrink.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import distributed
from vapo_jax.models.sharding import constrain


class Outputs(NamedTuple):
  """A rollout's results by sequence (N = P·G), written as sequences decode and end."""

  tokens: jax.Array  # [N, Tr] int32.
  sampler: jax.Array  # [N, Tr] float32.
  policy: jax.Array  # [N, Tr] float32.
  lengths: jax.Array  # [N] int32, set when the sequence ends.
  stopped: jax.Array  # [N] bool: ended on a stop token.


def row_axes(x: jax.Array) -> tuple:
  return ("batch",) + (None,) * (x.ndim - 1)


def rows(shape, dtype, fill=0) -> jax.Array:
  """A new array split over the batch axes by its first axis."""
  return constrain(jnp.full(shape, fill, dtype), ("batch",) + (None,) * (len(shape) - 1))


def empty_outputs(sequences: int, max_response_tokens: int, pad_id: int) -> Outputs:
  n, max_response_tokens = sequences, max_response_tokens
  shape = (n, max_response_tokens)
  return Outputs(rows(shape, jnp.int32, pad_id), rows(shape, jnp.float32), rows(shape, jnp.float32),
                 rows((n,), jnp.int32), rows((n,), bool))


def by_queue(x: jax.Array, queues: int) -> jax.Array:
  """`[Q·M, ...]` → `[Q, M, ...]`: queue q's part (its slots, sequences or prompts) in row q."""
  return x.reshape((queues, -1) + x.shape[1:])


def gather(source: jax.Array, index: jax.Array, queues: int) -> jax.Array:
  """Row r of `[R, ...]`: entry `index[r]` of its own queue's part of `source` `[Q·M, ...]` (a gather
  batched over queues: split over the data-parallel devices with them, it stays on each device)."""
  got = jax.vmap(lambda part, i: part[i])(by_queue(source, queues), by_queue(index, queues))
  return got.reshape((-1,) + source.shape[1:])


def scatter(out: jax.Array, index: jax.Array, values: jax.Array, queues: int, column=None) -> jax.Array:
  """`out` `[Q·M, ...]` with row r's value written at entry `index[r]` (and `column[r]`) of its queue's
  part; index M: dropped."""
  columns = () if column is None else (by_queue(column, queues),)
  put = lambda part, i, v, *c: part.at[(i, *c)].set(v, mode="drop")
  parts = (by_queue(x, queues) for x in (out, index, values))
  return jax.vmap(put)(*parts, *columns).reshape(out.shape)


def first_sequence(slots: int, sequences: int, queues: int) -> jax.Array:
  """`[R]` the first sequence of each slot's queue."""
  return jnp.arange(slots, dtype=jnp.int32) // (slots // queues) * (sequences // queues)


def queue_ends(queued: jax.Array, sequences: int) -> jax.Array:
  """`[Q]` one past each queue's last sequence."""
  queues = queued.shape[0]
  return (jnp.arange(queues, dtype=jnp.int32) + 1) * (sequences // queues)


def record(outputs: Outputs, local, live, ended, stop, step, tokens, sampler, policy, queues: int) -> Outputs:
  """`outputs` with each live slot's token, log-probs (at its step) and, where it ended, its length and stop
  flag written by sequence (`local`: each slot's sequence within its queue)."""
  per_queue = outputs.lengths.shape[0] // queues
  at, end_at = jnp.where(live, local, per_queue), jnp.where(ended, local, per_queue)  # per_queue: dropped.
  write = lambda out, x: scatter(out, at, x, queues, step)
  end = lambda out, x: scatter(out, end_at, x, queues)
  return Outputs(write(outputs.tokens, tokens), write(outputs.sampler, sampler),
                 write(outputs.policy, policy), end(outputs.lengths, step + 1), end(outputs.stopped, stop))


def shrink_threshold(slots: int, min_slots: int) -> int:
  """The live count at or below which R = `slots` slots shrink: the largest min_slots·2^k ≤ R / 2
  (0: never, also when `min_slots` is 0)."""
  size, candidate = 0, min_slots
  while 0 < candidate and 2 * candidate <= slots:
    size, candidate = candidate, 2 * candidate
  return size


def shrunk_slots(live: int, min_slots: int) -> int:
  """The fewest slots of the form min_slots·2^k that hold `live` sequences."""
  size = min_slots
  while size < live:
    size *= 2
  return size


def shrink_sizes(slots: int, min_slots: int) -> list[int]:
  """The slot counts an engine shrinks through when its tail drains gradually (halving)."""
  sizes, size = [], shrink_threshold(slots, min_slots)
  while size:
    sizes.append(size)
    size = shrink_threshold(size, min_slots)
  return sizes


def rows_needed(live: jax.Array, queues: int) -> jax.Array:
  """The slots that hold the live sequences with each queue in an equal share: Q × the fullest queue's."""
  return queues * jnp.max(jnp.sum(by_queue(live, queues), axis=1, dtype=jnp.int32))


def kept_rows(live: jax.Array, rows: int, queues: int) -> jax.Array:
  """`[rows]` the slots a compaction to `rows` keeps, each as an index within its queue (for `gather`): each
  queue's live ones first (slot order), rows / Q each."""
  kept = lambda part: jnp.argsort(~part, stable=True)[:rows // queues]
  return jax.vmap(kept)(by_queue(live, queues)).reshape(rows)


def drive(programs: Callable, compact: Callable, model, prompt_tokens, prompt_mask, key, *decode_args,
          slots: int, min_slots: int):
  """Runs a refill engine: `programs(rows)` its (start, decode, finish) at `rows` slots, `compact(state,
  rows)` its compaction; `start(model, prompt_tokens, prompt_mask)` returns its state, `decode(model, state,
  key, *decode_args)` the state and its status (finished or stopped, can shrink, rows needed, iterations so
  far). Returns the last programs, the state, the decode iterations and the rows decoded (Σ slots ×
  iterations); the host reads four integers per call."""
  fns = programs(slots)
  state = fns.start(model, prompt_tokens, prompt_mask)
  rows, steps, row_steps = slots, 0, 0
  while True:
    state, status = fns.decode(model, state, key, *decode_args)
    done, shrink, needed, total = np.asarray(distributed.to_host(status)).tolist()
    row_steps, steps = row_steps + rows * (total - steps), total
    if done:
      return fns, state, steps, row_steps
    if shrink:
      rows = shrunk_slots(needed, min_slots)
      state = compact(state, rows)
      fns = programs(rows)
