"""The contiguous refill engine: the paged engine's baseline, each slot owning a prompt's and a response's cache.

The benchmarks' reference (`benchmarks/paged_bench.py`, `tests/test_pages.py`): the refill engine as it runs
over a contiguous KV cache, which the package's paged engine (`vapo_jax/rollout/refill/`) replaced. The
queues and their host loop are the package's (`rollout/refill/queues.py`).

Response lengths in long chain-of-thought RL are long-tailed: most responses end early, a few run
to the cap. A static batch decodes until its longest row ends, so every finished row idles
(computing padding) behind the stragglers. Here R decode slots (rows) run the P·G sequences of a
step as queues, as JetStream / maxtext insert prefilled requests into free decode slots:

  1. prefill the P prompts once (`common.prefill`: last-position logits and a `[P, Tp]` cache);
  2. each decode iteration first gives every free slot the next sequence n = p·G + g of its queue:
     prompt p's cache rows are copied into the slot, its length reset to Tp, its next-token logits
     set from the prefill; then all R slots decode one token (one length per slot in the KV cache:
     each writes at its own slot and attends to its own filled part);
  3. a slot whose sequence sampled a stop token or reached its length is free again;
  4. the step ends when every queue is empty and no slot is live;
  5. the tail: once the queues are empty and at most half the slots are live, the live sequences
     are compacted into fewer slots (`min_slots`·2^k, the fewest that hold them) and decoding goes
     on with the smaller program, so a straggler no longer decodes R rows — of which R − 1 idle —
     reading every idle row's cache up to its own length.

Queues. The sequences are served by Q queues (`queues`; 1 by default, the data-parallel groups in
the rollout layout, rollout/layout.py): queue q owns slots [q·R/Q, (q+1)·R/Q), sequences
[q·N/Q, (q+1)·N/Q) in order, and so prompts [q·P/Q, (q+1)·P/Q). Split over the batch axes, with Q
the data-parallel devices, every queue's prompts, slots and outputs sit on its own devices: a
refill reads the prompt cache there (a gather batched over queues, which XLA keeps local), and no
device holds another's prompts. A compaction keeps each queue's sequences in its own slots (R/Q
each, so a shrink waits for the fullest queue).

Iterations run on the device, `steps_per_call` of them per host call (`lax.while_loop`, leaving
early when everything has finished or the slots can shrink); the host reads four integers per
call. One set of weights serves the whole step (on-policy). Sequence n samples its step t with
`fold_in(fold_in(key, n), t)`, as the static engine does, so both sample the same tokens whatever
the queues or slots; outputs are written by sequence index (`[N, Tr]`, split over the batch axes),
so the `Rollout` has the static engine's row order.

Cost: a free slot's refill copies Tp cache slots per layer, layer by layer in place (inside a
`lax.cond`: iterations without a refill copy nothing). A shrink gathers the kept rows of each row
array in its own call that donates the old array, the stacked keys and values layer by layer (peak:
the R-row cache plus the kept rows of one of the two stacks), and compiles one decode program per
slot count (at most log2(R / min_slots) of them, cached).
"""

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax.models.kv_cache import CACHE_AXES, KVCache
from vapo_jax.models.sharding import constrain
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import queues as queues_lib


class Prompts(NamedTuple):
  """The prefilled prompts, read when a slot takes a new sequence."""

  keys: jax.Array  # [L, P, K, Tp, H] (stacked layers, heads-major, as the KV cache).
  values: jax.Array  # [L, P, K, Tp, H].
  mask: jax.Array  # [P, Tp] real prompt tokens.
  logits: jax.Array  # [P, V] next-token logits after the prompt.
  lengths: jax.Array  # [P] int32 real prompt tokens: the position of the first response token.


