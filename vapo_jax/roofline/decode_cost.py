"""The decode loop's cost per chip, step by step: the engine's replay (`rollout/refill/replay.py`) priced with
the compiled decode step.

Itemised per decode step and chip (`DecodeCost`, means over the steps):

  weights     the rollout copy of the policy, read once per step: every parameter but the input embedding (a
              gather of the rows' token ids), split over the `rollout.tensor_parallel` chips of a group (int8
              layer kernels, `rollout.weight_dtype`: their bytes and scales')
  KV read     the cached tokens attention reads (the schedule's `read_tokens`: the paged engine each live row's
              own tokens in whole blocks; the contiguous engine every row up to the longest live row's slot)
              × a token's keys and values at every layer per chip
  KV written  one token per live row (and the prompt a refill copies: the paged engine one page, the
              contiguous engine the prompt bucket's slots)
  the rest    the compiled decode step's other HBM bytes (activations, logits, the sampler, page tables, the
              pool's in-place write as the tokens it writes), in proportion to the rows decoded

A step's bytes are walked from the compiled program's HLO (`hlo_walk`: one iteration of the decode loop, the
layer loop's body times its trips, a buffer updated in place as its update): the rest is that step's bytes
less the weights and the cache reads the walk counted (the gather's one block per row per layer; the Pallas
kernel's operands are set apart, since it reads only each row's blocks), and the reads are counted here once,
from the schedule. The kernel reads at the bandwidth of the TensorCores its grid runs on (`read_cores`: both
of a v5p chip with `megacore_mode`, else one). FLOPs: `cost_analysis`'s (the matmuls, the sampler) in
proportion to the rows, plus attention from its definition, 4·N·H per cached token read per layer.
Collectives: the decode loop's per-step bytes (`aot.DecodeTraffic`, nested loops by their trips), in
proportion to the rows. A step costs the slower of its FLOPs at the chip's peak and its bytes at the HBM
bandwidth, plus its collectives at the ICI bandwidth; `floor_s` leaves the rest out (a bound from below). The
step is the decode loop's plain iteration (`hlo_walk.Loop.plain`: its optional branches, a preemption and a
prefill chunk, skipped). The prompts' prefill runs in chunks inside the loop (`refill/prefill.py`): each step
that ran one (the replay's `prefill_tokens`) adds the slower of its tokens' FLOPs (2 per parameter per token)
and a read of the weights, and every prompt prefilled its causal attention at peak (`_prefill`).
"""

from typing import NamedTuple

import numpy as np

from vapo_jax.models import decode_attention
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.rollout import common, partial_replay
from vapo_jax.rollout.refill import replay
from vapo_jax.roofline import profiles


class DecodeCost(NamedTuple):
  """One rollout's decode loop on one chip (its queue's schedule)."""

  engine: str  # "paged", "contiguous" or "static".
  slots: int  # Rows at the start.
  steps: int
  weights: float  # Bytes per step (means over the steps, per chip).
  kv_read: float
  kv_written: float
  rest: float
  flops: float  # In all.
  bytes: float  # In all.
  collective_bytes: float  # In all.
  seconds: float  # The steps at the roofline.
  live: float  # Mean live rows per step.
  preemptions: int
  recomputed_tokens: int
  peak_pages: int
  floor_s: float  # `seconds` with the rest left out: the bound from below.
  cycles: float = 0.0  # The compiler's estimated cycles of the steps (in proportion to the rows).
  prefill_s: float = 0.0  # The prefill chunks run inside the loop (in `seconds`).
  prefills: int = 0  # Prompts prefilled (each queue's, given back and prefilled again included).
  chunks: int = 0  # Prefill chunks run (lanes × steps).


class Prices(NamedTuple):
  """What one step of the compiled decode loop costs per chip at `rows` rows, beside its KV traffic."""

  rows: int
  weights: float  # Bytes.
  rest: float  # Bytes (activations, logits, sampler...).
  flops: float  # cost_analysis's, without attention.
  collectives: float  # Bytes per step.
  token_bytes: float  # A cached token's keys and values at every layer, per chip.
  attention_flops: float  # Per cached token read (every layer), per chip.
  cycles: float = 0.0  # The compiler's estimated cycles of one step (its kernels count none).
  read_cores: int = 1  # Of the chip's TensorCores, how many read the cache (a kernel without megacore: one).
  prefill_flops: float = 0.0  # Per prompt token prefilled (without attention), per chip.
  prefill_attention: float = 0.0  # Of a prompt of T tokens, × T² (causal, forward), per chip.


