"""What both rollout engines share: the sampling settings, the `Rollout` they return, prompt
padding to bucket lengths, KV-cache sizing, the prefill and the finishing of a batch.

Generation runs in-process with the model being trained. The P prompts are prefilled once
(logits of the last position only), each prompt's cache shared by its G samples (prefill cost
divided by G). Shapes are static: prompts are left-padded to a bucket length (`prompt_bucket`),
responses are `max_response_tokens` long (masked after the stop).

Log-probabilities. `sampler_logprobs` are under the distribution actually sampled from: logits
divided by the temperature, then top-k, then top-p filtered and renormalised (0 for greedy, which
is deterministic). `policy_logprobs` are the plain log-softmax of the model's logits at the chosen
tokens — what the trainer recomputes, so their gap measures sampler/trainer mismatch.

Randomness: sequence n of a call (row n = p·G + g of the output) samples its step t with
`fold_in(fold_in(key, n), t)`, so its tokens depend only on the key, n, its prompt and the model —
not on the engine, the slot it ran in, the rounds or the rest of the batch: the engines sample
the same tokens.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax.errors import counted
from vapo_jax.models import sharding
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.sharding import constrain
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rollout import next_token

DECODE_LOOP = "decode_loop"  # `jax.named_scope` of the engines' decode loops: their op_name in compiled HLO.
FINISH_STOP = 0  # Ended on an EOS / stop token (included in the response).
FINISH_LENGTH = 1  # Reached max_response_tokens (or the sequence's own length limit).
FINISH_UNFINISHED = 2  # A partial rollout's call stopped at its budget before the sequence ended.


class Sampling(NamedTuple):
  """How to sample (static: a change compiles a new program)."""

  max_response_tokens: int  # Response length limit.
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
  finish_reason: jax.Array  # [B] FINISH_STOP, FINISH_LENGTH or (a partial round's) FINISH_UNFINISHED.
  sampler_logprobs: jax.Array  # [B, Tr] under the sampling distribution (0 where masked).
  policy_logprobs: jax.Array  # [B, Tr] plain log-softmax of the logits (0 where masked).


def prompt_bucket(length: int, *, minimum: int = 16) -> int:
  """The padded prompt length for `length` tokens: the next power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(length, 1)))))


def cache_bytes(model_cfg, *, batch: int, prompt_tokens: int, max_response_tokens: int, dtype=jnp.float32,
                devices: int = 1, tensor: int = 1) -> int:
  """Per-device memory of the KV cache for a rollout batch split over `devices` (data-parallel groups),
  its keys and values split by KV heads over the `tensor` chips of each group, before allocating."""
  per_device, slots = math.ceil(batch / devices), prompt_tokens + max_response_tokens
  mask = per_device * slots  # [B, S] bool, not split by heads.
  return (KVCache.bytes(model_cfg, per_device, slots, dtype) - mask) // tensor + mask


def check_cache_fits(model_cfg, *, batch, prompt_tokens, max_response_tokens, budget_bytes, dtype=jnp.float32,
                     devices=1, tensor=1) -> int:
  """Raises with what to change when the KV cache will not fit `budget_bytes` per device."""
  needed = cache_bytes(model_cfg, batch=batch, prompt_tokens=prompt_tokens,
                       max_response_tokens=max_response_tokens, dtype=dtype, devices=devices, tensor=tensor)
  if needed > budget_bytes:
    raise MemoryError(
        f"the KV cache for {batch} sequences of {prompt_tokens} prompt + {max_response_tokens} new tokens "
        f"needs {_size(needed)} per device ({devices} data-parallel devices, {jnp.dtype(dtype).name}), over "
        f"the budget of {_size(budget_bytes)} (rollout.kv_cache_budget_gib): raise "
        "rollout.kv_cache_budget_gib if the devices have the memory, lower rollout.prompts_per_step or "
        "rollout.max_response_tokens, or use more data-parallel devices")
  return needed


