"""What scoring and the update run in one RL step: their micro-batches on a response-length profile's lengths
(those that run: ⌈rows / m⌉ of each pass, the compiled ones past them skipped), the token fill of the update's
micro-batches, and a compiled program's bytes, cycles and collectives charged for the micro-batches that run
(its loops over micro-batches, traced under `micro_batches.MICRO_BATCHES`, found in its walked HLO).

  trips(report, "update", profile)             # micro-batches run in one step (every epoch's mini-batches)
  token_fill(config, tokens, micro_rows)       # real tokens / the update's token slots run
  fitting_micro_rows(config, tokens, multiple) # the largest micro-batch whose padding is at most 15%
"""

import math

import numpy as np

from vapo_jax.memory import hlo_walk
from vapo_jax.rollout import common
from vapo_jax.roofline import profiles
from vapo_jax.train import micro_batches, packed_batch, packing

MAX_PADDING = 0.15  # Of the update's token slots: `fitting_micro_rows`'s bound.


def micro_loops(program) -> dict[str, "hlo_walk.Loop"]:
  """The program's loops over micro-batches (traced under `micro_batches.MICRO_BATCHES`) of a known count."""
  walked = program.walked
  return {} if walked is None else {x.name: x for x in walked.loops
                                    if x.op_name.endswith(f"{micro_batches.MICRO_BATCHES}/while") and x.trips}


def collective_bytes(program, *, unknown: float, run: float | None = None) -> float:
  """Bytes per chip the program's collectives move: each the larger of its operands and result, times the
  trips of the loops around it (`unknown` for a count neither XLA nor the condition gives); `run`: the
  micro-batches that run in all, in place of the compiled ones, for a collective inside a micro-batch loop."""
  micro = micro_loops(program) if run is not None else {}
  total = 0.0
  for c in program.collectives:
    trips = [unknown if t is None else t for _, t in c.loops]
    factor = math.prod(trips)
    for i, (name, _) in enumerate(c.loops):
      if name in micro:
        factor = factor / math.prod(trips[:i + 1]) * run
    total += c.moved * factor
  return total


def walked(program, run: float) -> hlo_walk.Cost:
  """HBM bytes, matmul FLOPs and compiler cycles per chip of the program's runs in one step, walked
  (`hlo_walk`), with its micro-batch loops charged for the `run` micro-batches that run in all rather than the
  compiled ones."""
  w = program.walked
  total = hlo_walk.Cost(bytes=w.bytes, cycles=w.cycles, kernel_bytes=w.kernel_bytes, flops=w.flops,
                        collective_s=w.collective_s, hidden_s=w.hidden_s, hidden_cycles_s=w.hidden_cycles_s,
                        groups={name: list(figures) for name, figures in w.groups.items()},
                        kernels=dict(w.kernels))
  for loop in micro_loops(program).values():
    total.add(loop.iteration, run - loop.runs * loop.trips)
  return total


def sequence_tokens(report, profile: profiles.Profile) -> np.ndarray:
  """`[N]` each sequence's tokens under `profile`: its prompt's and its response's."""
  g = report.config.rollout.samples_per_prompt
  return np.repeat(profile.prompts, g)[:len(profile.responses)] + profile.responses


