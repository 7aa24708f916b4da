"""A roofline estimate of one RL step from a compile report: each phase's FLOPs and HBM bytes per chip at
the chip's peak bfloat16 FLOP/s and HBM bandwidth, plus the bytes its collectives move at the chip's
inter-chip (ICI) bandwidth. Scoring and the update are priced instruction by instruction, each at the slower
of its FLOPs and its bytes, one after another (a TensorCore runs one fusion at a time, so a matmul's compute
hides none of the next copy's bytes: `Estimate.instructions_s`), their Pallas kernels at attention's FLOPs;
the slower of the phase's sums (`overlapped_s`) is printed beside it, and so is the step at the compiler's
own cycles (`compiler_s`, `StepEstimate.compiler_mfu`): a target holds where both reach it. Other phases
take the slower of their sums (`topologies.CHIPS`: JAX's chip table, v5p
459 TFLOP/s and 2.46e12 B/s over two TensorCores; 600 GB/s ICI into a chip).

  report = step.every_layer(report, twice)   # scanned layers: `twice` compiled with model.scan_unroll=2
  estimate = step.estimate(report, profile)  # needs a target with a known chip
  print(text.format_estimate(estimate, report.target.device_kind))

HBM bytes and the matmuls' FLOPs are walked from each compiled program's HLO (`hlo_walk`): every loop body
times its trip count (read from its condition where XLA prints none), a buffer updated in place as the update
it writes, a gather as its rows, VMEM as nothing. The rollout's decode loop runs until its rows finish, so
the walk gives one decode step; `decode_cost` prices the steps one by one on the engine's replay of the
profile's lengths (`rollout/refill/replay.py`, under the report's `RolloutPlan`), the cache's reads from the
replay (the Pallas kernel's operands set apart: it reads only each row's own blocks), at the bandwidth of the
TensorCores the kernel runs on (`paged_attention.megacore_mode`). Partial rollouts (`estimate(..., budget=)`)
are priced in steady state: the replay runs RL steps of budgeted rounds, each under the round's own plan, with
the engine's own carry (`partial_replay.partial_rounds`). The prompts (and a round's carried tokens) are
prefilled in chunks inside the decode loop, priced from the replay's chunks (`decode_cost`).
Scoring's and the update's loops over micro-batches are charged for the micro-batches that run on the
profile's lengths (`micro_batch_cost.trips`: ⌈rows / m⌉ per pass, the compiled ones past it skipped).
Attention runs in Pallas kernels (splash, the paged kernel) that the walk cannot see into, so it is added: splash's
in scoring and the update as the block pairs it visits on the profile's packed rows times the products its compiled
calls run per pair (`attention_cost`: the backward's two kernels 7 against the forward's 2, the forward twice where
the remat policy keeps no attention residuals); without splash calls, from the definition, per sequence of T tokens
2·N·H·T²·L FLOPs forward, backward twice that, remat one more forward; a decode step 4·N·H per cached token read.
The step's MFU counts the definition's FLOPs (model FLOPs), never the kernel's. Collectives from the HLO
(`hlo.collectives`): each moves the larger of its operands and result per chip, times the trips of the loops around
it (the layer scan's L; micro-batch loops: those that run); the decode loop's per step (`aot.DecodeTraffic`) times
the decode steps. Their time adds to the phase's (no overlap with compute assumed, and no latency per collective:
bytes over bandwidth only). The compiler's own estimate, its `estimated_cycles` summed the same way at the core's
clock, is printed beside the bounds (uncalibrated; kernels and gathers carry none).

A program the walk cannot price (no HLO, or no micro-batch loop found: `walked_through`) falls back on
`cost_analysis`, which counts a loop body once: scanned decoder layers are then counted by `every_layer`
from a second compile with two layers per iteration (`model.scan_unroll=2`; r1 + (L − 1)(r2 − r1), exact
when 2 divides L), and the log-probs' vocabulary blocks it leaves out are added from the definition.

Model FLOPs for the MFU (useful work, remat not counted): 2·params per generated or scored token,
6·params per trained token, plus attention by the same formula; params without the input embedding (a
lookup).
"""

