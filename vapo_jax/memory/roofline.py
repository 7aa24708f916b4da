"""A roofline estimate of one RL step from a compile report: each phase's FLOPs and HBM bytes per chip at
the chip's peak bfloat16 FLOP/s and HBM bandwidth, the slower of the two, plus the bytes its
collectives move at the chip's inter-chip (ICI) bandwidth (`topologies.CHIPS`, Google's published
figures: v5p 459 TFLOP/s, 2,765 GB/s HBM, 600 GB/s ICI into a chip).

  report = roofline.every_layer(report, twice)   # scanned layers: `twice` compiled with model.scan_unroll=2
  estimate = roofline.estimate(report)           # needs a target with a known chip
  print(roofline.format_estimate(estimate, report.target.device_kind))

From `cost_analysis` (per chip), with what it cannot see added:
- It counts a loop body once. Scanned decoder layers (`model.scan_layers`): `every_layer` counts the
  layer loop's body L times from a second compile whose body holds two layers (`model.scan_unroll=2`):
  with r1, r2 the two programs' figures, one layer is r2 − r1 and the program r1 + (L − 1)(r2 − r1)
  (exact when 2 divides L: no iteration runs outside the loop). The decode loop's program is one
  decode step (times the steps of a rollout), scoring's micro-batch loop one micro-batch (times the
  micro-batches), the update's loops one micro-batch of one update (times the updates and micro-batches).
- The log-probs' vocabulary blocks are a `lax.scan` too: the output projection's blocks it leaves out
  are added from the definition (`_head_flops`).
- It sees little of attention: `chunked`'s block loops have dynamic trip counts (counted once) and
  splash is a kernel (counted as nothing). Causal attention is added from its definition: per
  sequence of T tokens, 2·N·H·T²·L FLOPs forward (two T×T×H matmuls per head, half of them
  masked), backward twice that, remat one more forward. A decode step reads every slot's KV cache up
  to the longest live sequence: the whole cache once a long sequence runs (the bound used here).
- Decode steps (the response-length assumption): every response at `rollout.max_response_tokens` (an
  upper bound: the steps scale with the mean response length), the refill engine's slots all busy:
  N·Tr / slots steps; the static engine's rounds each run to the cap.
- Collectives from the HLO (`hlo.collectives`): each moves the larger of its operands and result per
  chip, times the known trip counts of the loops around it (the layer scan's L); the decode loop's per
  step (`aot.DecodeTraffic`) times the decode steps; loops of unknown count, the micro-batches. Their
  time adds to the phase's (no overlap with compute assumed: a bound, not a forecast).

Model FLOPs for the MFU (useful work, remat not counted): 2·params per generated or scored token,
6·params per trained token, plus attention by the same formula; params without the input embedding (a
lookup).
"""

import dataclasses
import math
from typing import NamedTuple

from vapo_jax.models import logprobs
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.rollout import common
from vapo_jax.train import packed_batch, packing

MFU_FLOOR = 0.40  # Below it, the estimate says what bounds the update.


class Estimate(NamedTuple):
  """One phase of one RL step, per chip."""

  phase: str
  flops: float
  bytes: float
  compute_s: float  # flops / peak FLOP/s.
  memory_s: float  # bytes / HBM bandwidth.
  collective_bytes: float = 0.0
  collective_s: float = 0.0  # collective_bytes / ICI bandwidth.
  model_flops: float = 0.0  # Useful FLOPs of the phase on all chips.

  @property
  def seconds(self) -> float:
    return max(self.compute_s, self.memory_s) + self.collective_s


class StepEstimate(NamedTuple):
  phases: tuple[Estimate, ...]
  chips: int
  peak_flops: float  # Per chip.
  decode_steps: int

  @property
  def seconds(self) -> float:
    return sum(p.seconds for p in self.phases)

  @property
  def model_flops(self) -> float:
    return sum(p.model_flops for p in self.phases)

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.chips * self.peak_flops * self.seconds)

  def phase(self, name: str) -> Estimate:
    return next(p for p in self.phases if p.phase == name)

  def phase_mfu(self, name: str) -> float:
    p = self.phase(name)
    return p.model_flops / (self.chips * self.peak_flops * p.seconds)

  @property
  def rollout_share(self) -> float:
    return self.phase("rollout").seconds / self.seconds


