"""Rollout: G sampled responses for each of P prompts with the model being trained, on the devices.

  engine = rollout.engine_for(config.rollout, model_cfg, sequences=P·G, prompt_tokens=Tp,
                              dtype=cache_dtype, devices=data-parallel devices)   # layout.data_devices
  out, metrics = rollout.sample(model, prompt_tokens, prompt_mask, key, sampling=..., samples_per_prompt=G,
                                engine=engine, pad_id=..., cache_dtype=..., jit=..., place=...)

The package, one module a part:
  sampling  the token sampler: temperature, top-k and top-p by threshold bisection (sort: oracle)
  common    what both engines share: `Sampling`, the `Rollout`, prompt buckets, KV-cache sizing,
            the prefill
  static    the static engine: every sequence of a round in one batch (the reference)
  refill    the refill engine (a folder): decode slots over a paged KV cache, refilled as sequences end,
            preempted and restarted when the pages run out; its contiguous reference, its host loop, its
            pages and queues, partial rollouts' calls, and its replay on the host
  partial   partial rollouts: rounds stopped at `rollout.decode_budget`, the unfinished sequences carried over
            (host state), complete groups handed to training, `rollout.max_staleness` enforced
  layout    the rollout layout: the mesh, sharding rules and resharded weights the rollout decodes with
  here      `sample`, the entry point of a rollout step: the configured engine, timed, and its metrics

`sample` runs the static engine (`static.generate_static`, optionally in rounds of prompts) or the refill
engine (`refill.generate_refill`, over a paged KV cache); when every sequence has a slot and the pool holds
them all at the cap there is nothing to refill or page, and the static engine runs (`refills`). Both
sample the same tokens for the same key (sequence n of the call draws from `fold_in(key, n)`), so the
engine is a speed setting, never a change of results.

Metrics (`rollout_metrics`): `time/rollout_s` (prefill + decode, until the lengths reach the host),
`perf/rollout_tokens_per_s` (response tokens / that time), `rollout/decode_steps`,
`rollout/slots` (rows decoded per step at the start; the refill engine shrinks them in the tail),
`rollout/slot_utilization` (response tokens / Σ rows × decode steps: the share of decoded rows
that were a live sequence), `rollout/response_len_p50`,
`_p90`, `_max`, and `rollout/finish_stop_frac` / `rollout/finish_length_frac`; the refill engine's pool:
`rollout/preemptions`, `rollout/recomputed_tokens` (tokens decoded again after a preemption),
`rollout/pages` (per data-parallel group), `rollout/pages_peak` and `rollout/pages_free_after`.
"""

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import distributed
from vapo_jax.kinds import RolloutEngine
from vapo_jax.models import paged_attention, sharding
from vapo_jax.rollout import common, static
from vapo_jax.rollout.refill import engine as refill


class Engine(NamedTuple):
  """Which engine decodes and how (static: a change compiles new programs)."""

  kind: RolloutEngine = "refill"
  slots: int = 0  # refill: decode slots (rows); 0 or ≥ the sequences of a call: the static engine runs.
  steps_per_call: int = 256  # refill: decode steps on the device per host call, at most.
  # refill: in the tail (queue empty), halve the slots while at most half are live, down to this many
  # (a multiple of the data-parallel devices); 0: never.
  min_slots: int = 1
  # refill: queues of sequences, each with its own share of the slots, prompts and pages (the data-parallel
  # groups of the rollout layout: a refill never reads another group's prompts or pages); `sample` uses the
  # largest number dividing this, the prompts and the slots.
  queues: int = 1
  prompts_per_round: int | None = None  # static: generate in rounds of this many prompts (None: one).
  decode_block: int | None = None  # static: KV-cache slots per block of decode attention (0: all; None: per platform).
  # refill: pages of the KV cache's pool per queue; 0: as many as the slots hold with every response at the cap
  # (nothing is ever preempted).
  pages: int = 0
  page_tokens: int = 16  # refill: tokens per page.
  block_pages: int | None = None  # refill: pages read per block of paged attention (None: per platform).
  attention: str | None = None  # refill: paged attention (paged_attention.IMPLEMENTATIONS; None: per platform).
  pages_given: bool = False  # refill: `pages` is rollout.pages as set (else kv_cache_budget_gib's): what errors name.