import dataclasses

import numpy as np

from vapo_jax.memory import hlo_walk
from vapo_jax.models import decode_attention, logprobs, paged_attention
from vapo_jax.rollout import common
from vapo_jax.rollout import plan as plan_lib
from vapo_jax.roofline import attention_cost, decode_cost, micro_batch_cost, profiles
from vapo_jax.roofline.estimates import Estimate, StepEstimate
from vapo_jax.train import packed_batch

MFU_FLOOR = 0.40  # Below it, the estimate says what bounds the update.


def every_layer(scanned, twice):
  """`scanned` (a report of scanned layers) with each program's FLOPs and bytes counted for all L layers:
  r1 + (L − 1)(r2 − r1), r2 the same program's in `twice` (compiled with `model.scan_unroll=2`); programs
  not in `twice` keep theirs. Exact when 2 divides L (see the module docstring)."""
  layers = scanned.architecture.num_layers
  if layers % 2:
    raise ValueError("every_layer needs an even number of layers (unroll 2 leaves one outside the loop), "
                     f"got {layers}")
  names = {p.name: p for phase in twice.phases for p in phase.programs}

  def count(p):
    q = names.get(p.name)
    return p if q is None else p._replace(flops=p.flops + (layers - 1) * (q.flops - p.flops),
                                          bytes_accessed=p.bytes_accessed + (layers - 1) * (q.bytes_accessed
                                                                                            - p.bytes_accessed))
  phases = tuple(dataclasses.replace(phase,
                                     programs=[count(p) for p in phase.programs]) for phase in scanned.phases)
  return dataclasses.replace(scanned, phases=phases)


def walked_through(report) -> bool:
  """Whether every per-step program's FLOPs and bytes come from its walked HLO (loops by their trips), so that
  `every_layer`'s second compile adds nothing: each walked, scoring's and the update's micro-batch loops
  found."""
  programs = [(phase.name, p) for phase in report.phases if phase.name in ("rollout", "scoring", "update")
              for p in phase.programs]
  return bool(programs) and all(p.walked is not None and (name == "rollout" or micro_batch_cost.micro_loops(p))
                                for name, p in programs)


def twice_unrolled(config):
  """`config` with two decoder layers per iteration of the layer scan: `every_layer`'s second compile."""
  return dataclasses.replace(config, model=dataclasses.replace(config.model, scan_unroll=2))


def _attention_forward(cfg, tokens) -> float:
  """Causal self-attention FLOPs of sequences of `tokens` tokens (an int or `[n]`), forward, every layer."""
  return float(2.0 * cfg.num_heads * cfg.head_dim * np.sum(np.asarray(tokens,
                                                                      np.float64) ** 2) * cfg.num_layers)