def prices(report, program, *, xla_kv_tokens: float, read_cores: int = 1) -> Prices:
  """The compiled decode step's prices per chip (module docstring). `xla_kv_tokens`: the cached tokens its
  walked bytes count (one block per row per layer for `attend_one` and the gather; 0 for the kernel, whose
  operands are set apart); `read_cores`: the TensorCores the cache is read with."""
  c, cfg = report.config, report.architecture
  t, dtype = c.rollout.tensor_parallel, np.dtype(c.model.dtype)
  embedded = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size  # Gathered, not read whole.
  weights = (report.decode_weight_bytes - embedded * dtype.itemsize) / t
  token_bytes = KVCache.bytes_per_token(cfg, np.dtype(c.cache_dtype)) / t  # int8: its scales included.
  loop = program.walked.loop(common.DECODE_LOOP) if program.walked is not None else None
  one = None if loop is None else (loop.plain or loop.iteration)  # A step without its optional branches.
  step = program.bytes_accessed if one is None else one.bytes - one.kernel_bytes
  rest = max(step - weights - xla_kv_tokens * token_bytes, 0.0)
  flops = program.flops if one is None else one.flops
  return Prices(report.decode_rows, weights, rest, flops, program.decode.bytes if program.decode else 0.0,
                token_bytes, 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers / t,
                one.cycles if one is not None else 0.0, read_cores,
                2.0 * (report.parameters[0] - embedded) / t, 2.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers / t)


def cost(load: replay.Load, p: Prices, chip, *, engine: str, slots: int, copied_tokens: float) -> DecodeCost:
  """The schedule `load` at prices `p` on `chip` (`topologies.Chip`); `copied_tokens`: tokens a refill copies
  in all (written, and read)."""
  scale = load.rows / p.rows
  kv_read = load.read_tokens * p.token_bytes
  kv_written = load.live * p.token_bytes
  rest = p.rest * scale
  step_bytes = p.weights + kv_read + kv_written + rest
  step_flops = p.flops * scale + p.attention_flops * load.read_tokens
  collectives = p.collectives * scale
  slower = chip.cores / p.read_cores - 1  # A cache read on fewer cores than the chip's takes that much longer.
  time = lambda b: (np.maximum(step_flops / chip.peak_flops, (b + slower * kv_read) / chip.hbm_bandwidth)
                    + collectives / chip.ici_bandwidth)
  seconds, floor = time(step_bytes), time(step_bytes - rest)
  copy = 2 * copied_tokens * p.token_bytes
  prefill_flops, prefill_bytes, prefill_s = _prefill(load, p, chip)
  steps = max(load.steps, 1)
  return DecodeCost(engine, slots, load.steps, p.weights, (kv_read.sum() + copy / 2) / steps,
                    (kv_written.sum() + copy / 2) / steps, rest.sum() / steps,
                    float(step_flops.sum() + prefill_flops),
                    float(step_bytes.sum() + copy + prefill_bytes), float(collectives.sum()),
                    float(seconds.sum() + copy / chip.hbm_bandwidth + prefill_s),
                    float(load.live.mean()) if load.steps else 0.0,
                    load.preemptions, load.recomputed_tokens, load.peak_pages,
                    float(floor.sum() + copy / chip.hbm_bandwidth + prefill_s),
                    float(p.cycles * np.sum(scale)),
                    prefill_s, load.prefills, int(load.chunks.sum()) if load.chunks is not None else 0)


def _prefill(load: replay.Load, p: Prices, chip) -> tuple[float, float, float]:
  """(FLOPs, bytes, seconds) per chip of the prefill chunks `load` ran: each step with a chunk, its tokens'
  FLOPs against one read of the weights, the slower of the two; and every prompt prefilled, its causal
  attention (2·N·H·T²·L) at peak."""
  if load.prefill_tokens is None or not load.prefill_tokens.any():
    return 0.0, 0.0, 0.0
  linear = load.prefill_tokens.astype(np.float64) * p.prefill_flops
  ran = load.prefill_tokens > 0
  attention = p.prefill_attention * float(np.sum(np.asarray(load.prefill_lengths, np.float64) ** 2))
  seconds = np.maximum(linear / chip.peak_flops, p.weights / chip.hbm_bandwidth) * ran
  return float(linear.sum() + attention), float(p.weights * ran.sum()), float(seconds.sum() + attention /
                                                                              chip.peak_flops)


