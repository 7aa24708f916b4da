"""The refill engine: slot refill (continuous batching) inside one rollout step.

Response lengths in long chain-of-thought RL are long-tailed: most responses end early, a few run
to the cap. A static batch decodes until its longest row ends, so every finished row idles
(computing padding) behind the stragglers. Here R decode slots (rows) run the P·G sequences of a
step as a queue, as JetStream / maxtext insert prefilled requests into free decode slots:

  1. prefill the P prompts once (`common.prefill`: last-position logits and a `[P, Tp]` cache);
  2. each decode iteration first gives every free slot the next queued sequence n = p·G + g: prompt
     p's cache rows are copied into the slot, its length reset to Tp, its next-token logits set
     from the prefill; then all R slots decode one token (one length per slot in the KV cache:
     each writes at its own slot and attends to its own filled part);
  3. a slot whose sequence sampled a stop token or reached its length is free again;
  4. the step ends when the queue is empty and no slot is live;
  5. the tail: once the queue is empty and at most half the slots are live, the live sequences
     are compacted into fewer slots (`min_slots`·2^k, the fewest that hold them) and decoding goes
     on with the smaller program, so a straggler no longer decodes R rows — of which R − 1 idle —
     reading every idle row's cache up to its own length.

Iterations run on the device, `steps_per_call` of them per host call (`lax.while_loop`, leaving
early when everything has finished or the slots can shrink); the host reads four integers per
call. One set of weights serves the whole step (on-policy). Sequence n samples its step t with
`fold_in(fold_in(key, n), t)`, as the static engine does, so both sample the same tokens; outputs
are written by sequence index, so the `Rollout` has the static engine's row order.

Cost: a free slot's refill copies Tp cache slots per layer (inside a `lax.cond`: iterations
without a refill copy nothing). A shrink gathers the kept rows of each cache array in its own call
that donates the old array (peak: the R-row cache plus one array's kept rows), and compiles one
decode program per slot count (at most log2(R / min_slots) of them, cached). Sharded, the slots
are split over the batch axes; the prompt caches are read by whichever slot takes a sequence,
which XLA resolves with a gather across the data-parallel devices.
"""

import functools
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vapo_jax import distributed
from vapo_jax.models.sharding import constrain
from vapo_jax.models.transformer import KVCache
from vapo_jax.rollout import common


class Prompts(NamedTuple):
  """The prefilled prompts, read when a slot takes a new sequence."""

  keys: tuple[jax.Array, ...]  # Per layer [P, K, Tp, H] (heads-major, as the KV cache).
  values: tuple[jax.Array, ...]  # Per layer [P, K, Tp, H].
  mask: jax.Array  # [P, Tp] real prompt tokens.
  logits: jax.Array  # [P, V] next-token logits after the prompt.
  lengths: jax.Array  # [P] int32 real prompt tokens: the position of the first response token.


class Slots(NamedTuple):
  """The decode slots and the outputs, by sequence (N = P·G sequences, R slots)."""

  cache: KVCache  # [R, Tp + Tr], one length per slot.
  logits: jax.Array  # [R, V] next-token logits of each slot's sequence.
  sequence: jax.Array  # [R] int32 the sequence in the slot (meaningful where live).
  step: jax.Array  # [R] int32 tokens that sequence has generated.
  live: jax.Array  # [R] bool.
  queued: jax.Array  # int32: sequences started so far (the queue's head).
  decode_steps: jax.Array  # int32: decode iterations run.
  tokens: jax.Array  # [N, Tr] int32.
  sampler: jax.Array  # [N, Tr] float32.
  policy: jax.Array  # [N, Tr] float32.
  lengths: jax.Array  # [N] int32, set when the sequence ends.
  stopped: jax.Array  # [N] bool: ended on a stop token.


def start(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, group: int, slots: int, max_new_tokens: int,
          pad_id: int, cache_dtype, decode_block: int | None) -> tuple[Prompts, Slots]:
  """Prefills the prompts and builds R empty slots with room for a prompt and a response."""
  prompt_mask = prompt_mask.astype(bool)
  logits, cache = common.prefill(model, prompt_tokens, prompt_mask, cache_dtype=cache_dtype,
                                  decode_block=decode_block)
  prompts = Prompts(cache.keys, cache.values, prompt_mask, logits, jnp.sum(prompt_mask, -1).astype(jnp.int32))
  cfg, (count, prompt_len) = model.cfg, prompt_tokens.shape
  rows = lambda shape, dtype, fill=0: constrain(jnp.full(shape, fill, dtype), ("batch",) + (None,) * (len(shape) - 1))
  width = prompt_len + max_new_tokens
  shape = (slots, cfg.num_kv_heads, width, cfg.head_dim)
  kv = lambda: tuple(jnp.zeros(shape, cache_dtype) for _ in range(cfg.num_layers))  # Distinct buffers (donation).
  slot_cache = KVCache(kv(), kv(), jnp.zeros((slots, width), bool), jnp.zeros((slots,), jnp.int32),
                       decode_block).constrained()
  n = count * group
  zero = jnp.zeros((), jnp.int32)
  return prompts, Slots(slot_cache, rows((slots, logits.shape[-1]), jnp.float32), rows((slots,), jnp.int32),
                        rows((slots,), jnp.int32), rows((slots,), bool), zero, zero,
                        jnp.full((n, max_new_tokens), pad_id, jnp.int32), jnp.zeros((n, max_new_tokens), jnp.float32),
                        jnp.zeros((n, max_new_tokens), jnp.float32), jnp.zeros((n,), jnp.int32),
                        jnp.zeros((n,), bool))