class Slots(NamedTuple):
  """The decode slots and the outputs, by sequence (N = P·G sequences, R slots, Q queues)."""

  cache: KVCache  # [R, Tp + Tr], one length per slot.
  logits: jax.Array  # [R, V] next-token logits of each slot's sequence.
  sequence: jax.Array  # [R] int32 the sequence in the slot (meaningful where live).
  step: jax.Array  # [R] int32 tokens that sequence has generated.
  live: jax.Array  # [R] bool.
  queued: jax.Array  # [Q] int32: each queue's next sequence (queue q serves [q·N/Q, (q+1)·N/Q)).
  decode_steps: jax.Array  # int32: decode iterations run.
  tokens: jax.Array  # [N, Tr] int32.
  sampler: jax.Array  # [N, Tr] float32.
  policy: jax.Array  # [N, Tr] float32.
  lengths: jax.Array  # [N] int32, set when the sequence ends.
  stopped: jax.Array  # [N] bool: ended on a stop token.
  prompts: Prompts  # The prefilled prompts, read when a slot takes a new sequence.


def start(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, samples_per_prompt: int, slots: int,
          queues: int, max_response_tokens: int, pad_id: int, cache_dtype, decode_block: int | None) -> Slots:
  """Prefills the prompts and builds R empty slots with room for a prompt and a response."""
  prompt_mask = prompt_mask.astype(bool)
  logits, cache = common.prefill(model, prompt_tokens, prompt_mask, cache_dtype=cache_dtype,
                                  decode_block=decode_block)
  prompts = Prompts(cache.keys, cache.values, prompt_mask, logits, jnp.sum(prompt_mask, -1).astype(jnp.int32))
  cfg, (count, prompt_len) = model.cfg, prompt_tokens.shape
  n, width = count * samples_per_prompt, prompt_len + max_response_tokens
  rows = lambda shape, dtype, fill=0: constrain(jnp.full(shape, fill, dtype),
                                                ("batch",) + (None,) * (len(shape) - 1))
  shape = (cfg.num_layers, slots, cfg.num_kv_heads, width, cfg.head_dim)
  slot_cache = KVCache(jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype),
                       jnp.zeros((slots, width), bool),
                       jnp.zeros((slots,), jnp.int32), decode_block).constrained()
  slot_logits = constrain(jnp.zeros((slots, logits.shape[-1]), jnp.float32), ("batch", "act_vocab"))
  queued = jnp.arange(queues, dtype=jnp.int32) * (n // queues)
  return Slots(slot_cache, slot_logits, rows((slots,), jnp.int32), rows((slots,), jnp.int32),
               rows((slots,), bool), queued, jnp.zeros((), jnp.int32),
               rows((n, max_response_tokens), jnp.int32, pad_id), rows((n, max_response_tokens), jnp.float32),
               rows((n, max_response_tokens), jnp.float32), rows((n,), jnp.int32), rows((n,), bool), prompts)


def finished(s: Slots) -> jax.Array:
  """Every sequence has been started and none is live."""
  return ~jnp.any(s.live) & jnp.all(s.queued >= queues_lib.queue_ends(s.queued, s.lengths.shape[0]))


def take_queued(prompts: Prompts, s: Slots, *, samples_per_prompt: int) -> Slots:
  """Gives each free slot the next sequence of its queue (in order), if any is left."""
  queues, rows, prompt_len = s.queued.shape[0], s.live.shape[0], prompts.mask.shape[1]
  free = queues_lib.by_queue(~s.live, queues)  # [Q, R/Q]
  new_by_queue = s.queued[:, None] + jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
  take_by_queue = free & (new_by_queue < queues_lib.queue_ends(s.queued, s.lengths.shape[0])[:, None])
  take, new = take_by_queue.reshape(rows), new_by_queue.reshape(rows)

  n = s.lengths.shape[0]
  local = jnp.minimum(new - queues_lib.first_sequence(rows, n, queues), n // queues - 1)  # Within the queue.
  read = lambda source: queues_lib.gather(source, local // samples_per_prompt,
                                          queues)  # The queue's own prompt.
  any_taken = jnp.any(take)

  def fill(buffer, source):
    """The stacked keys or values with the taken slots' prompt part copied in, layer by layer in place (one
    layer's prompt slots in flight); no iteration, and no copy, when no slot is taken (a conditional
    returning the cache would copy it whole on the iterations that take nothing)."""
    zero = jnp.zeros((), jnp.int32)

    def layer(i, buffer):  # Reads and writes only layer i's prompt slots: [R, K, Tp, H].
      at = (i, zero, zero, zero, zero)
      kept = lax.dynamic_slice(buffer, at, (1,) + buffer.shape[1:3] + (prompt_len,) + buffer.shape[4:])[0]
      new = read(lax.dynamic_index_in_dim(source, i, 0, keepdims=False)).astype(buffer.dtype)
      return lax.dynamic_update_slice(buffer, jnp.where(take[:, None, None, None], new, kept)[None], at)
    return lax.fori_loop(0, jnp.where(any_taken, buffer.shape[0], 0), layer, buffer)

  def insert(s: Slots) -> Slots:  # Every row array but the cache's keys and values.
    responses = s.cache.mask.shape[1] - prompt_len
    mask = jnp.where(take[:, None], jnp.pad(read(prompts.mask), ((0, 0), (0, responses))), s.cache.mask)
    return s._replace(cache=s.cache.replace(mask=mask, length=jnp.where(take, prompt_len, s.cache.length)),
                      logits=jnp.where(take[:, None], read(prompts.logits), s.logits),
                      sequence=jnp.where(take, new, s.sequence), step=jnp.where(take, 0, s.step),
                      live=s.live | take, queued=s.queued + jnp.sum(take_by_queue, axis=1, dtype=jnp.int32))

  keys, values = fill(s.cache.keys, prompts.keys), fill(s.cache.values, prompts.values)
  s = lax.cond(any_taken, insert, lambda s: s, s._replace(cache=s.cache.replace(keys=None, values=None)))
  return s._replace(cache=s.cache.replace(keys=keys, values=values))


def decode(model, state: Slots, key: jax.Array, length_limits: jax.Array | None = None, *,
           sampling: common.Sampling, samples_per_prompt: int, steps: int, pad_id: int,
           shrink_at: int = 0) -> tuple[Slots, jax.Array]:
  """Up to `steps` iterations of (refill free slots, decode one token in every slot), leaving early
  when every sequence has finished or the slots can shrink (the queues are empty and `rows_needed`
  ≤ `shrink_at` > 0). Returns the state and its status `[4]` int32: finished, can shrink, rows
  needed, decode iterations run so far."""
  n, max_response_tokens = state.tokens.shape
  queues, rows = state.queued.shape[0], state.live.shape[0]
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = jnp.full((n,), max_response_tokens,
                    jnp.int32) if length_limits is None else length_limits.astype(jnp.int32)
  first = queues_lib.first_sequence(rows, n, queues)
  prompts = state.prompts

  def one_step(s: Slots) -> Slots:
    s = take_queued(prompts, s, samples_per_prompt=samples_per_prompt)
    keys = jax.vmap(lambda seq, t: jax.random.fold_in(jax.random.fold_in(key, seq), t))(s.sequence, s.step)
    tokens, sampler, policy = common.sample_tokens(keys, s.logits, sampling)
    live = s.live
    tokens = jnp.where(live, tokens, pad_id)
    local = jnp.clip(s.sequence - first, 0, n // queues - 1)  # The sequence's index within its queue.
    stop = live & jnp.isin(tokens, stop_ids)
    ended = live & (stop | (s.step + 1 >= queues_lib.gather(limits, local, queues)))
    at, end_at = jnp.where(live, local, n // queues), jnp.where(ended, local, n // queues)  # n / Q: dropped.
    write = lambda out, x: queues_lib.scatter(out, at, x, queues, s.step)
    end = lambda out, x: queues_lib.scatter(out, end_at, x, queues)
    positions = queues_lib.gather(prompts.lengths, local // samples_per_prompt, queues) + s.step
    logits, cache = model(tokens[:, None], positions[:, None], live[:, None], s.cache)
    cache = cache.replace(length=jnp.where(live, cache.length, s.cache.length))  # Free slots stay put.
    return Slots(cache, logits[:, -1], s.sequence, jnp.where(live, s.step + 1, s.step), live & ~ended,
                 s.queued, s.decode_steps + 1, write(s.tokens, tokens), write(s.sampler, sampler),
                 write(s.policy, policy), end(s.lengths, s.step + 1), end(s.stopped, stop), s.prompts)

  def can_shrink(s: Slots) -> jax.Array:
    drained = jnp.all(s.queued >= queues_lib.queue_ends(s.queued, n))
    return (shrink_at > 0) & drained & (queues_lib.rows_needed(s.live, queues) <= shrink_at)

  def cond(carry):
    i, s = carry
    return (i < steps) & ~finished(s) & ~can_shrink(s)

  with jax.named_scope(common.DECODE_LOOP):  # Names the loop in the HLO (the compile report reads its traffic).
    _, state = lax.while_loop(cond, lambda carry: (carry[0] + 1, one_step(carry[1])),
                              (jnp.zeros((), jnp.int32), state))
  status = jnp.stack([finished(state).astype(jnp.int32), can_shrink(state).astype(jnp.int32),
                      queues_lib.rows_needed(state.live, queues), state.decode_steps])
  return state, status


def _gather_layers(stack: jax.Array, index: jax.Array, queues: int) -> jax.Array:
  """`_gather` of the rows (axis 1) of stacked keys or values `[L, R, ...]`, layer by layer: besides the
  input, only the output and one layer's gathered rows are held (a one-shot gather would hold a second
  stack's worth of temporaries)."""
  out = constrain(jnp.zeros((stack.shape[0], index.shape[0]) + stack.shape[2:], stack.dtype), CACHE_AXES)
  layer = lambda i, out: lax.dynamic_update_index_in_dim(
      out, queues_lib.gather(lax.dynamic_index_in_dim(stack, i, 0, keepdims=False), index, queues), i, 0)
  return lax.fori_loop(0, stack.shape[0], layer, out)


@functools.lru_cache(maxsize=32)
def row_programs(rows: int, queues: int, jit: Callable) -> tuple[Callable, Callable]:
  """(order: each queue's live slots first, `rows` / Q of them; take: those rows of one array,
  donating it, laid out by its logical axes: rows are axis 1 of the stacked cache (`CACHE_AXES`), else 0)."""
  order = jit(lambda live: queues_lib.kept_rows(live, rows, queues))
  gather = lambda x, index, axes: (_gather_layers if axes == CACHE_AXES else queues_lib.gather)(x, index,
                                                                                                queues)
  take = jit(lambda x, index, axes: constrain(gather(x, index, axes), axes), donate_argnums=0,
             static_argnums=2)
  return order, take


def row_arrays(state: Slots) -> list[tuple[jax.Array, tuple]]:
  """Every row array of `state` (what `compact` gathers), with the logical axes it is laid out by: the
  cache's stacked keys and values (`[L, R, ...]`), its mask and lengths, the logits, sequences, steps and
  flags (`[R, ...]`)."""
  c = state.cache
  return ([(c.keys, CACHE_AXES),
           (c.values, CACHE_AXES)] + [(x, queues_lib.row_axes(x)) for x in (c.mask, c.length)]
          + [(state.logits, ("batch", "act_vocab"))]
          + [(x, queues_lib.row_axes(x)) for x in (state.sequence, state.step, state.live)])


def with_rows(state: Slots, arrays: list[jax.Array]) -> Slots:
  """`state` with its row arrays replaced by `arrays` (in `row_arrays`' order)."""
  keys, values, mask, length, logits, sequence, step, live = arrays
  cache = KVCache(keys, values, mask, length, state.cache.decode_block)
  return state._replace(cache=cache, logits=logits, sequence=sequence, step=step, live=live)


def compact(state: Slots, rows: int, *, jit: Callable = jax.jit) -> Slots:
  """The state with `rows` slots, `rows` / Q per queue: each queue's live ones (at most that many)
  first, in slot order; the outputs (by sequence) unchanged. Each array is gathered in its own call
  that donates it."""
  order, take = row_programs(rows, state.queued.shape[0], jit)
  index = order(state.live)
  with warnings.catch_warnings():  # The donated arrays are freed, not reused: the shapes differ.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    return with_rows(state, [take(x, index, axes) for x, axes in row_arrays(state)])


class Programs(NamedTuple):
  start: Callable
  decode: Callable
  finish: Callable


@functools.lru_cache(maxsize=32)
def programs(*, sampling: common.Sampling, samples_per_prompt: int, slots: int, queues: int = 1,
             steps_per_call: int, pad_id: int,
             cache_dtype, decode_block: int | None, min_slots: int = 0, jit: Callable = jax.jit) -> Programs:
  """The three jitted programs of one setting (the decode state is donated between calls)."""
  return Programs(
      start=jit(functools.partial(start, samples_per_prompt=samples_per_prompt, slots=slots, queues=queues,
                                  pad_id=pad_id,
                                  cache_dtype=cache_dtype, max_response_tokens=sampling.max_response_tokens,
                                  decode_block=decode_block)),
      decode=jit(functools.partial(decode, sampling=sampling, samples_per_prompt=samples_per_prompt,
                                   steps=steps_per_call, pad_id=pad_id,
                                   shrink_at=queues_lib.shrink_threshold(slots, min_slots)),
                 donate_argnums=(1,)),
      finish=jit(functools.partial(common.finished_rollout, samples_per_prompt=samples_per_prompt,
                                   pad_id=pad_id)))


def generate_contiguous(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                    sampling: common.Sampling, samples_per_prompt: int, slots: int, queues: int = 1,
                    steps_per_call: int = 256, pad_id: int = 0, cache_dtype=jnp.float32,
                    decode_block: int | None = None, min_slots: int = 0, jit: Callable = jax.jit,
                    length_limits: jax.Array | None = None) -> tuple[common.Rollout, int, int]:
  """`static.generate_static`'s `Rollout` (the same tokens and log-probs) from `slots` refilled decode
  slots in `queues` queues (dividing the slots, the prompts and `min_slots`), the decode iterations run and the
  rows decoded (Σ slots × iterations). `min_slots` > 0: shrink the slots in the tail down to this many
  (a multiple of the data-parallel devices); 0: never. `length_limits` `[P·G]`, in [1, max_response_tokens]."""
  if slots % queues or prompt_tokens.shape[0] % queues or min_slots % queues:
    raise ValueError(f"{queues} queues must divide the slots ({slots}), the prompts "
                     f"({prompt_tokens.shape[0]}) and min_slots ({min_slots})")
  settings = dict(sampling=sampling, samples_per_prompt=samples_per_prompt, queues=queues,
                  steps_per_call=steps_per_call,
                  pad_id=pad_id, cache_dtype=jnp.dtype(cache_dtype), decode_block=decode_block,
                  min_slots=min_slots, jit=jit)
  fns, state, steps, row_steps = queues_lib.drive(
      lambda rows: programs(slots=rows, **settings), lambda state, rows: compact(state, rows, jit=jit), model,
      prompt_tokens, prompt_mask, key, length_limits, slots=slots, min_slots=min_slots)
  out = fns.finish(prompt_tokens, prompt_mask, state.tokens, state.sampler, state.policy, state.lengths,
                   state.stopped)
  return out, steps, row_steps