def queue_share(profile: profiles.Profile, queues: int) -> tuple[np.ndarray, np.ndarray]:
  """Queue 0's sequences and prompts (every queue serves an equal contiguous share; the profile's lengths are
  drawn independently, so queue 0 stands for each)."""
  return profile.responses[:len(profile.responses) // queues], profile.prompts[:len(profile.prompts) // queues]


def contiguous_slots(report, pool_bytes: float) -> int:
  """Slots per queue the contiguous engine holds in `pool_bytes` per chip: each prompt bucket + cap tokens."""
  c = report.config
  per_slot = common.cache_bytes(report.architecture, batch=1, prompt_tokens=common.prompt_bucket(
      c.rollout.max_prompt_tokens), max_response_tokens=c.rollout.max_response_tokens, dtype=c.cache_dtype,
                                tensor=c.rollout.tensor_parallel)
  return max(1, int(pool_bytes // per_slot))


def contiguous(report, profile, p: Prices, chip, *, slots: int, queues: int, min_slots: int) -> DecodeCost:
  """The contiguous refill engine (`benchmarks/contiguous_refill.py`) on `profile`: `slots` rows per queue
  reading up to the longest live row's slot in blocks of `attend_one`'s TPU block; each refill copies the
  prompt bucket."""
  c = report.config
  responses, prompts = queue_share(profile, queues)
  tp = common.prompt_bucket(c.rollout.max_prompt_tokens)
  load = replay.simulate(responses, prompts, samples_per_prompt=c.rollout.samples_per_prompt, slots=slots,
                         min_slots=min_slots,
                           prompt_slots=tp, block=decode_attention.default_block("tpu"))
  return cost(load, p, chip, engine="contiguous", slots=slots * queues, copied_tokens=len(responses) * tp)


def paged(report, profile, p: Prices, chip, *, plan) -> DecodeCost:
  """The paged refill engine (`rollout/refill/engine.py`) on `profile` as its `RolloutPlan` runs it: a queue's
  slots, pages, prefill lanes and chunks, each live row reading its own tokens; each refill copies one page
  (the prompt's last, partly filled one)."""
  responses, prompts = queue_share(profile, plan.queues)
  load = replay.simulate(responses, prompts, samples_per_prompt=report.config.rollout.samples_per_prompt,
                         slots=plan.slots // plan.queues, min_slots=plan.min_slots // plan.queues,
                         paged=paged_settings(plan))
  return cost(load, p, chip, engine="paged", slots=plan.slots,
              copied_tokens=len(responses) * plan.page_tokens)


def paged_settings(plan) -> replay.Paged:
  """A refill plan's queue as the replay takes it."""
  return replay.Paged(plan.queue_pages, plan.page_tokens, plan.block_pages, plan.lanes, plan.prefill_chunk)


def partial(report, profile, p: Prices, chip, *, plan, budget: int, max_staleness: int):
  """The paged refill engine under partial rollouts (`partial_replay.partial_rounds`: rounds of `budget`
  decode steps as the round's `plan` runs them, the carried sequences prefilled again each round): (the
  decode's cost per RL step, the replay)."""
  rounds = partial_replay.partial_rounds(profile.responses, profile.prompts,
                                         samples_per_prompt=report.config.rollout.samples_per_prompt,
                                         plan=plan, budget=budget, max_staleness=max_staleness)
  total = cost(rounds.load, p, chip, engine="paged", slots=plan.slots,
               copied_tokens=len(rounds.prefill) * plan.page_tokens)
  per = lambda x: x / rounds.steps
  return total._replace(
      steps=round(per(total.steps)), flops=per(total.flops), bytes=per(total.bytes),
      collective_bytes=per(total.collective_bytes), seconds=per(total.seconds), floor_s=per(total.floor_s),
      cycles=per(total.cycles), preemptions=round(per(total.preemptions)),
      recomputed_tokens=round(per(total.recomputed_tokens)), prefill_s=per(total.prefill_s),
      prefills=round(per(total.prefills)), chunks=round(per(total.chunks))), rounds


def format_costs(costs: list[tuple[str, DecodeCost]]) -> list[str]:
  """The itemised decode bytes per chip and step, one line per (profile, engine); "no rest": the decode's
  seconds with the rest left out (module docstring: the rest is an upper bound, so the two bracket the
  decode)."""
  lines = [f"  {'decode, per chip and step':<38}{'slots':>7}{'steps':>8}{'live':>7}{'weights':>9}{'KV read':>9}"
           f"{'KV wrt':>8}{'rest':>7}{'GB/step':>9}{'decode s':>10}{'no rest':>9}{'preempt':>9}"]
  for name, d in costs:
    total = d.weights + d.kv_read + d.kv_written + d.rest
    lines.append(f"  {name:<38}{d.slots:>7}{d.steps:>8}{d.live:>7.0f}{d.weights / 1e9:>9.2f}{d.kv_read / 1e9:>9.2f}"
                 f"{d.kv_written / 1e9:>8.3f}{d.rest / 1e9:>7.2f}{total / 1e9:>9.2f}{d.seconds:>10.1f}{d.floor_s:>9.1f}"
                 f"{d.preemptions:>9}")
  return lines