def trips(report, phase_name: str, profile: profiles.Profile | None = None) -> float:
  """How many times the loop bodies cost_analysis counted once run in one RL step: micro-batches of
  sequences, or packed, of `packing.micro_batch_rows` rows: those that run (⌈rows / m⌉, the rest skipped)
  for the rows first-fit decreasing packs `profile`'s sequences into (default: every response at the cap,
  a row each)."""
  c = report.config
  n, mini = c.rollout.responses_per_step, min(c.algo.mini_batch_responses, c.rollout.responses_per_step)
  if c.packing.enabled:
    m = packed_batch.micro_rows(c, report.mesh_shape["data"] * report.mesh_shape["fsdp"])
    tokens = np.full(n, packed_batch.row_tokens(c)) if profile is None else sequence_tokens(report, profile)
    needed = needed_rows(c, tokens, [np.arange(n)]) if phase_name == "scoring" else update_needed(c, tokens, m)
    run = sum(-(-int(rows) // m) for rows in needed)
    return run if phase_name == "scoring" else c.algo.ppo_epochs * run
  micro = min(c.algo.micro_batch_responses or mini, mini)
  if phase_name == "scoring":
    return n // micro if micro < n else 1
  return c.updates_per_step * (mini // micro)


def computed_tokens(report, phase_name: str, trips: float) -> float:
  """Tokens a pass over a step's sequences computes: packed, the micro-batches' rows end to end (padding too);
  padded, every sequence at the prompt bucket + cap."""
  c = report.config
  if c.packing.enabled:
    m = packed_batch.micro_rows(c, report.mesh_shape["data"] * report.mesh_shape["fsdp"])
    passes = 1 if phase_name == "scoring" else c.algo.ppo_epochs
    return trips / passes * m * packed_batch.row_tokens(c)
  r = c.rollout
  return r.responses_per_step * (common.prompt_bucket(r.max_prompt_tokens) + r.max_response_tokens)


def update_parts(config) -> list[np.ndarray]:
  """The sequence ids of one epoch's mini-batches (random subsets of the step, as the trainer draws them)."""
  n = config.rollout.responses_per_step
  mini = min(config.algo.mini_batch_responses, n)
  order = np.random.default_rng(0).permutation(n)
  return [order[i:i + mini] for i in range(0, n, mini)]


def placement(config, tokens: np.ndarray, micro_rows: int, phase_name: str) -> packing.Cut:
  """Where one pass of `phase_name` places each sequence (`[N]` lengths `tokens`), as the trainer's plan does:
  scoring's one group, first-fit decreasing; one epoch's mini-batches, `update_parts` first-fit decreasing each, or
  with `packing.fill_micro_batches` the same order cut where the rows fill whole micro-batches of `micro_rows`
  (`packing.cut_filled`)."""
  row_tokens = packed_batch.row_tokens(config)
  parts = [np.arange(len(tokens))] if phase_name == "scoring" else update_parts(config)
  if phase_name != "scoring" and config.packing.fill_micro_batches:
    return packing.cut_filled(tokens, np.concatenate(parts), len(parts), row_tokens, micro_rows)
  return packing.Cut(parts, *packing.place_groups(tokens, parts, row_tokens))


def update_needed(config, tokens: np.ndarray, micro_rows: int) -> np.ndarray:
  """Rows each of one epoch's mini-batches fills (`placement`)."""
  return np.asarray(placement(config, tokens, micro_rows, "update").needed)


def needed_rows(config, tokens: np.ndarray, parts) -> list[int]:
  """Rows first-fit decreasing packs each part of `tokens` (`[N]` sequence lengths) into."""
  row_tokens = packed_batch.row_tokens(config)
  return [int(packing.first_fit_decreasing(tokens[part], row_tokens)[0].max()) + 1 for part in parts]


def token_fill(config, tokens: np.ndarray, micro_rows: int) -> float:
  """The update's real tokens over its token slots run, in micro-batches of `micro_rows` rows."""
  parts = update_parts(config)
  run = sum(-(-int(n) // micro_rows) * micro_rows for n in update_needed(config, tokens, micro_rows))
  return float(sum(tokens[p].sum() for p in parts)) / (run * packed_batch.row_tokens(config))


def fitting_micro_rows(config, tokens: np.ndarray, multiple: int, max_padding: float = MAX_PADDING) -> int:
  """The most rows per micro-batch, a multiple of `multiple` (the mesh's data × fsdp), that keeps the update's
  padding at most `max_padding` on `tokens`; `multiple` when none does (the least padding there is)."""
  most = max(needed_rows(config, tokens, update_parts(config)))
  fitting = [m for m in range(multiple, most + multiple, multiple) if 1 - token_fill(config, tokens,
                                                                                     m) <= max_padding]
  return max(fitting, default=multiple)
