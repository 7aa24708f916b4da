"""The static engine: every sequence of a call in one batch, decoded in a jitted
`lax.while_loop` that stops when every sequence has finished (the reference the refill engine is
tested against; `rollout.sample` runs it in rounds of prompts when asked).

The P prompts are prefilled once and each prompt's cache is repeated for its G samples, in a
cache with room for the response; each decode step samples one token per row (`common`'s
randomness: sequence n's step t draws from `fold_in(fold_in(key, n), t)`).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.sharding import constrain
from vapo_jax.rollout.common import DECODE_LOOP, Rollout, Sampling, finished_rollout, prefill, sample_tokens


class Loop(NamedTuple):
  """The decode loop's carry: step, cache, next-token logits `[B, V]`, done `[B]`, and the outputs `[B, Tr]`."""

  step: jax.Array
  cache: KVCache
  next_logits: jax.Array
  done: jax.Array
  tokens: jax.Array
  sampler: jax.Array
  policy: jax.Array


def generate_static(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                    sampling: Sampling, samples_per_prompt: int = 1, pad_id: int = 0, cache_dtype=jnp.float32,
                    decode_block: int | None = None, first_sequence: jax.Array | int = 0,
                    length_limits: jax.Array | None = None) -> Rollout:
  """The static engine: `samples_per_prompt` responses for each of the P left-padded prompts `[P, Tp]`.

  Jit it with the keyword arguments static except `first_sequence` and `length_limits` (see
  `make_generate`). Row b = p·G + g of the output is sample g of prompt p, sequence
  `first_sequence + b` of the key. `length_limits` `[B]` (≤ max_response_tokens) ends row b at its own
  length (finish reason "length"); None: max_response_tokens for every row.
  """
  prompts, prompt_len = prompt_tokens.shape
  samples_per_prompt, max_response_tokens = samples_per_prompt, sampling.max_response_tokens
  batch = prompts * samples_per_prompt
  prompt_mask = prompt_mask.astype(bool)
  logits, prefill_cache = prefill(model, prompt_tokens, prompt_mask, cache_dtype=cache_dtype,
                                  decode_block=decode_block)
  expand = lambda x: constrain(jnp.repeat(x, samples_per_prompt, axis=0), ("batch",) + (None,) * (x.ndim - 1))
  cache = prefill_cache.repeated(samples_per_prompt, max_response_tokens)  # Shared by its G samples, with room.
  next_position = expand(jnp.sum(prompt_mask, axis=-1).astype(jnp.int32))
  row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(first_sequence + jnp.arange(batch))
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  limits = (jnp.full((batch,), max_response_tokens, jnp.int32) if length_limits is None
            else jnp.asarray(length_limits, jnp.int32))

  def body(s: Loop) -> Loop:
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, s.step))(row_keys)
    tokens, sampler, policy = sample_tokens(step_keys, s.next_logits, sampling)
    live = ~s.done
    tokens = jnp.where(live, tokens, pad_id)
    done = s.done | jnp.isin(tokens, stop_ids) | (s.step + 1 >= limits)
    write = lambda buffer, x: jax.lax.dynamic_update_slice(
        buffer, jnp.where(live, x, 0).astype(buffer.dtype)[:, None], (0, s.step))
    logits, cache = model(tokens[:, None], (next_position + s.step)[:, None], jnp.ones((batch, 1), bool),
                          s.cache)
    return Loop(s.step + 1, cache, logits[:, -1], done,
                jax.lax.dynamic_update_slice(s.tokens, tokens[:, None], (0, s.step)),
                write(s.sampler, sampler), write(s.policy, policy))

  def cond(s: Loop):
    return (s.step < max_response_tokens) & ~jnp.all(s.done)

  next_logits = constrain(jnp.repeat(logits, samples_per_prompt, axis=0), ("batch", "act_vocab"))
  init = Loop(jnp.zeros((), jnp.int32), cache, next_logits, jnp.zeros((batch,), bool),
              jnp.full((batch, max_response_tokens), pad_id, jnp.int32),
              jnp.zeros((batch, max_response_tokens), jnp.float32),
              jnp.zeros((batch, max_response_tokens), jnp.float32))
  with jax.named_scope(DECODE_LOOP):  # Names the loop in the HLO (the compile report reads its traffic).
    final = jax.lax.while_loop(cond, body, init)
  # A row is valid up to and including its first stop token, and at most up to its limit.
  is_stop = jnp.isin(final.tokens, stop_ids) & (jnp.arange(max_response_tokens)[None] < limits[:, None])
  first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), max_response_tokens)
  lengths = jnp.minimum(first_stop + 1, limits)
  return finished_rollout(prompt_tokens, prompt_mask, final.tokens, final.sampler, final.policy, lengths,
                          first_stop < limits, samples_per_prompt=samples_per_prompt, pad_id=pad_id)


@functools.lru_cache(maxsize=32)
def make_generate(*, sampling: Sampling, samples_per_prompt: int, pad_id: int, cache_dtype=jnp.float32,
                  decode_block: int | None = None, jit: Callable = jax.jit):
  """`generate_static` jitted for one setting: `fn(model, prompt_tokens, prompt_mask, key,
  first_sequence=0, length_limits=None)`."""
  return jit(lambda model, tokens, mask, key, first_sequence=0, length_limits=None: generate_static(
      model, tokens, mask, key, sampling=sampling, samples_per_prompt=samples_per_prompt, pad_id=pad_id,
      cache_dtype=cache_dtype, decode_block=decode_block, first_sequence=first_sequence,
      length_limits=length_limits))
