"""Rollout engine: batched generation with a KV cache, group sampling, per-token log-probs.

Generation runs in-process with the model being trained (no second engine, no weight copy):
one prefill of the P prompts, the prompt cache repeated for the G samples of each prompt (prefill
cost divided by G), then a jitted `lax.while_loop` decoding one token per sequence per step that
stops as soon as every sequence has finished.

Shapes are static: prompts are left-padded to a bucket length (`prompt_bucket`), responses are
`max_new_tokens` long (masked after the stop), so a run compiles one program per prompt bucket.

Log-probabilities. `sampler_logprobs` are under the distribution actually sampled from: logits
divided by the temperature, then top-k, then top-p filtered and renormalised (0 for greedy, which
is deterministic). `policy_logprobs` are the plain log-softmax of the model's logits at the chosen
tokens — what the trainer recomputes, so their gap measures sampler/trainer mismatch.

Randomness: row b of the batch samples step t with `fold_in(fold_in(key, b), t)`, so a row's
tokens depend only on its key, its prompt and the model — not on the rest of the batch.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax.models.sharding import constrain
from vapo_jax.models.transformer import KVCache, positions_from_mask  # noqa: F401  (KVCache re-exported)

FINISH_STOP = 0  # Ended on an EOS / stop token (included in the response).
FINISH_LENGTH = 1  # Reached max_new_tokens.


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


def filter_logits(logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus) filtering of `[..., V]` logits (float32)."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p  # The most likely token is always kept.
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def _argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (first index of the maximum, NaN counting as the maximum) as two
  plain reductions. XLA:CPU fuses the Gumbel noise into argmax's (value, index) reduction, which then
  runs slower than drawing the noise: sampling 16 rows of 152k logits took ~50 ms this way against
  ~100 ms with `jax.random.categorical`, next to a ~0.5 s decode step of the 0.5B model."""
  best = jnp.max(x, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  is_best = (x == best) | jnp.isnan(x)
  return jnp.min(jnp.where(is_best, index, x.shape[-1]), axis=-1)


def sample_tokens(keys: jax.Array, logits: jax.Array, sampling: Sampling):
  """One token per row from `[B, V]` logits with per-row keys `[B]`.

  Returns (tokens [B], sampler_logprobs [B], policy_logprobs [B]).
  """
  logits = logits.astype(jnp.float32)
  policy = jax.nn.log_softmax(logits, axis=-1)
  if sampling.temperature == 0:
    tokens = jnp.argmax(logits, axis=-1)
    sampler = jnp.zeros(tokens.shape, jnp.float32)
  else:
    processed = filter_logits(logits, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p)
    # `jax.random.categorical` per row (same Gumbel noise, same tokens) with a faster argmax.
    noise = jax.vmap(lambda k: jax.random.gumbel(k, processed.shape[-1:]))(keys)
    tokens = _argmax(processed + noise)
    sampler = jnp.take_along_axis(jax.nn.log_softmax(processed, axis=-1), tokens[:, None], axis=-1)[:, 0]
  policy = jnp.take_along_axis(policy, tokens[:, None], axis=-1)[:, 0]
  return tokens.astype(jnp.int32), sampler, policy


def generate(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
             sampling: Sampling, samples_per_prompt: int = 1, pad_id: int = 0,
             cache_dtype=jnp.float32) -> Rollout:
  """Samples `samples_per_prompt` responses for each of the P left-padded prompts `[P, Tp]`.

  Jit it with `sampling`, `samples_per_prompt`, `pad_id` and `cache_dtype` static (see
  `make_generate`). Row b = p·G + g of the output is sample g of prompt p, drawn with key
  `fold_in(key, b)`.
  """
  prompts, prompt_len = prompt_tokens.shape
  group = samples_per_prompt
  batch, steps = prompts * group, sampling.max_new_tokens
  prompt_mask = prompt_mask.astype(bool)
  cfg = model.cfg
  # Prefill the P prompts once, into a cache just large enough for them.
  prefill_cache = KVCache.zeros(cfg, prompts, prompt_len, cache_dtype)
  logits, prefill_cache = model(prompt_tokens, positions_from_mask(prompt_mask), prompt_mask, prefill_cache)
  # Share each prompt's cache with its G samples, in a cache with room for the response.
  expand = lambda x: constrain(jnp.repeat(x, group, axis=0), ("batch",) + (None,) * (x.ndim - 1))
  pad_slots = lambda x: jnp.pad(x, ((0, 0), (0, steps)) + ((0, 0),) * (x.ndim - 2))
  cache = KVCache(tuple(pad_slots(expand(k)) for k in prefill_cache.keys),
                  tuple(pad_slots(expand(v)) for v in prefill_cache.values),
                  pad_slots(expand(prefill_cache.mask)), prefill_cache.length)
  next_logits = expand(logits[:, -1])
  next_position = expand(jnp.sum(prompt_mask, axis=-1).astype(jnp.int32))
  row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)

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
    done = s.done | jnp.isin(tokens, stop_ids)
    write = lambda buffer, x: jax.lax.dynamic_update_slice(buffer, jnp.where(live, x, 0).astype(buffer.dtype)[:, None], (0, s.step))
    logits, cache = model(tokens[:, None], (next_position + s.step)[:, None], jnp.ones((batch, 1), bool), s.cache)
    return Loop(s.step + 1, cache, logits[:, -1], done,
                jax.lax.dynamic_update_slice(s.tokens, tokens[:, None], (0, s.step)),
                write(s.sampler, sampler), write(s.policy, policy))

  def cond(s: Loop):
    return (s.step < steps) & ~jnp.all(s.done)

  init = Loop(jnp.zeros((), jnp.int32), cache, next_logits, jnp.zeros((batch,), bool),
              jnp.full((batch, steps), pad_id, jnp.int32), jnp.zeros((batch, steps), jnp.float32),
              jnp.zeros((batch, steps), jnp.float32))
  final = jax.lax.while_loop(cond, body, init)
  # A row is valid up to and including its first stop token.
  is_stop = jnp.isin(final.tokens, stop_ids) & (jnp.arange(steps)[None] < final.step)
  first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), steps)
  lengths = jnp.minimum(first_stop + 1, jnp.minimum(final.step, steps)).astype(jnp.int32)
  response_mask = jnp.arange(steps)[None] < lengths[:, None]
  return Rollout(
      prompt_tokens=expand(prompt_tokens), prompt_mask=expand(prompt_mask),
      response_tokens=jnp.where(response_mask, final.tokens, pad_id), response_mask=response_mask,
      response_lengths=lengths,
      finish_reason=jnp.where(first_stop < steps, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32),
      sampler_logprobs=jnp.where(response_mask, final.sampler, 0.0),
      policy_logprobs=jnp.where(response_mask, final.policy, 0.0))


@functools.lru_cache(maxsize=32)
def make_generate(*, sampling: Sampling, samples_per_prompt: int, pad_id: int, cache_dtype=jnp.float32):
  """`generate` jitted for one sampling setting: `fn(model, prompt_tokens, prompt_mask, key)`."""
  return jax.jit(lambda model, tokens, mask, key: generate(
      model, tokens, mask, key, sampling=sampling, samples_per_prompt=samples_per_prompt, pad_id=pad_id,
      cache_dtype=cache_dtype))


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