def every_layer(scanned, twice):
  """`scanned` (a report of scanned layers) with each program's FLOPs and bytes counted for all L layers:
  r1 + (L − 1)(r2 − r1), r2 the same program's in `twice` (compiled with `model.scan_unroll=2`); programs
  not in `twice` keep theirs. Exact when 2 divides L (see the module docstring)."""
  layers = scanned.architecture.num_layers
  if layers % 2:
    raise ValueError(f"every_layer needs an even number of layers (unroll 2 leaves one outside the loop), got {layers}")
  names = {p.name: p for phase in twice.phases for p in phase.programs}

  def count(p):
    q = names.get(p.name)
    return p if q is None else p._replace(flops=p.flops + (layers - 1) * (q.flops - p.flops),
                                          bytes_accessed=p.bytes_accessed + (layers - 1) * (q.bytes_accessed
                                                                                            - p.bytes_accessed))
  phases = tuple(dataclasses.replace(phase, programs=[count(p) for p in phase.programs]) for phase in scanned.phases)
  return dataclasses.replace(scanned, phases=phases)


def twice_unrolled(config):
  """`config` with two decoder layers per iteration of the layer scan: `every_layer`'s second compile."""
  return dataclasses.replace(config, model=dataclasses.replace(config.model, scan_unroll=2))


def _attention_forward(cfg, tokens: int) -> float:
  """Causal self-attention FLOPs of one sequence of `tokens` tokens, forward, every layer."""
  return 2.0 * cfg.num_heads * cfg.head_dim * tokens**2 * cfg.num_layers


def _collective_bytes(program, *, unknown: float) -> float:
  """Bytes per chip the program's collectives move: each the larger of its operands and result, times
  the trip counts of the loops around it (`unknown` for a loop whose count XLA does not print)."""
  return sum(max(c.operand_bytes, c.result_bytes) * math.prod(unknown if t is None else t for _, t in c.loops)
             for c in program.collectives)


def _decode(report, program, chips: int) -> tuple[float, float, float, int]:
  """(FLOPs, bytes, collective bytes, steps) of a rollout's decode loop per chip."""
  c, cfg = report.config, report.architecture
  tp, tr = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.max_response_tokens
  rows, sequences = report.decode_rows, c.rollout.responses_per_step
  rounds = sequences // rows if report.refill is False else None
  steps = math.ceil(sequences * tr / rows) if report.refill else tr * rounds  # Refill: every slot kept busy.
  cache = KVCache.bytes(cfg, rows, tp + tr, c.model.dtype) / chips  # Read whole, every step (the bound).
  attention = 4.0 * cfg.num_heads * cfg.head_dim * (tp + tr) * cfg.num_layers * rows / chips
  loop = program.decode.loop
  outside = sum(max(x.operand_bytes, x.result_bytes) for x in program.collectives
                if loop not in (name for name, _ in x.loops))
  moved = outside + steps * program.decode.bytes
  return steps * (program.flops + attention), steps * (program.bytes_accessed + cache), moved, steps


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