def _size(nbytes: int) -> str:
  """Bytes in the largest binary unit that keeps a digit before the point (`0.00 GiB` says nothing)."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes} bytes"


def default_page_tokens(platform: str | None = None) -> int:
  """Tokens per page of the refill engine's pool on `platform` (default: the one traced for,
  `sharding.platform()`): 128 on TPU, 16 elsewhere."""
  return 128 if (platform or sharding.platform()) == "tpu" else 16


def sequence_pages(max_response_tokens: int, page_tokens: int) -> int:
  """Pages one sequence holds at most besides its prompt's full pages: its copy of the prompt's last, partly
  filled page and its response."""
  return -(-max_response_tokens // page_tokens) + 1


def table_pages(prompt_tokens: int, max_response_tokens: int, page_tokens: int, block_pages: int) -> int:
  """The page table's width W: a prompt and a response, in whole blocks of pages."""
  return math.ceil(math.ceil((prompt_tokens + max_response_tokens) / page_tokens) / block_pages) * block_pages


def longest_prompt_pages(lengths, page_tokens: int) -> int:
  """The pages of the longest prompt: `lengths` `[P]` real prompt tokens, each prompt ⌈length / page_tokens⌉ pages."""
  return int(-(-np.max(np.asarray(lengths, np.int64), initial=0) // page_tokens))


def check_pool(*, queue_pages: int, held: int, max_response_tokens: int, page_tokens: int,
               given: bool = False, shares: int = 1) -> None:
  """A `MemoryError` naming the settings when a queue's pool of `queue_pages` pages cannot hold its longest prompt
  (`held` pages) and one whole sequence beside it: the one shortage no preemption can resolve (a prompt takes
  its pages when its samples are about to run). `given`: the pages are `rollout.pages` as set (the message
  names it and the value that works: `shares` queues' pools on each device), else `kv_cache_budget_gib`'s."""
  needed = held + sequence_pages(max_response_tokens, page_tokens)
  if queue_pages < needed:
    split = f" ({shares} queues' pools on each device)" if shares > 1 else ""
    raise MemoryError(
        f"the KV cache's pool of {counted(queue_pages, 'page')} of {counted(page_tokens, 'token')} per "
        f"queue{split} cannot hold its longest prompt ({counted(held, 'page')}) and one "
        f"{max_response_tokens}-token response "
        f"({counted(needed, 'page')} in all): "
        + (f"set rollout.pages={needed * shares} or more" if given else "raise rollout.kv_cache_budget_gib") +
        " if the devices have the memory, or lower rollout.max_response_tokens or rollout.max_prompt_tokens")


def sample_tokens(keys: jax.Array, logits: jax.Array, sampling: Sampling, *, sorted_filter: bool = False):
  """One token per row from `[B, V]` logits with per-row keys `[B]`: (tokens, sampler, policy) `[B]`."""
  return next_token.sample_tokens(keys, logits, temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, sorted_filter=sorted_filter)


def prefill(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, *, cache_dtype,
            decode_block: int | None):
  """The P prompts through the model once: (last-position logits [P, V], cache [P, Tp])."""
  cache = KVCache.zeros(model.cfg, *prompt_tokens.shape, cache_dtype, decode_block=decode_block)
  return model.last_logits(prompt_tokens, positions_from_mask(prompt_mask), prompt_mask, cache)


def finished_rollout(prompt_tokens, prompt_mask, tokens, sampler, policy, lengths, stopped, *,
                     samples_per_prompt: int, pad_id: int) -> Rollout:
  """The `Rollout` of `[B, Tr]` decoded tokens and log-probs, valid up to `lengths` `[B]`."""
  expand = lambda x: constrain(jnp.repeat(x, samples_per_prompt, axis=0), ("batch",) + (None,) * (x.ndim - 1))
  response_mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return Rollout(
      prompt_tokens=expand(prompt_tokens), prompt_mask=expand(prompt_mask.astype(bool)),
      response_tokens=jnp.where(response_mask, tokens, pad_id), response_mask=response_mask,
      response_lengths=lengths.astype(jnp.int32),
      finish_reason=jnp.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32),
      sampler_logprobs=jnp.where(response_mask, sampler, 0.0),
      policy_logprobs=jnp.where(response_mask, policy, 0.0))


def pad_prompts(prompts: list[list[int]], *, pad_id: int,
                bucket_minimum: int = 16) -> tuple[np.ndarray, np.ndarray]:
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
