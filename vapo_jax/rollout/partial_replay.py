"""Partial rollouts replayed on the host: whole RL steps of rounds, each round the refill engine's replay
(`refill/replay.simulate`) under the round's own plan, with the engine's own carry (`partial.Carry`): the
roofline's model of a budgeted rollout in steady state (`vapo_jax/roofline`).

  replay = partial_rounds(profile.responses, profile.prompts, samples_per_prompt=G, plan=round_plan, budget=D,
                          max_staleness=k)
"""

from typing import NamedTuple

import numpy as np

from vapo_jax.rollout import common, partial
from vapo_jax.rollout.refill import replay


class PartialLoad(NamedTuple):
  """One queue's partial rollouts (`partial_rounds`) over the measured RL steps."""

  load: replay.Load  # Their rounds' decode steps, end to end.
  steps: int  # RL steps measured.
  rounds: int
  prefill: np.ndarray  # [sequences prefilled] each round's prompts with their carried tokens.
  restarted: int  # Sequences restarted for `max_staleness`.
  carried: float  # Mean sequences carried out of a step.
  stale_frac: float  # Trained tokens sampled by an older version.
  plan: object = None  # The round's `RolloutPlan`, as replayed.


def partial_rounds(responses: np.ndarray, prompts: np.ndarray, *, samples_per_prompt: int, plan, budget: int,
                   max_staleness: int, warm: int = 4, measured: int = 4) -> PartialLoad:
  """One queue of a round's `plan` (`plan.plan_round`: its sequences, slots, pool, lanes and chunks) replayed
  over whole RL steps: each restarts the stale, then runs rounds of `budget` decode steps (`replay.simulate`,
  one sequence per prompt: a prompt with its carried tokens) until its share of groups is complete. Groups
  come from one step's `responses` `[N]` and `prompts` `[N / group]` in turn, the queue serving
  1/`plan.queues` of them; `warm` steps fill the pipeline, the next `measured` are counted."""
  queues, tr = plan.queues, plan.max_response_tokens
  per_step = len(prompts) // queues
  carry = partial.Carry(samples_per_prompt=samples_per_prompt, sequences=plan.prompts // queues,
                        max_response_tokens=tr, max_staleness=max_staleness, pad_id=0,
                        prompt_width=plan.prompt_tokens)
  drawn = [0]

  def draw(n):
    out = []
    for j in range(drawn[0], drawn[0] + n):
      g = j % len(prompts)
      out.append((responses[g * samples_per_prompt:(g + 1) * samples_per_prompt].tolist(),
                  [0] * int(prompts[g])))
    drawn[0] += n
    return out

  loads, prefill = [], []
  paged = replay.Paged(plan.queue_pages, plan.page_tokens, plan.block_pages, plan.lanes, plan.prefill_chunk)

  def decode(call):  # The round in the replay: each sequence decodes on towards its drawn length (its record).
    targets = {int(r): length for g in carry.groups for r, length in zip(g.rows, g.record)}
    target = np.asarray([targets[int(r)] for r in call.rows])
    held = call.prompt_mask.sum(axis=1)
    load = replay.simulate(target - call.offsets, held, samples_per_prompt=1, slots=plan.slots // queues,
                           min_slots=plan.min_slots // queues, paged=paged, budget=budget)
    loads.append(load)
    prefill.append(held)
    zeros = lambda dtype: np.broadcast_to(np.zeros(1, dtype), (len(target), tr))  # Tokens, log-probs: unread.
    finish = np.where(call.offsets + load.held >= target, common.FINISH_STOP, common.FINISH_UNFINISHED)
    return zeros(np.int32), zeros(np.float32), zeros(np.float32), load.held, finish

  rounds, restarted, carried, stale, trained = 0, 0, 0, 0, 0
  for version in range(warm + measured):
    if version == warm:  # The pipeline is full: count from here.
      del loads[:], prefill[:]
    groups, restarts, ran = carry.step(version, per_step, draw, decode)
    batch = carry.batch_arrays(groups, version=version)
    if version >= warm:
      rounds, restarted, carried = rounds + ran, restarted + restarts, carried + carry.carried()
      stale, trained = stale + int(batch["stale"].sum()), trained + int(batch["response_lengths"].sum())
  joined = replay.Load(*(np.concatenate([getattr(x, f) for x in loads]) for f in ("rows", "live",
                                                                                  "read_tokens")),
                       sum(x.preemptions for x in loads), sum(x.recomputed_tokens for x in loads),
                       max(x.peak_pages for x in loads), None, sum(x.prefills for x in loads),
                       *(np.concatenate([getattr(x, f) for x in loads]) for f in ("chunks", "prefill_tokens",
                                                                                   "prefill_lengths")))
  return PartialLoad(joined, measured, rounds, np.concatenate(prefill), restarted, carried / measured,
                     stale / max(trained, 1), plan)