def _head_flops(report, chips: int) -> float:
  """FLOPs per chip, per pass over a step's sequences, of the log-probs' vocabulary blocks that
  `cost_analysis` leaves out: it counts one block of the `lax.scan` over ⌈V / Vb⌉ (`models/logprobs.py`),
  so (1 − 1/blocks) of the output projection's 2·V·D per token is added (forward; its backward twice that)."""
  c, cfg = report.config, report.architecture
  tokens = common.prompt_bucket(c.rollout.max_prompt_tokens) + c.rollout.max_response_tokens
  blocks = -(-cfg.vocab_size // logprobs._blocks(cfg.vocab_size, tokens, c.model.logits_chunk))
  return (1 - 1 / blocks) * 2.0 * cfg.vocab_size * cfg.hidden_size * tokens * c.rollout.responses_per_step / chips


def _model_flops(report) -> dict[str, float]:
  """Useful FLOPs of each phase on all chips (module docstring); the input embedding is a lookup, not a
  matmul, so its parameters count none (the output projection does, unless it is the embedding)."""
  c, cfg = report.config, report.architecture
  tp, tr = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.max_response_tokens
  n, tokens, critic_used = c.rollout.responses_per_step, tp + tr, c.algo.uses_critic
  models = 1 + critic_used + (c.algo.kl_coef > 0)
  embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  actor, critic = (count - embedding for count in report.parameters)
  attention = _attention_forward(cfg, tokens) * n
  return {"rollout": 2 * actor * (n * tr + c.rollout.prompts_per_step * tp) + attention,
          "scoring": 2 * (actor * (models - critic_used) + critic * critic_used) * n * tokens + attention * models,
          "update": (6 * (actor + critic * critic_used) * n * tokens + 3 * attention * (1 + critic_used))
          * c.algo.ppo_epochs}


def _phase(report, phase, chips: int) -> tuple[float, float, float, int]:
  """(FLOPs, bytes, collective bytes, decode steps) of one phase per chip in one RL step."""
  c, cfg = report.config, report.architecture
  tp, n = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.responses_per_step
  attention = _attention_forward(cfg, tp + c.rollout.max_response_tokens) * n / chips
  models = 1 + c.algo.uses_critic + (c.algo.kl_coef > 0)
  flops = bytes_ = moved = 0.0
  steps = 0
  for program in phase.programs:
    if program.decode is not None:
      f, b, m, steps = _decode(report, program, chips)
    elif phase.name == "rollout":
      f, b, m = program.flops, program.bytes_accessed, _collective_bytes(program, unknown=1)
      f += _attention_forward(cfg, tp) * c.rollout.prompts_per_step / chips if "prefill" in program.name else 0.0
    else:
      trips = _trips(report, phase.name)
      calls = c.updates_per_step if phase.name == "update" else 1  # One update program per mini-batch.
      f, b = program.flops * trips, program.bytes_accessed * trips
      m = calls * _collective_bytes(program, unknown=trips / calls)
      f += attention * (models if phase.name == "scoring" else 4 * (1 + c.algo.uses_critic) * c.algo.ppo_epochs)
      f += _head_flops(report, chips) * ((models - c.algo.uses_critic) if phase.name == "scoring"
                                         else 3 * c.algo.ppo_epochs)  # The actor's (and reference's) heads.
    flops, bytes_, moved = flops + f, bytes_ + b, moved + m
  return flops, bytes_, moved, steps


def estimate(report) -> StepEstimate:
  """One RL step's phases (rollout, scoring, update; value pretraining and the warm start are not
  per-step work) at the roofline of `report.target`'s chip."""
  chip, chips = report.target.chip, len(report.target.devices)
  useful, found, decode_steps = _model_flops(report), [], 0
  for phase in (p for p in report.phases if p.name in ("rollout", "scoring", "update")):
    flops, bytes_, moved, steps = _phase(report, phase, chips)
    decode_steps = steps or decode_steps
    found.append(Estimate(phase.name, flops, bytes_, flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth, moved,
                          moved / chip.ici_bandwidth, useful[phase.name]))
  return StepEstimate(tuple(found), chips, chip.peak_flops, decode_steps)


def update_bound(step: StepEstimate) -> str | None:
  """What bounds the update when its MFU is under `MFU_FLOOR`, and which setting would move it (None: above)."""
  mfu = step.phase_mfu("update")
  if mfu >= MFU_FLOOR:
    return None
  p = step.phase("update")
  per_chip = p.model_flops / step.chips
  terms = {"compute": p.compute_s, "HBM bandwidth": p.memory_s, "collectives": p.collective_s}
  bound = max(terms, key=terms.get)
  why = {"compute": (f"the compiled FLOPs are {p.flops / per_chip:.2f}x the model FLOPs (remat's second forward, "
                     "attention's masked blocks): model.remat=false where the memory allows it"),
         "HBM bandwidth": ("its bytes per FLOP: larger micro-batches (packing.micro_batch_rows) reuse each gathered "
                           "weight over more rows"),
         "collectives": ("FSDP gathers every weight and reduces every gradient once per micro-batch: larger "
                         "micro-batches (packing.micro_batch_rows) or a smaller mesh.fsdp with mesh.data > 1 move "
                         "fewer bytes")}[bound]
  share = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in terms.items())
  return f"update MFU {mfu:.1%} < {MFU_FLOOR:.0%}: bound by {bound} ({share}); {why}"


def format_estimate(step: StepEstimate, chip_name: str) -> str:
  lines = [f"roofline of one RL step per chip at {step.peak_flops / 1e12:.0f} TFLOP/s bf16, the HBM and ICI bandwidth "
           f"of a {chip_name} (every response at the length cap; {step.decode_steps} decode steps)",
           f"  {'phase':<12}{'TFLOP':>10}{'HBM GB':>10}{'ICI GB':>10}{'compute s':>11}{'memory s':>10}{'ICI s':>10}"
           f"{'estimate s':>12}{'MFU':>8}"]
  lines += [f"  {p.phase:<12}{p.flops / 1e12:10.1f}{p.bytes / 1e9:10.1f}{p.collective_bytes / 1e9:10.1f}"
            f"{p.compute_s:11.1f}{p.memory_s:10.1f}{p.collective_s:10.1f}{p.seconds:12.1f}"
            f"{step.phase_mfu(p.phase):8.1%}" for p in step.phases]
  lines.append(f"  one RL step: {step.seconds:.0f} s ({step.seconds / 60:.1f} min), the rollout "
               f"{step.rollout_share:.0%} of it; model FLOPs {step.model_flops / 1e15:.0f} PFLOP: MFU {step.mfu:.1%} "
               f"(the update, critic and actor in one program: {step.phase_mfu('update'):.1%})")
  if bound := update_bound(step):
    lines.append(f"  {bound}")
  return "\n".join(lines)