def engine_for(rollout_config, model_cfg, *, sequences: int, prompt_tokens: int, dtype, devices: int,
               prompts: int | None = None) -> Engine:
  """The `Engine` of a `RolloutConfig` for a call of `sequences` sequences of `prompt_tokens`-token
  (bucketed) prompts split over `devices` data-parallel groups (each of `rollout.tensor_parallel`
  chips, which split the KV cache by heads), one queue per group, its slots and pages per group from
  `common.page_pool`. `prompts`: the call's prompts (default: `sequences` / `rollout.samples_per_prompt`; the
  held-out evaluation samples another number per problem)."""
  r = rollout_config
  if r.engine == "static":
    return Engine(kind="static", prompts_per_round=r.prompts_per_generation, decode_block=r.decode_block)
  prompts = prompts or -(-sequences // r.samples_per_prompt)
  pool = common.page_pool(model_cfg, r, sequences=sequences, prompts=prompts,
                          prompt_tokens=prompt_tokens, dtype=dtype, devices=devices)
  return Engine(kind="refill", slots=pool.slots, steps_per_call=r.decode_steps_per_call,
                min_slots=devices if r.shrink_slots else 0, queues=devices, pages=pool.pages,
                page_tokens=pool.page_tokens, pages_given=bool(r.pages))


def rollout_metrics(lengths: np.ndarray, finish_reason: np.ndarray, *, seconds: float, decode_steps: int,
                    rows: int, row_steps: int) -> dict[str, float]:
  """The metrics of one rollout (see the module docstring); `row_steps` = Σ rows × decode steps."""
  lengths, finish_reason = np.asarray(lengths, np.float64), np.asarray(finish_reason)
  tokens = float(lengths.sum())
  return {"time/rollout_s": seconds, "perf/rollout_tokens_per_s": tokens / max(seconds, 1e-9),
          "rollout/decode_steps": float(decode_steps), "rollout/slots": float(rows),
          "rollout/slot_utilization": tokens / max(row_steps, 1),
          "rollout/response_len_p50": float(np.percentile(lengths, 50)),
          "rollout/response_len_p90": float(np.percentile(lengths, 90)),
          "rollout/response_len_max": float(lengths.max()),
          "rollout/finish_stop_frac": float(np.mean(finish_reason == common.FINISH_STOP)),
          "rollout/finish_length_frac": float(np.mean(finish_reason == common.FINISH_LENGTH))}


def sample(model, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key: jax.Array, *,
           sampling: common.Sampling, samples_per_prompt: int, engine: Engine = Engine(), pad_id: int = 0,
           cache_dtype=jnp.float32, jit: Callable = jax.jit, place: Callable | None = None,
           length_limits: np.ndarray | None = None) -> tuple[common.Rollout, dict[str, float]]:
  """`samples_per_prompt` responses for each left-padded prompt (`common.pad_prompts`) with `engine`.

  Returns the `Rollout` (device arrays; row n = p·G + g is sequence n of `key`) and its metrics.
  `jit` builds the programs (the trainer's `Steps.jit` binds its mesh and sharding rules);
  `place` puts host arrays on the devices (the trainer's `Steps.place`; default: the default
  device). `length_limits` `[P·G]` in [1, max_new_tokens] ends sequence n at its own length
  (finish reason "length"); the benchmark forces a length distribution with it.
  """
  place = place or (lambda tree: jax.tree.map(jnp.asarray, tree))
  prompts, group = prompt_tokens.shape[0], samples_per_prompt
  sequences = prompts * group
  limits = None if length_limits is None else np.asarray(length_limits, np.int32)
  start = time.perf_counter()
  prompt_lengths = np.sum(prompt_mask, axis=-1)
  refilled = refill_settings(engine, prompts=prompts, group=group, prompt_tokens=prompt_tokens.shape[1],
                             max_new_tokens=sampling.max_new_tokens, head_dim=model.cfg.head_dim,
                             prompt_lengths=prompt_lengths)
  figures = {}
  if refilled:
    out, decode_steps, row_steps, figures = refill.generate_refill(
        model, *place((prompt_tokens, prompt_mask)), key, sampling=sampling, samples_per_prompt=group,
        steps_per_call=engine.steps_per_call, pad_id=pad_id, cache_dtype=cache_dtype, min_slots=engine.min_slots,
        jit=jit, length_limits=None if limits is None else place(limits), prompt_lengths=prompt_lengths, **refilled)
    rows = refilled["slots"]
  else:
    fn = static.make_generate(sampling=sampling, samples_per_prompt=group, pad_id=pad_id, cache_dtype=cache_dtype,
                               decode_block=engine.decode_block, jit=jit)
    per_round = min(engine.prompts_per_round or prompts, prompts) if engine.kind == "static" else prompts
    parts = []
    for first in range(0, prompts, per_round):
      seqs = slice(first * group, (first + per_round) * group)
      tokens, mask = place((prompt_tokens[first:first + per_round], prompt_mask[first:first + per_round]))
      # The first round's offset is the program's constant 0; later ones are placed (no implicit transfer).
      offset = () if first == 0 else (place(np.asarray(first * group, np.int32)),)
      parts.append(fn(model, tokens, mask, key, *offset) if limits is None else
                   fn(model, tokens, mask, key, *(offset or (0,)), place(limits[seqs])))
    out = parts[0] if len(parts) == 1 else common.Rollout(*(jnp.concatenate(fields) for fields in zip(*parts)))
    rows = per_round * group
  lengths, finish = distributed.to_host((out.response_lengths, out.finish_reason))  # Waits for the rollout.
  seconds = time.perf_counter() - start
  if not refilled:  # Each round runs until its longest response ends.
    rounds = [lengths[i:i + rows] for i in range(0, sequences, rows)]
    decode_steps, row_steps = sum(int(r.max()) for r in rounds), sum(int(r.max()) * len(r) for r in rounds)
  return out, rollout_metrics(lengths, finish, seconds=seconds, decode_steps=decode_steps, rows=rows,
                              row_steps=row_steps) | figures


def refills(engine: Engine, *, prompts: int, group: int, prompt_tokens: int, max_new_tokens: int) -> bool:
  """Whether `sample` runs the refill engine for a call of `prompts` × `group` sequences: a refill engine with
  slots, unless every sequence has a slot and its pool holds them all at the cap (the static batch, which runs
  instead: the same tokens)."""
  sequences = prompts * group
  if engine.kind != "refill" or engine.slots <= 0:
    return False
  if engine.slots < sequences:
    return True
  queues = math.gcd(engine.queues, prompts)
  needed = (prompts // queues * -(-prompt_tokens // engine.page_tokens)
            + sequences // queues * common.sequence_pages(max_new_tokens, engine.page_tokens))
  return 0 < engine.pages * engine.queues // queues < needed


def refill_settings(engine: Engine, *, prompts: int, group: int, prompt_tokens: int, max_new_tokens: int,
                    head_dim: int, platform: str | None = None, prompt_lengths=None,
                    budgeted: bool = False) -> dict | None:
  """What `sample` runs for a call of `prompts` × `group` sequences of `prompt_tokens`-token (bucketed) prompts:
  None for the static engine; for the refill engine its slots, queues (the most dividing `engine.queues`, the
  prompts, the slots and `engine.min_slots`) and `paged_settings`. Raises `MemoryError` naming the setting to
  change, and a value that works, where slots do not split over the data-parallel groups or a queue's pool
  cannot hold its prompts (`prompt_lengths` `[P]` real tokens each; by default every prompt at the bucket) and
  one whole sequence (`common.check_pool`): the start-up check calls it for each rollout of the run before the
  first step. `budgeted`: a partial rollout's round (`rollout/partial.py`), which only the refill engine runs."""
  if not budgeted and not refills(engine, prompts=prompts, group=group, prompt_tokens=prompt_tokens,
                                  max_new_tokens=max_new_tokens):
    return None
  if engine.slots % engine.queues:
    raise MemoryError(f"rollout.slots={engine.slots} does not split over the {engine.queues} data-parallel groups "
                      f"(each decodes its own slots from its own pages): set rollout.slots="
                      f"{-(-engine.slots // engine.queues) * engine.queues}, a multiple of {engine.queues}")
  queues = math.gcd(engine.queues, prompts, engine.slots, engine.min_slots)
  paged = paged_settings(engine, queues=queues, prompts=prompts, prompt_tokens=prompt_tokens,
                         max_new_tokens=max_new_tokens, head_dim=head_dim, platform=platform)
  tg = paged["page_tokens"]
  lengths = np.full(prompts, prompt_tokens) if prompt_lengths is None else prompt_lengths
  common.check_pool(pages=paged["pages"], prompts=prompts // queues, max_new_tokens=max_new_tokens, page_tokens=tg,
                    held=common.most_prompt_pages(lengths, queues=queues, page_tokens=tg), given=engine.pages_given)
  return dict(slots=min(engine.slots, -(-prompts * group // queues) * queues), queues=queues, **paged)


def paged_settings(engine: Engine, *, queues: int, prompts: int, prompt_tokens: int, max_new_tokens: int,
                   head_dim: int, platform: str | None = None) -> dict:
  """The paged refill engine's settings for a call of `prompts` prompts in `queues` queues: its pages per queue
  (`engine.pages`; with fewer queues than `engine.queues`, a queue no longer has devices of its own and the
  pool is replicated, so each holds `engine.pages` / queues; without pages given, as many as the slots hold
  with every response at the cap), page size, block and attention (by default `platform`'s: the one traced
  for, `sharding.platform()`)."""
  page_tokens = engine.page_tokens
  if engine.pages:
    pages = engine.pages if queues == engine.queues else engine.pages // queues
  else:
    pages = (prompts // queues) * -(-prompt_tokens // page_tokens) + (engine.slots // queues) * common.sequence_pages(
        max_new_tokens, page_tokens)
  platform = platform or sharding.platform()
  return dict(pages=pages, page_tokens=page_tokens,
              block_pages=engine.block_pages or paged_attention.default_block_pages(page_tokens, platform),
              implementation=engine.attention or paged_attention.default_implementation(
                  platform, head_dim=head_dim, page_tokens=page_tokens))
