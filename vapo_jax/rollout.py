"""Rollout engines: batched generation with a KV cache, group sampling, per-token log-probs.

Generation runs in-process with the model being trained (no second engine, no weight copy). The
P prompts are prefilled once (logits of the last position only), each prompt's cache shared by its
G samples (prefill cost divided by G). Two engines decode, one token per sequence per step:

  static  `generate` here: one batch of every sequence, in a jitted `lax.while_loop` that stops
          when every sequence has finished.
  refill  `refill.py`: a fixed number of decode slots; a slot whose sequence has finished takes
          the next queued (prompt, sample) at once, so long responses no longer hold the batch.

`generation.sample` is the entry point of a rollout step: it picks the engine, times it and
returns the `Rollout` with its metrics.

Both read only the filled part of the KV cache (`models/decode_attention.py`) and sample with
sort-free top-k / top-p (`sampling.py`). Shapes are static: prompts are left-padded to a bucket
length (`prompt_bucket`), responses are `max_new_tokens` long (masked after the stop).

Log-probabilities. `sampler_logprobs` are under the distribution actually sampled from: logits
divided by the temperature, then top-k, then top-p filtered and renormalised (0 for greedy, which
is deterministic). `policy_logprobs` are the plain log-softmax of the model's logits at the chosen
tokens — what the trainer recomputes, so their gap measures sampler/trainer mismatch.

Randomness: sequence n of a call (row n = p·G + g of the output) samples its step t with
`fold_in(fold_in(key, n), t)`, so its tokens depend only on the key, n, its prompt and the model —
not on the engine, the slot it ran in, the rounds or the rest of the batch: the engines sample
the same tokens.
"""

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import sampling as sampling_lib
from vapo_jax.models.sharding import constrain
from vapo_jax.models.transformer import KVCache, positions_from_mask
from vapo_jax.sampling import filter_logits, filter_logits_sorted  # noqa: F401  (re-exported)

FINISH_STOP = 0  # Ended on an EOS / stop token (included in the response).
FINISH_LENGTH = 1  # Reached max_new_tokens (or the sequence's own length limit).


class Sampling(NamedTuple):
  """How to sample (static: a change compiles a new program)."""

  max_new_tokens: int  # Response length limit.
  stop_token_ids: tuple[int, ...]  # EOS and other stop tokens.
  temperature: float = 1.0  # 0: greedy.
  top_p: float = 1.0  # Nucleus mass (1: off).
  top_k: int = 0  # 0: off.


class Rollout(NamedTuple):
  """Generated batch; B = P·G rows, each prompt's G samples contiguous."""

  prompt_tokens: jax.Array  # [B, Tp] left-padded.
  prompt_mask: jax.Array  # [B, Tp].
  response_tokens: jax.Array  # [B, Tr] (pad_id after the end).
  response_mask: jax.Array  # [B, Tr] true up to and including the stop token.
  response_lengths: jax.Array  # [B] int32.
  finish_reason: jax.Array  # [B] FINISH_STOP or FINISH_LENGTH.
  sampler_logprobs: jax.Array  # [B, Tr] under the sampling distribution (0 where masked).
  policy_logprobs: jax.Array  # [B, Tr] plain log-softmax of the logits (0 where masked).