def finished(s: Slots) -> jax.Array:
  """Every sequence has been started and none is live."""
  return ~jnp.any(s.live) & (s.queued >= s.lengths.shape[0])


def take_queued(prompts: Prompts, s: Slots, *, group: int) -> Slots:
  """Gives each free slot the next queued sequence (in order), if any is left."""
  n, prompt_len = s.lengths.shape[0], prompts.mask.shape[1]
  free = ~s.live
  new = s.queued + jnp.cumsum(free, dtype=jnp.int32) - 1
  take = free & (new < n)

  def insert(s: Slots) -> Slots:
    p = jnp.minimum(new, n - 1) // group
    fill = lambda buffer, source: lax.dynamic_update_slice_in_dim(
        buffer, jnp.where(take[:, None, None, None], source[p].astype(buffer.dtype), buffer[:, :, :prompt_len]), 0,
        axis=2)
    responses = s.cache.mask.shape[1] - prompt_len
    mask = jnp.where(take[:, None], jnp.pad(prompts.mask[p], ((0, 0), (0, responses))), s.cache.mask)
    cache = KVCache(tuple(map(fill, s.cache.keys, prompts.keys)), tuple(map(fill, s.cache.values, prompts.values)),
                    mask, jnp.where(take, prompt_len, s.cache.length), s.cache.decode_block)
    return s._replace(cache=cache, logits=jnp.where(take[:, None], prompts.logits[p], s.logits),
                      sequence=jnp.where(take, new, s.sequence), step=jnp.where(take, 0, s.step),
                      live=s.live | take, queued=s.queued + jnp.sum(take, dtype=jnp.int32))

  return lax.cond(jnp.any(take), insert, lambda s: s, s)


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


