"""A roofline estimate of one RL step from a compile report: each phase's FLOPs and HBM bytes per chip,
at the chip's peak bfloat16 FLOP/s and HBM bandwidth (`topologies.CHIPS`), the slower of the two.

  estimate = roofline.estimate(report)       # needs a target with a known chip
  print(roofline.format_estimate(estimate))

From `cost_analysis` (per chip), with what it cannot see added:
- It counts a loop body once: the decode loop's program is one decode step (times the steps of a
  rollout), scoring's micro-batch loop one micro-batch (times the micro-batches), the update's loops
  one micro-batch of one update (times the updates and micro-batches).
- It sees little of attention: `chunked`'s block loops have dynamic trip counts (counted once) and
  splash is a kernel (counted as nothing). Causal attention is added from its definition: per
  sequence of T tokens, 2·N·H·T²·L FLOPs forward (two T×T×H matmuls per head, half of them
  masked), backward twice that, remat one more forward. A decode step reads every slot's KV cache up
  to the longest live sequence: the whole cache once a long sequence runs (the bound used here).
- Decode steps: every response at `rollout.max_response_tokens` (an upper bound: the steps scale with
  the mean response length), the refill engine's slots all busy: N·Tr / slots steps; the static
  engine's rounds each run to the cap.

Model FLOPs for the MFU (useful work, remat not counted): 2·params per generated or scored token,
6·params per trained token, plus attention by the same formula.
"""

import math
from typing import NamedTuple

from vapo_jax.models.transformer import KVCache
from vapo_jax.rollout import common
from vapo_jax.train import packed_batch, packing


class Estimate(NamedTuple):
  """One phase of one RL step, per chip."""

  phase: str
  flops: float
  bytes: float
  compute_s: float  # flops / peak FLOP/s.
  memory_s: float  # bytes / HBM bandwidth.

  @property
  def seconds(self) -> float:
    return max(self.compute_s, self.memory_s)


class StepEstimate(NamedTuple):
  phases: tuple[Estimate, ...]
  model_flops: float  # Useful FLOPs of the step on all chips.
  chips: int
  peak_flops: float  # Per chip.
  decode_steps: int

  @property
  def seconds(self) -> float:
    return sum(p.seconds for p in self.phases)

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.chips * self.peak_flops * self.seconds)


def _attention_forward(cfg, tokens: int) -> float:
  """Causal self-attention FLOPs of one sequence of `tokens` tokens, forward, every layer."""
  return 2.0 * cfg.num_heads * cfg.head_dim * tokens**2 * cfg.num_layers


def _decode(report, program, chips: int) -> tuple[float, float, int]:
  """(FLOPs, bytes, steps) of a rollout's decode loop per chip."""
  c, cfg = report.config, report.architecture
  tp, tr = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.max_response_tokens
  rows, sequences = report.decode_rows, c.rollout.responses_per_step
  rounds = sequences // rows if report.refill is False else None
  steps = math.ceil(sequences * tr / rows) if report.refill else tr * rounds  # Refill: every slot kept busy.
  cache = KVCache.bytes(cfg, rows, tp + tr, c.model.dtype) / chips  # Read whole, every step (the bound).
  attention = 4.0 * cfg.num_heads * cfg.head_dim * (tp + tr) * cfg.num_layers * rows / chips
  return steps * (program.flops + attention), steps * (program.bytes_accessed + cache), steps


def _trips(report, phase_name: str) -> float:
  """How many times the loop bodies cost_analysis counted once run in one RL step: micro-batches of
  sequences, or packed, of `packing.micro_batch_rows` rows at the rows the report compiled (every
  response at the cap)."""
  c = report.config
  n, mini = c.rollout.responses_per_step, min(c.algo.mini_batch_responses, c.rollout.responses_per_step)
  if c.packing.enabled:
    m = packed_batch.micro_rows(c, report.mesh_shape["data"] * report.mesh_shape["fsdp"])
    rows = lambda size: packing.bucket_rows(size, multiple=m) // m
    return rows(n) if phase_name == "scoring" else c.updates_per_step * rows(mini)
  micro = min(c.algo.micro_batch_responses or mini, mini)
  if phase_name == "scoring":
    return n // micro if micro < n else 1
  return c.updates_per_step * (mini // micro)


def estimate(report) -> StepEstimate:
  """One RL step's phases (rollout, scoring, update; value pretraining and the warm start are not
  per-step work) at the roofline of `report.target`'s chip."""
  chip, chips = report.target.chip, len(report.target.devices)
  c, cfg = report.config, report.architecture
  tp, tr = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.max_response_tokens
  n, tokens = c.rollout.responses_per_step, tp + tr
  models = 1 + c.algo.uses_critic + (c.algo.kl_coef > 0)
  attention = _attention_forward(cfg, tokens) * n / chips
  found, decode_steps = [], 0
  for phase in report.phases:
    if phase.name not in ("rollout", "scoring", "update"):
      continue
    flops = bytes_ = 0.0
    for program in phase.programs:
      if program.decode is not None:
        f, b, decode_steps = _decode(report, program, chips)
      elif phase.name == "rollout":
        f, b = program.flops, program.bytes_accessed
        f += _attention_forward(cfg, tp) * c.rollout.prompts_per_step / chips if "prefill" in program.name else 0.0
      else:
        trips = _trips(report, phase.name)
        f, b = program.flops * trips, program.bytes_accessed * trips
        f += attention * (models if phase.name == "scoring" else 4 * (1 + c.algo.uses_critic) * c.algo.ppo_epochs)
      flops, bytes_ = flops + f, bytes_ + b
    found.append(Estimate(phase.name, flops, bytes_, flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth))
  actor, critic = report.parameters
  generated = n * tr + c.rollout.prompts_per_step * tp
  useful = (2 * actor * generated + _attention_forward(cfg, tokens) * n  # Rollout.
            + 2 * (actor * (models - c.algo.uses_critic) + critic * c.algo.uses_critic) * n * tokens
            + _attention_forward(cfg, tokens) * n * models  # Scoring.
            + 6 * (actor + critic * c.algo.uses_critic) * n * tokens * c.algo.ppo_epochs
            + 3 * _attention_forward(cfg, tokens) * n * (1 + c.algo.uses_critic) * c.algo.ppo_epochs)  # Update.
  return StepEstimate(tuple(found), useful, chips, chip.peak_flops, decode_steps)


def format_estimate(step: StepEstimate, chip_name: str) -> str:
  lines = [f"roofline of one RL step per chip at {step.peak_flops / 1e12:.0f} TFLOP/s bf16 and the HBM bandwidth of a "
           f"{chip_name} (every response at the length cap; {step.decode_steps} decode steps)",
           f"  {'phase':<12}{'TFLOP':>12}{'GB':>12}{'compute s':>12}{'memory s':>12}{'estimate s':>12}"]
  lines += [f"  {p.phase:<12}{p.flops / 1e12:12.1f}{p.bytes / 1e9:12.1f}{p.compute_s:12.1f}{p.memory_s:12.1f}"
            f"{p.seconds:12.1f}" for p in step.phases]
  lines.append(f"  one RL step: {step.seconds:.0f} s ({step.seconds / 60:.1f} min); model FLOPs "
               f"{step.model_flops / 1e15:.0f} PFLOP: MFU {step.mfu:.1%}")
  return "\n".join(lines)