def read_cores(report, chip) -> tuple[int, str | None]:
  """(TensorCores the refill engine's cache reads run on, the paged kernel's `megacore_mode`): XLA's reads
  (the gather, the contiguous engine) use every core; the kernel both of a megacore chip, else one."""
  if report.plan is None or report.plan.attention != "kernel":
    return chip.cores, None
  rows = report.decode_rows // report.plan.decode_groups
  mode = paged_attention.megacore_mode(report.target.device_kind, rows,
                                       report.architecture.num_kv_heads // report.config.rollout.tensor_parallel)
  return (chip.cores if mode else 1), mode


def decode(report, program, profile: profiles.Profile, engine: str, chip) -> decode_cost.DecodeCost:
  """The decode loop's cost per chip for `engine` ("paged": the compiled refill engine; "contiguous": the
  contiguous refill engine at the same bytes of KV cache per chip; "static": the compiled static engine)."""
  plan = report.plan
  queues = plan.decode_groups
  if engine == "static":
    p = decode_cost.prices(report, program,
                           xla_kv_tokens=report.decode_rows / queues * decode_attention.default_block(
        report.target.platform), read_cores=chip.cores)
    costs = [decode_cost.contiguous(report, profiles.Profile("", r, profile.prompts), p, chip,
                                    slots=report.decode_rows
                                    // queues, queues=queues, min_slots=0)
             for r in np.split(profile.responses, plan.rounds)]
    return costs[0]._replace(engine="static", steps=sum(x.steps for x in costs),
                             seconds=sum(x.seconds for x in costs),
                             flops=sum(x.flops for x in costs), bytes=sum(x.bytes for x in costs),
                             cycles=sum(x.cycles for x in costs),
                             collective_bytes=sum(x.collective_bytes for x in costs))
  p = _paged_prices(report, program, chip)
  if engine == "paged":
    return decode_cost.paged(report, profile, p, chip, plan=plan)
  slots = decode_cost.contiguous_slots(report, plan.queue_pages * plan.page_tokens * p.token_bytes)
  return decode_cost.contiguous(report, profile, p, chip, slots=slots, queues=queues,
                                min_slots=plan.min_slots // queues)


def _paged_prices(report, program, chip) -> decode_cost.Prices:
  """The compiled refill engine's decode step, per queue's rows."""
  queues, plan = report.plan.decode_groups, report.plan
  counted = 0.0 if plan.attention == "kernel" else plan.page_tokens * plan.block_pages
  p = decode_cost.prices(report, program, xla_kv_tokens=report.decode_rows / queues * counted,
                         read_cores=read_cores(report, chip)[0])
  return p._replace(rows=report.decode_rows // queues)


def decode_partial(report, program, profile: profiles.Profile, chip, budget: tuple[int, int]):
  """The paged decode under partial rollouts, `budget` = (decode steps a round, max_staleness), each round as
  its own plan runs it (the compiled one, `report.round`, else `plan.plan_round` of the budget): (its cost per
  RL step, the replay `partial_replay.PartialLoad`)."""
  c = report.config
  r = dataclasses.replace(c.rollout, decode_budget=budget[0], max_staleness=budget[1])
  round_plan = report.round or plan_lib.plan_round(r, report.architecture, dtype=np.dtype(c.cache_dtype),
                                                   devices=report.plan.devices,
                                                   platform=report.target.platform)
  return decode_cost.partial(report, profile, _paged_prices(report, program, chip), chip, plan=round_plan,
                             budget=budget[0], max_staleness=budget[1])


def partial_budget(config) -> tuple[int, int]:
  """(decode steps a round, max_staleness) of the roofline's partial rollouts: `rollout.decode_budget` and
  `rollout.max_staleness` when set; else 0.3 of the cap in whole pages of 128 (the log-normal profile's mean),
  and a staleness one version above the least that lets a response at the cap finish: a sequence that starts
  late in a round needs a round more."""
  r = config.rollout
  if r.decode_budget:
    return r.decode_budget, r.max_staleness
  budget = max(128, round(0.3 * r.max_response_tokens / 128) * 128)
  return budget, -(-r.max_response_tokens // budget)


def _head_flops(report, chips: int, tokens: float) -> float:
  """FLOPs per chip, per pass over `tokens` tokens, of the log-probs' vocabulary blocks that `cost_analysis`
  leaves out: it counts one block of the `lax.scan` over ⌈V / Vb⌉ (`models/logprobs.py`), so (1 − 1/blocks)
  of the output projection's 2·V·D per token is added (forward; its backward twice that)."""
  c, cfg = report.config, report.architecture
  row = common.prompt_bucket(c.rollout.max_prompt_tokens) + c.rollout.max_response_tokens
  blocks = -(-cfg.vocab_size // logprobs.blocks(cfg.vocab_size, row, c.model.logits_chunk))
  return (1 - 1 / blocks) * 2.0 * cfg.vocab_size * cfg.hidden_size * tokens / chips


def _model_flops(report, profile: profiles.Profile) -> dict[str, float]:
  """Useful FLOPs of each phase on all chips under `profile` (module docstring); the input embedding is a
  lookup, not a matmul, so its parameters count none (the output projection does, unless it is the
  embedding)."""
  c, cfg = report.config, report.architecture
  tokens = micro_batch_cost.sequence_tokens(report, profile)
  critic_used = c.algo.uses_critic
  models = 1 + critic_used + (c.algo.kl_coef > 0)
  embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  actor, critic = (count - embedding for count in report.parameters)
  attention, total = _attention_forward(cfg, tokens), float(tokens.sum())
  return {"rollout": 2 * actor * float(profile.responses.sum() + profile.prompts.sum()) + attention,
          "scoring": 2 * (actor * (models - critic_used) + critic * critic_used) * total + attention * models,
          "update": (6 * (actor + critic * critic_used) * total + 3 * attention * (1 + critic_used))
          * c.algo.ppo_epochs}


def _phase(report, phase, chips: int, profile: profiles.Profile, engine: str, chip, budget=None):
  """(FLOPs, bytes, collective bytes, compiler cycles, the decode loop's cost or None, the partial rollouts'
  replay or None, the walked programs' instruction groups or None, the walked programs' collective seconds that
  overlap their core's work (at the bound, at the cycles)) of one phase per chip in one RL step; `budget`:
  partial rollouts (`decode_partial`)."""
  c, cfg = report.config, report.architecture
  tokens = micro_batch_cost.sequence_tokens(report, profile)
  models = 1 + c.algo.uses_critic + (c.algo.kl_coef > 0)
  flops = bytes_ = moved = cycles = 0.0
  found, replay, mb, groups, hidden = None, None, micro_batch_cost, None, (0.0, 0.0)
  if budget is not None and phase.name == "rollout":
    found, replay = decode_partial(report, next(p for p in phase.programs if p.decode is not None), profile,
                                   chip, budget)
  for program in phase.programs:
    if program.decode is not None:
      found = found or decode(report, program, profile, engine, chip)
      f, b, m, k = found.flops, found.bytes, found.collective_bytes, found.cycles
    elif phase.name == "rollout":
      f, m = (program.walked.flops if program.walked else program.flops), mb.collective_bytes(program,
                                                                                              unknown=1)
      b, k = (program.walked.bytes, program.walked.cycles) if program.walked else (program.bytes_accessed,
                                                                                   0.0)
      if replay is not None:  # A round's programs but its decode loop (start, finish): each round runs them.
        rounds = replay.rounds / replay.steps
        f, b, m, k = f * rounds, b * rounds, m * rounds, k * rounds
    else:
      trips = mb.trips(report, phase.name, profile)
      calls = c.updates_per_step if phase.name == "update" else 1  # One update program per mini-batch.
      attention = _attention_forward(cfg, tokens) / chips
      attention *= models if phase.name == "scoring" else 4 * (1 + c.algo.uses_critic) * c.algo.ppo_epochs
      if program.walked is not None and mb.micro_loops(program):  # Every matmul walked, the vocabulary blocks too.
        cost = mb.walked(program, trips)
        f, b, k = cost.flops, cost.bytes, cost.cycles
        kernel = attention_cost.flops(report, profile, phase.name, cost.kernels, chips)
        attention = attention if kernel is None else kernel  # What splash computes: the blocks it visits.
        groups = groups or hlo_walk.Cost()
        groups.add(cost)
        hidden = (hidden[0] + cost.hidden_s, hidden[1] + cost.hidden_cycles_s)
        kernels = groups.groups.setdefault("Pallas kernel", [0.0] * 5)
        kernels[1] += attention  # The kernels' FLOPs (the walk sees none): `attention_cost`, else the definition's.
        kernels[4] = max(kernels[4], kernels[1] * chip.hbm_bandwidth / chip.peak_flops)
        m = mb.collective_bytes(program, unknown=trips / calls, run=trips)
        f += attention
      else:
        f, b, k = program.flops * trips, program.bytes_accessed * trips, 0.0
        m = calls * mb.collective_bytes(program, unknown=trips / calls)
        heads = (models - c.algo.uses_critic) if phase.name == "scoring" else 3 * c.algo.ppo_epochs
        f += attention + _head_flops(report, chips, mb.computed_tokens(report, phase.name, trips)) * heads
    flops, bytes_, moved, cycles = flops + f, bytes_ + b, moved + m, cycles + k
  return flops, bytes_, moved, cycles, found, replay, None if groups is None else groups.groups, hidden


def engines(report) -> tuple[str, ...]:
  """The rollout engines an estimate compares: the compiled paged engine and the contiguous one at the same
  KV-cache bytes; or the compiled static engine."""
  return ("paged", "contiguous") if report.refill else ("static",)


def estimate(report, profile: profiles.Profile | None = None, engine: str | None = None,
             budget: tuple[int, int] | None = None) -> StepEstimate:
  """One RL step's phases (rollout, scoring, update; value pretraining and the warm start are not per-step
  work) at the roofline of `report.target`'s chip under `profile` (default: every response at the cap, every
  prompt at the bucket length), the rollout decoded by `engine` (default: the compiled one, `engines`);
  `budget` = (rollout.decode_budget, rollout.max_staleness): the paged engine's partial rollouts, in steady
  state (`partial_replay.partial_rounds`)."""
  chip, chips = report.target.chip, len(report.target.devices)
  c = report.config
  profile = profile or profiles.at_cap(c, np.full(c.rollout.prompts_per_step, common.prompt_bucket(
      c.rollout.max_prompt_tokens)), "every prompt at the bucket length")
  engine = engine or engines(report)[0]
  useful, found, decoded, replay = _model_flops(report, profile), [], None, None
  for phase in (p for p in report.phases if p.name in ("rollout", "scoring", "update")):
    flops, bytes_, moved, cycles, cost, replayed, groups, hidden = _phase(report, phase, chips, profile, engine,
                                                                          chip, budget)
    replay = replay or replayed
    priced = None
    if cost is not None:  # The decode steps one by one (each the slower of the two), the other programs as a whole.
      decoded = cost
      priced = cost.seconds + max((flops - cost.flops) / chip.peak_flops,
                                  (bytes_ - cost.bytes) / chip.hbm_bandwidth) \
          + (moved - cost.collective_bytes) / chip.ici_bandwidth
    if groups is not None:  # (runs, FLOPs, bytes, bound s, cycles s); collectives are priced over ICI.
      groups = {name: (g[0], g[1], g[2], g[4] / chip.hbm_bandwidth, g[3] / chip.clock_hz if chip.clock_hz else 0.0)
                for name, g in groups.items()}
    found.append(Estimate(phase.name, flops, bytes_, flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth,
                          moved, moved / chip.ici_bandwidth, useful[phase.name], priced,
                          cycles / chip.clock_hz if chip.clock_hz else 0.0, groups, *hidden))
  fill, m, fitting = None, 0, 0
  if c.packing.enabled:
    shards = report.mesh_shape["data"] * report.mesh_shape["fsdp"]
    m, tokens = packed_batch.micro_rows(c, shards), micro_batch_cost.sequence_tokens(report, profile)
    fill, fitting = micro_batch_cost.token_fill(c, tokens, m), micro_batch_cost.fitting_micro_rows(c, tokens,
                                                                                                   shards)
    if 1 - micro_batch_cost.token_fill(c, tokens, fitting) > micro_batch_cost.MAX_PADDING:
      fitting = 0  # None does: the rows themselves pad more than that (a response per row).
  return StepEstimate(tuple(found), chips, chip.peak_flops, decoded.steps if decoded else 0, engine,
                      profile.name, decoded, fill, m, replay, budget, fitting)


def compare(report, profiles: list[profiles.Profile]) -> list[tuple[str, StepEstimate]]:
  """The step estimate of each engine (`engines`) under each profile, labelled "<profile letter>, <engine>"."""
  return [(f"{chr(65 + i)}, {engine}", estimate(report, profile, engine))
          for i, profile in enumerate(profiles) for engine in engines(report)]
