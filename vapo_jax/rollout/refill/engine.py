"""The refill engine: decode slots over a paged KV cache, refilled as sequences end (continuous batching).

Response lengths in long chain-of-thought RL are long-tailed: most responses end early, a few run to the
cap. R decode slots (rows) run the N = P·G sequences of a call as Q queues (`queues.py`), and their keys and
values live in a pool of pages (`models/kv_cache.PagedKVCache`, `pages.py`), so memory follows the live tokens
rather than R × the longest possible sequence, and each row's attention reads only its own pages
(`models/paged_attention.py`: the Pallas kernel on TPU). A prompt takes pages only when its samples are about
to run, and a group's G samples share its pages: the prompt is stored once. Each iteration of the decode loop
(`decode`):

  1. under page pressure the queue gives back idle prompts, prefills and the rows that started last until the
     rest fit (`slots.preempt`; a preempted sequence restarts from its prompt: `rollout/preemptions`, and the
     tokens to decode again, `rollout/recomputed_tokens`);
  2. the prefill lanes (`prefill.py`): the prompts of the next sequences take their pages and are prefilled,
     a chunk of `prefill_chunk` tokens per lane and iteration, through the same paged attention;
  3. free slots take the next sequences whose prompts are prefilled, preempted ones first, and a page goes to
     each row whose next token starts one (`slots.admit`, `slots.allocate`);
  4. every live row samples one token and writes it at its own position (`Slots.cache.lengths`); a row that
     sampled a stop token or reached its length gives its own pages back, and a prompt whose samples have all
     ended gives back its pages.

Sequence n samples its step t with `fold_in(fold_in(key, n), t)`, so a restarted sequence samples the same
tokens, and a row's numbers depend on neither its slot nor its neighbours: the static engine's tokens,
whatever the slots, pages, chunks or preemptions. The call ends when every queue is empty and no slot is live;
in the tail (queues empty, at most half the slots live) the rows shrink to `min_slots`·2^k (a gather of each
row's table and state: the pool does not move) so stragglers decode in a small batch.

A queue's pool must hold its longest prompt and one whole sequence beside it (`common.check_pool`): the one
shortage no preemption can resolve; anything more only saves recomputation. Iterations run on the device,
`steps_per_call` of them per host call (`lax.while_loop`, leaving early when everything has finished or the
slots can shrink; `queues.drive` is the host loop). Outputs are written by sequence (`[N, Tr]`, split over the
batch axes): the `Rollout` has the static engine's row order.
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
from vapo_jax.models.sharding import constrain
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import prefill
from vapo_jax.rollout.refill import queues as q_lib
from vapo_jax.rollout.refill import resumed as resumed_lib
from vapo_jax.rollout.refill import slots as slots_lib
from vapo_jax.rollout.refill.slots import Slots


def decode(model, state: Slots, key: jax.Array, length_limits: jax.Array | None = None,
           resumed: resumed_lib.Resumed | None = None, *, sampling: common.Sampling, samples_per_prompt: int,
           steps: int, chunk: int, shrink_at: int = 0) -> tuple[Slots, jax.Array]:
  """Up to `steps` iterations (module docstring, step 2), leaving early when every sequence has finished or
  the slots can shrink (the queues are empty and `rows_needed` ≤ `shrink_at` > 0), or at `resumed.budget`
  iterations in all that decoded a row (when it gives every page back). Returns the state and its status `[4]`
  int32: finished (or stopped at the budget), can shrink, rows needed, decode iterations run so far."""
  n, max_response_tokens = state.outputs.tokens.shape
  queues, rows = state.queued.shape[0], state.live.shape[0]
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = jnp.full((n,), max_response_tokens,
                    jnp.int32) if length_limits is None else length_limits.astype(jnp.int32)
  window = rows // queues + state.lanes.shape[1]  # The sequences a prefill may be for: a queue's slots and lanes.

  def one_step(s: Slots) -> Slots:
    s, blocked = slots_lib.preempt(s, samples_per_prompt=samples_per_prompt)
    s = prefill.chunk(model, prefill.begin(s, blocked, samples_per_prompt=samples_per_prompt, window=window),
                      tokens=chunk)
    s, taken = slots_lib.admit(s, blocked, samples_per_prompt=samples_per_prompt)
    s = slots_lib.allocate(s, taken, samples_per_prompt=samples_per_prompt)
    live, local = s.live, slots_lib.local_sequence(s)
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
    counters = s.counters.at[slots_lib.ITERATIONS].add(1).at[slots_lib.DECODED].add(jnp.any(live).astype(jnp.int32))
    s = s._replace(cache=cache, logits=logits[:, -1], step=jnp.where(live, s.step + 1, s.step),
                   live=live & ~ended, outputs=outputs, counters=counters)
    return slots_lib.finish_prompts(slots_lib.release(s, ended), ended, samples_per_prompt=samples_per_prompt)

  def can_shrink(s: Slots) -> jax.Array:
    return (shrink_at > 0) & slots_lib.drained(s) & (q_lib.rows_needed(s.live, queues) <= shrink_at)

  def spent(s: Slots) -> jax.Array:
    return jnp.zeros((), bool) if resumed is None else s.counters[slots_lib.DECODED] >= resumed.budget

  def cond(carry):
    i, s = carry
    return (i < steps) & ~slots_lib.finished(s) & ~can_shrink(s) & ~spent(s)

  with jax.named_scope(common.DECODE_LOOP):  # Names the loop in the HLO (the compile report reads its traffic).
    _, state = lax.while_loop(cond, lambda carry: (carry[0] + 1, one_step(carry[1])),
                              (jnp.zeros((), jnp.int32), state))
  iterations = state.counters[slots_lib.ITERATIONS]
  ended = slots_lib.finished(state) | spent(state)
  if resumed is not None:  # Stopped at the budget: the call gives its pages back (its rows keep their steps).
    state = slots_lib.release(state, state.live & spent(state))
    state = slots_lib.release_prompts(state, (state.prompts.started >= 0) & spent(state))
  status = jnp.stack([ended.astype(jnp.int32), can_shrink(state).astype(jnp.int32),
                      q_lib.rows_needed(state.live, queues), iterations])
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


def programs(plan, *, sampling: common.Sampling, pad_id: int, cache_dtype, jit: Callable = jax.jit,
             slots: int | None = None) -> Programs:
  """The three jitted programs of a refill `RolloutPlan` at `slots` rows (default: the plan's), one set per
  setting (the decode state is donated between calls)."""
  return _programs(plan, sampling=sampling, pad_id=pad_id, cache_dtype=jnp.dtype(cache_dtype), jit=jit,
                   slots=slots or plan.slots)


@functools.lru_cache(maxsize=32)
def _programs(plan, *, sampling: common.Sampling, pad_id: int, cache_dtype, jit: Callable,
              slots: int) -> Programs:
  return Programs(
      start=jit(functools.partial(
          slots_lib.start, samples_per_prompt=plan.samples_per_prompt, slots=slots, queues=plan.queues,
          queue_pages=plan.queue_pages,
          pad_id=pad_id, page_tokens=plan.page_tokens, block_pages=plan.block_pages,
          implementation=plan.attention,
          lanes=plan.lanes, max_response_tokens=sampling.max_response_tokens, cache_dtype=cache_dtype)),
      decode=jit(functools.partial(decode, sampling=sampling, samples_per_prompt=plan.samples_per_prompt,
                                   steps=plan.steps_per_call, chunk=plan.prefill_chunk,
                                   shrink_at=q_lib.shrink_threshold(slots, plan.min_slots)),
                 donate_argnums=(1,)),
      finish=jit(functools.partial(common.finished_rollout, samples_per_prompt=plan.samples_per_prompt,
                                   pad_id=pad_id)))


def generate_refill(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *, plan,
                    sampling: common.Sampling, pad_id: int = 0, cache_dtype=jnp.float32,
                    jit: Callable = jax.jit,
                    length_limits: jax.Array | None = None, resumed: resumed_lib.Resumed | None = None
                    ) -> tuple[common.Rollout, int, int, dict[str, float]]:
  """`static.generate_static`'s `Rollout` (the same tokens and log-probs) as the refill `RolloutPlan` `plan`
  runs it (its slots, queues, pool, prefill lanes and chunks; `rollout/plan.py` has checked that its pool
  holds the call's longest prompt and one sequence); the decode iterations run, the rows decoded (Σ slots ×
  iterations) and the pool's figures: `rollout/preemptions`, `rollout/recomputed_tokens`, `rollout/prefills`
  (prompts prefilled, again after being given back too), `rollout/prefill_chunks`, `rollout/prefill_tokens`,
  `rollout/queue_pages_peak` (the most any queue held at once) and `rollout/queue_pages_free_after` (the fewest
  any queue had free at the end). `resumed`: a partial rollout's call, which stops at its budget; a sequence still
  decoding or waiting then has the tokens it holds (`progress`) as its length and `common.FINISH_UNFINISHED`
  as its finish reason."""
  if prompt_tokens.shape != (plan.prompts, plan.prompt_tokens) or sampling.max_response_tokens != \
      plan.max_response_tokens or plan.engine != "refill":
    raise ValueError(f"the plan ({plan.engine}) is for {plan.prompts} prompts of {plan.prompt_tokens} tokens "
                     f"and {plan.max_response_tokens}-token responses; the call has prompts "
                     f"{prompt_tokens.shape} and {sampling.max_response_tokens}-token responses")
  fns, state, steps, row_steps = q_lib.drive(
      lambda rows: programs(plan, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, jit=jit,
                            slots=rows),
      lambda state, rows: compact(state, rows, jit=jit), model, prompt_tokens, prompt_mask, key,
      length_limits, resumed, slots=plan.slots, min_slots=plan.min_slots)
  o = state.outputs
  held = o.lengths if resumed is None else resumed_lib.progress_program(jit)(state)
  out = fns.finish(prompt_tokens, prompt_mask, o.tokens, o.sampler, o.policy, held, o.stopped)
  if resumed is not None:
    out = resumed_lib.unfinished_program(jit)(out, o.lengths)
  counters, free, peak = (np.asarray(x) for x in distributed.to_host((state.counters, state.free.count,
                                                                      state.free.peak)))
  figures = {"rollout/preemptions": float(counters[slots_lib.PREEMPTIONS]),
             "rollout/recomputed_tokens": float(counters[slots_lib.RECOMPUTED]),
             "rollout/prefills": float(counters[slots_lib.PREFILLS]),
             "rollout/prefill_chunks": float(counters[slots_lib.CHUNKS]),
             "rollout/prefill_tokens": float(counters[slots_lib.PREFILLED]),
             "rollout/queue_pages_peak": float(peak.max()),
             "rollout/queue_pages_free_after": float(free.min())}
  return out, steps, row_steps, figures