def decode(model, prompts: Prompts, state: Slots, key: jax.Array, length_limits: jax.Array | None = None, *,
           sampling: common.Sampling, group: int, steps: int, pad_id: int,
           shrink_at: int = 0) -> tuple[Slots, jax.Array]:
  """Up to `steps` iterations of (refill free slots, decode one token in every slot), leaving early
  when every sequence has finished or the slots can shrink (the queue is empty and at most
  `shrink_at` > 0 slots are live). Returns the state and its status `[4]` int32: finished, can
  shrink, live slots, decode iterations run so far."""
  n, max_new = state.tokens.shape
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = jnp.full((n,), max_new, jnp.int32) if length_limits is None else length_limits.astype(jnp.int32)

  def one_step(s: Slots) -> Slots:
    s = take_queued(prompts, s, group=group)
    keys = jax.vmap(lambda seq, t: jax.random.fold_in(jax.random.fold_in(key, seq), t))(s.sequence, s.step)
    tokens, sampler, policy = common.sample_tokens(keys, s.logits, sampling)
    live = s.live
    tokens = jnp.where(live, tokens, pad_id)
    stop = live & jnp.isin(tokens, stop_ids)
    ended = live & (stop | (s.step + 1 >= limits[s.sequence]))
    at, end_at = jnp.where(live, s.sequence, n), jnp.where(ended, s.sequence, n)  # Index n: dropped.
    write = lambda out, x: out.at[at, s.step].set(x, mode="drop")
    positions = prompts.lengths[s.sequence // group] + s.step
    logits, cache = model(tokens[:, None], positions[:, None], live[:, None], s.cache)
    cache = cache.replace(length=jnp.where(live, cache.length, s.cache.length))  # Free slots stay put.
    return Slots(cache, logits[:, -1], s.sequence, jnp.where(live, s.step + 1, s.step), live & ~ended, s.queued,
                 s.decode_steps + 1, write(s.tokens, tokens), write(s.sampler, sampler), write(s.policy, policy),
                 s.lengths.at[end_at].set(s.step + 1, mode="drop"), s.stopped.at[end_at].set(stop, mode="drop"))

  def can_shrink(s: Slots) -> jax.Array:
    return (shrink_at > 0) & (s.queued >= n) & (jnp.sum(s.live, dtype=jnp.int32) <= shrink_at)

  def cond(carry):
    i, s = carry
    return (i < steps) & ~finished(s) & ~can_shrink(s)

  _, state = lax.while_loop(cond, lambda carry: (carry[0] + 1, one_step(carry[1])), (jnp.zeros((), jnp.int32), state))
  status = jnp.stack([finished(state).astype(jnp.int32), can_shrink(state).astype(jnp.int32),
                      jnp.sum(state.live, dtype=jnp.int32), state.decode_steps])
  return state, status


@functools.lru_cache(maxsize=32)
def _row_programs(rows: int, jit: Callable) -> tuple[Callable, Callable]:
  """(order: live slots first, `rows` of them; take: those rows of one array, donating it)."""
  order = jit(lambda live: jnp.argsort(~live, stable=True)[:rows])
  take = jit(lambda x, index: constrain(x[index], ("batch",) + (None,) * (x.ndim - 1)), donate_argnums=0)
  return order, take


def compact(state: Slots, rows: int, *, jit: Callable = jax.jit) -> Slots:
  """The state with `rows` slots: the live ones (at most `rows`) first, in slot order; the
  outputs (by sequence) unchanged. Each array is gathered in its own call that donates it."""
  order, take = _row_programs(rows, jit)
  index = order(state.live)
  with warnings.catch_warnings():  # The donated arrays are freed, not reused: the shapes differ.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    gather = lambda x: take(x, index)
    c = state.cache
    cache = KVCache(tuple(map(gather, c.keys)), tuple(map(gather, c.values)), gather(c.mask), gather(c.length),
                    c.decode_block)
    return state._replace(cache=cache, logits=gather(state.logits), sequence=gather(state.sequence),
                          step=gather(state.step), live=gather(state.live))


class Programs(NamedTuple):
  start: Callable
  decode: Callable
  finish: Callable


@functools.lru_cache(maxsize=32)
def programs(*, sampling: common.Sampling, group: int, slots: int, steps_per_call: int, pad_id: int, cache_dtype,
             decode_block: int | None, min_slots: int = 0, jit: Callable = jax.jit) -> Programs:
  """The three jitted programs of one setting (the decode state is donated between calls)."""
  return Programs(
      start=jit(functools.partial(start, group=group, slots=slots, max_new_tokens=sampling.max_new_tokens,
                                  pad_id=pad_id, cache_dtype=cache_dtype, decode_block=decode_block)),
      decode=jit(functools.partial(decode, sampling=sampling, group=group, steps=steps_per_call, pad_id=pad_id,
                                   shrink_at=shrink_threshold(slots, min_slots)), donate_argnums=(2,)),
      finish=jit(functools.partial(common.finished_rollout, group=group, pad_id=pad_id)))


def generate(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *, sampling: common.Sampling,
             samples_per_prompt: int, slots: int, steps_per_call: int = 256, pad_id: int = 0,
             cache_dtype=jnp.float32, decode_block: int | None = None, min_slots: int = 0,
             jit: Callable = jax.jit, length_limits: jax.Array | None = None) -> tuple[common.Rollout, int, int]:
  """`static.generate`'s `Rollout` (the same tokens and log-probs) from `slots` refilled decode slots,
  the decode iterations run and the rows decoded (Σ slots × iterations). `min_slots` > 0: shrink
  the slots in the tail down to this many (a multiple of the data-parallel devices); 0: never.
  `length_limits` `[P·G]`, in [1, max_new_tokens]."""
  settings = dict(sampling=sampling, group=samples_per_prompt, steps_per_call=steps_per_call, pad_id=pad_id,
                  cache_dtype=jnp.dtype(cache_dtype), decode_block=decode_block, min_slots=min_slots, jit=jit)
  fns = programs(slots=slots, **settings)
  prompts, state = fns.start(model, prompt_tokens, prompt_mask)
  rows, steps, row_steps = slots, 0, 0
  while True:
    state, status = fns.decode(model, prompts, state, key, length_limits)
    done, shrink, live, total = np.asarray(distributed.to_host(status)).tolist()
    row_steps, steps = row_steps + rows * (total - steps), total
    if done:
      break
    if shrink:
      rows = shrunk_slots(live, min_slots)
      state = compact(state, rows, jit=jit)
      fns = programs(slots=rows, **settings)
  out = fns.finish(prompt_tokens, prompt_mask, state.tokens, state.sampler, state.policy, state.lengths, state.stopped)
  return out, steps, row_steps