def prompt_bucket(length: int, *, minimum: int = 16) -> int:
  """The padded prompt length for `length` tokens: the next power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(length, 1)))))


def cache_bytes(model_cfg, *, batch: int, prompt_tokens: int, max_new_tokens: int, dtype=jnp.float32,
                devices: int = 1) -> int:
  """Per-device memory of the KV cache for a rollout batch split over `devices`, before allocating."""
  per_device = math.ceil(batch / devices)
  return KVCache.bytes(model_cfg, per_device, prompt_tokens + max_new_tokens, dtype)


def check_cache_fits(model_cfg, *, batch, prompt_tokens, max_new_tokens, budget_bytes, dtype=jnp.float32,
                     devices=1) -> int:
  """Raises with what to change when the KV cache will not fit `budget_bytes` per device."""
  needed = cache_bytes(model_cfg, batch=batch, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                       dtype=dtype, devices=devices)
  if needed > budget_bytes:
    raise MemoryError(
        f"the KV cache for {batch} sequences of {prompt_tokens} prompt + {max_new_tokens} new tokens needs "
        f"{needed / 2**30:.2f} GiB per device ({devices} data-parallel devices, {jnp.dtype(dtype).name}), "
        f"over the budget of {budget_bytes / 2**30:.2f} GiB: lower rollout.prompts_per_step or "
        f"rollout.max_response_tokens, or use more data-parallel devices")
  return needed


def slots_that_fit(model_cfg, *, sequences: int, prompt_tokens: int, max_new_tokens: int, budget_bytes: int,
                   dtype=jnp.float32, devices: int = 1) -> int:
  """The most decode slots, a multiple of `devices` and no more than `sequences` need (rounded up
  to `devices`), whose KV cache fits `budget_bytes` per device; raises when not one slot per device fits."""
  per_sequence = cache_bytes(model_cfg, batch=1, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                             dtype=dtype)
  per_device = min(-(-sequences // devices), budget_bytes // per_sequence)
  if per_device < 1:
    check_cache_fits(model_cfg, batch=devices, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                     budget_bytes=budget_bytes, dtype=dtype, devices=devices)
  return per_device * devices


def sample_tokens(keys: jax.Array, logits: jax.Array, sampling: Sampling, *, sorted_filter: bool = False):
  """One token per row from `[B, V]` logits with per-row keys `[B]`: (tokens, sampler, policy) `[B]`."""
  return sampling_lib.sample_tokens(keys, logits, temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, sorted_filter=sorted_filter)


def prefill(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, cache_dtype, decode_block: int | None):
  """The P prompts through the model once: (last-position logits [P, V], cache [P, Tp])."""
  cache = KVCache.zeros(model.cfg, *prompt_tokens.shape, cache_dtype, decode_block=decode_block)
  return model.last_logits(prompt_tokens, positions_from_mask(prompt_mask), prompt_mask, cache)


def finished_rollout(prompt_tokens, prompt_mask, tokens, sampler, policy, lengths, stopped, *, group: int,
                     pad_id: int) -> Rollout:
  """The `Rollout` of `[B, Tr]` decoded tokens and log-probs, valid up to `lengths` `[B]`."""
  expand = lambda x: constrain(jnp.repeat(x, group, axis=0), ("batch",) + (None,) * (x.ndim - 1))
  response_mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return Rollout(
      prompt_tokens=expand(prompt_tokens), prompt_mask=expand(prompt_mask.astype(bool)),
      response_tokens=jnp.where(response_mask, tokens, pad_id), response_mask=response_mask,
      response_lengths=lengths.astype(jnp.int32),
      finish_reason=jnp.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32),
      sampler_logprobs=jnp.where(response_mask, sampler, 0.0), policy_logprobs=jnp.where(response_mask, policy, 0.0))


def generate(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
             sampling: Sampling, samples_per_prompt: int = 1, pad_id: int = 0, cache_dtype=jnp.float32,
             decode_block: int | None = None, first_sequence: jax.Array | int = 0,
             length_limits: jax.Array | None = None) -> Rollout:
  """The static engine: `samples_per_prompt` responses for each of the P left-padded prompts `[P, Tp]`.

  Jit it with the keyword arguments static except `first_sequence` and `length_limits` (see
  `make_generate`). Row b = p·G + g of the output is sample g of prompt p, sequence
  `first_sequence + b` of the key. `length_limits` `[B]` (≤ max_new_tokens) ends row b at its own
  length (finish reason "length"); None: max_new_tokens for every row.
  """
  prompts, prompt_len = prompt_tokens.shape
  group, steps = samples_per_prompt, sampling.max_new_tokens
  batch = prompts * group
  prompt_mask = prompt_mask.astype(bool)
  logits, prefill_cache = prefill(model, prompt_tokens, prompt_mask, cache_dtype=cache_dtype,
                                  decode_block=decode_block)
  # Share each prompt's cache with its G samples, in a cache with room for the response.
  expand = lambda x: constrain(jnp.repeat(x, group, axis=0), ("batch",) + (None,) * (x.ndim - 1))
  pad_slots = lambda x: jnp.pad(x, ((0, 0), (0, steps)) + ((0, 0),) * (x.ndim - 2))
  cache = KVCache(tuple(pad_slots(expand(k)) for k in prefill_cache.keys),
                  tuple(pad_slots(expand(v)) for v in prefill_cache.values),
                  pad_slots(expand(prefill_cache.mask)), prefill_cache.length, decode_block)
  next_position = expand(jnp.sum(prompt_mask, axis=-1).astype(jnp.int32))
  row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(first_sequence + jnp.arange(batch))
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = jnp.full((batch,), steps, jnp.int32) if length_limits is None else jnp.asarray(length_limits, jnp.int32)

  class Loop(NamedTuple):
    step: jax.Array
    cache: KVCache
    next_logits: jax.Array
    done: jax.Array
    tokens: jax.Array
    sampler: jax.Array
    policy: jax.Array

  def body(s: Loop) -> Loop:
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, s.step))(row_keys)
    tokens, sampler, policy = sample_tokens(step_keys, s.next_logits, sampling)
    live = ~s.done
    tokens = jnp.where(live, tokens, pad_id)
    done = s.done | jnp.isin(tokens, stop_ids) | (s.step + 1 >= limits)
    write = lambda buffer, x: jax.lax.dynamic_update_slice(buffer, jnp.where(live, x, 0).astype(buffer.dtype)[:, None], (0, s.step))
    logits, cache = model(tokens[:, None], (next_position + s.step)[:, None], jnp.ones((batch, 1), bool), s.cache)
    return Loop(s.step + 1, cache, logits[:, -1], done,
                jax.lax.dynamic_update_slice(s.tokens, tokens[:, None], (0, s.step)),
                write(s.sampler, sampler), write(s.policy, policy))

  def cond(s: Loop):
    return (s.step < steps) & ~jnp.all(s.done)

  init = Loop(jnp.zeros((), jnp.int32), cache, expand(logits), jnp.zeros((batch,), bool),
              jnp.full((batch, steps), pad_id, jnp.int32), jnp.zeros((batch, steps), jnp.float32),
              jnp.zeros((batch, steps), jnp.float32))
  final = jax.lax.while_loop(cond, body, init)
  # A row is valid up to and including its first stop token, and at most up to its limit.
  is_stop = jnp.isin(final.tokens, stop_ids) & (jnp.arange(steps)[None] < limits[:, None])
  first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), steps)
  lengths = jnp.minimum(first_stop + 1, limits)
  return finished_rollout(prompt_tokens, prompt_mask, final.tokens, final.sampler, final.policy, lengths,
                          first_stop < limits, group=group, pad_id=pad_id)


@functools.lru_cache(maxsize=32)
def make_generate(*, sampling: Sampling, samples_per_prompt: int, pad_id: int, cache_dtype=jnp.float32,
                  decode_block: int | None = None, jit: Callable = jax.jit):
  """The static `generate` jitted for one setting: `fn(model, prompt_tokens, prompt_mask, key,
  first_sequence=0, length_limits=None)`."""
  return jit(lambda model, tokens, mask, key, first_sequence=0, length_limits=None: generate(
      model, tokens, mask, key, sampling=sampling, samples_per_prompt=samples_per_prompt, pad_id=pad_id,
      cache_dtype=cache_dtype, decode_block=decode_block, first_sequence=first_sequence,
      length_limits=length_limits))


def pad_prompts(prompts: list[list[int]], *, pad_id: int, bucket_minimum: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to their bucket length: (tokens [P, Tp], mask [P, Tp])."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  length = prompt_bucket(max(map(len, prompts)), minimum=bucket_minimum)
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, prompt in enumerate(prompts):
    tokens[i, length - len(prompt):] = prompt
    mask[i, length - len(prompt):] = True
  return tokens, mask
