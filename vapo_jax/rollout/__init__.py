"""Rollout: G sampled responses for each of P prompts with the model being trained, on the devices.

  plan = rollout.plan_rollout(config.rollout, model_cfg, prompts=P, samples_per_prompt=G, prompt_tokens=Tp,
                              dtype=cache_dtype, devices=data-parallel devices)   # layout.data_devices
  out, metrics = rollout.sample(model, prompt_tokens, prompt_mask, key, sampling=..., plan=plan, pad_id=...,
                                cache_dtype=..., jit=..., place=...)

The package, one module a part:
  next_token the next token from logits: temperature, top-k and top-p by threshold bisection (sort: oracle)
  common    what both engines share: `Sampling`, the `Rollout`, prompt buckets, KV-cache sizing,
            the prefill
  plan      the rollout's plan (`RolloutPlan`): the engine and its sizes for one call, decided once
  static    the static engine: every sequence of a round in one batch (the reference)
  refill    the refill engine (a folder): decode slots over a paged KV cache, refilled as sequences end,
            prompts taking pages when their samples are about to run and prefilled in chunks, preempted and
            restarted when the pages run out; its pages and queues, partial rollouts' calls, and its replay
  partial   partial rollouts: rounds stopped at `rollout.decode_budget`, the unfinished sequences carried over
            (NumPy buffers on the host, saved as checkpoint arrays), complete groups handed to training,
            `rollout.max_staleness` enforced
  partial_replay  partial rollouts' rounds replayed on the host under the round's plan (the roofline's model)
  layout    the rollout layout: the mesh, sharding rules and resharded weights the rollout decodes with
  here      `sample`, a whole rollout's entry point: the configured engine, timed, and its metrics (a partial
            rollout's round enters through `partial.decode_round`)

`sample` runs the plan's engine: the static one (`static.generate_static`, optionally in rounds of prompts) or
the refill one (`refill.engine.generate_refill`, over a paged KV cache); when every sequence has a slot and
the pool holds them all at the cap there is nothing to refill or page, and the plan runs the static engine.
Both sample the same tokens for the same key (sequence n of the call draws from `fold_in(key, n)`), so the
engine is a speed setting, never a change of results.

Metrics (`rollout_metrics`): the `rollout/` keys, `time/rollout_s` and `perf/rollout_tokens_per_s`, each
declared with its meaning in `vapo_jax/metric_keys.py`.
"""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import distributed
from vapo_jax.rollout import common
from vapo_jax.rollout.plan import RolloutPlan, plan_rollout
from vapo_jax.rollout.refill import engine as refill

__all__ = ["RolloutPlan", "plan_rollout", "rollout_metrics", "sample"]


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
           sampling: common.Sampling,
           plan: RolloutPlan, pad_id: int = 0, cache_dtype=jnp.float32, jit: Callable = jax.jit,
           place: Callable | None = None, length_limits: np.ndarray | None = None
           ) -> tuple[common.Rollout, dict[str, float]]:
  """`plan.group` responses for each left-padded prompt (`common.pad_prompts`) with the plan's engine.

  Returns the `Rollout` (device arrays; row n = p·G + g is sequence n of `key`) and its metrics. `jit` builds
  the programs (the trainer's `Steps.jit` binds its mesh and sharding rules); `place` puts every input of the
  programs, the key included, where they run (the trainer's `RolloutLayout.place`; default: the default
  device). `length_limits` `[P·G]` in [1, max_response_tokens] ends sequence n at its own length (finish
  reason "length"); the benchmark forces a length distribution with it.
  """
  place = place or (lambda tree: jax.tree.map(jnp.asarray, tree))
  key = place(key)  # Every input of the programs where they run, the key too (from the training mesh).
  if (prompt_tokens.shape != (plan.prompts, plan.prompt_tokens)
      or sampling.max_response_tokens != plan.max_response_tokens):
    raise ValueError(f"the plan is for {plan.prompts} prompts of {plan.prompt_tokens} tokens and "
                     f"{plan.max_response_tokens}-token responses; the call has prompts "
                     f"{prompt_tokens.shape} and {sampling.max_response_tokens}-token responses")
  prompts, samples_per_prompt, sequences = plan.prompts, plan.samples_per_prompt, plan.sequences
  limits = None if length_limits is None else np.asarray(length_limits, np.int32)
  start = time.perf_counter()
  figures = {}
  if plan.engine == "refill":
    out, decode_steps, row_steps, figures = refill.generate_refill(
        model, *place((prompt_tokens, prompt_mask)), key, plan=plan, sampling=sampling, pad_id=pad_id,
        cache_dtype=cache_dtype, jit=jit, length_limits=None if limits is None else place(limits))
    figures["rollout/queue_pages"] = float(plan.queue_pages)
  else:
    fns = plan.programs(sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, jit=jit)
    parts, per_round = [], plan.prompts_per_round
    for first in range(0, prompts, per_round):
      seqs = slice(first * samples_per_prompt, (first + per_round) * samples_per_prompt)
      tokens, mask = place((prompt_tokens[first:first + per_round], prompt_mask[first:first + per_round]))
      # The first round's offset is the program's constant 0; later ones are placed (no implicit transfer).
      offset = () if first == 0 else (place(np.asarray(first * samples_per_prompt, np.int32)),)
      parts.append(fns(model, tokens, mask, key, *offset) if limits is None else
                   fns(model, tokens, mask, key, *(offset or (0,)), place(limits[seqs])))
    out = parts[0] if len(parts) == 1 else common.Rollout(*(jnp.concatenate(fields) for fields in zip(*parts)))
  lengths, finish = distributed.to_host((out.response_lengths, out.finish_reason))  # Waits for the rollout.
  seconds = time.perf_counter() - start
  if plan.engine == "static":  # Each round runs until its longest response ends.
    rows = plan.decode_rows
    rounds = [lengths[i:i + rows] for i in range(0, sequences, rows)]
    decode_steps, row_steps = sum(int(r.max()) for r in rounds), sum(int(r.max()) * len(r) for r in rounds)
  return out, rollout_metrics(lengths, finish, seconds=seconds, decode_steps=decode_steps,
                              rows=plan.decode_rows, row_steps=row_steps) | figures
