"""A training step's rollout under `rollout.decode_budget`: rounds of the refill engine until P groups are
complete.

  partial = BudgetedRollout(context, seed=config.seed, mesh=mesh)   # holds the `rollout.partial.Carry`
  out, rewards, correct, stats = partial.sample(state, prompts, version=v)   # P complete groups, verified

Each round decodes the carried sequences and new groups' (`rollout/partial.py`) for at most `decode_budget`
steps with the step's one set of weights; the step trains on the P oldest complete groups. What it takes from
its run is its `Context`: the round's plan, the sampler, the policy in the rollout layout, the rollout's jit
and placement, the prompts' encoding, the verifier and the training mesh's placement. Metrics beside the
rollout's: `rollout/carried_sequences` (sequences decoding when the step's rounds end, continued next step),
`rollout/stale_token_frac` (trained tokens sampled by an older policy), `rollout/restarted_sequences`
(restarted for `max_staleness`) and `rollout/sampling_rounds`; the decode steps, rows, time and pool figures
are summed over the rounds.
"""

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from vapo_jax import distributed, rollout
from vapo_jax.config import RolloutConfig
from vapo_jax.rollout import common, partial
from vapo_jax.rollout.layout import RolloutLayout
from vapo_jax.train.state import TrainState

# Folded into the run's seed for the partial rollouts' key: sequence i of the run samples from fold_in(key,
# i).
PARTIAL_STREAM = 0x70617274  # "part"
SUMMED = ("rollout/preemptions", "rollout/recomputed_tokens", "rollout/prefills", "rollout/prefill_chunks",
          "rollout/prefill_tokens")


class Context(NamedTuple):
  """What a run's partial rollouts use of it."""

  settings: RolloutConfig  # The budget, staleness, group and sizes.
  plan: rollout.RolloutPlan  # A round's (`plan.plan_round`).
  sampling: common.Sampling  # The training rollout's sampler.
  policy: Callable[[TrainState], Any]  # The actor in the rollout layout (`Experience.policy`).
  layout: RolloutLayout  # The rollout's jit and placement.
  encode: Callable[[Any], list[int]]  # A record's prompt token ids.
  verify: Callable  # (rollout on the training mesh, answers) → (rewards, verdicts, the verifier's metrics).
  place: Callable  # Host arrays → the training mesh.
  pad_id: int
  cache_dtype: Any


class BudgetedRollout:
  """The partial rollouts of one run: its carry (saved in its checkpoints) and key."""

  def __init__(self, context: Context, *, seed: int, mesh):
    r, self.context = context.settings, context
    self.carry = partial.Carry(samples_per_prompt=r.samples_per_prompt, sequences=context.plan.prompts,
                               max_response_tokens=r.max_response_tokens, max_staleness=r.max_staleness,
                               pad_id=context.pad_id, prompt_width=context.plan.prompt_tokens)
    self.key = distributed.replicate_local(jax.random.fold_in(jax.random.key(seed), PARTIAL_STREAM), mesh)

  def sample(self, state: TrainState, prompts, *, version: int):
    """P complete groups at policy version `version` (the RL steps done): the rollout and the rewards and
    verdicts (global arrays on the training mesh), and the metrics."""
    c, r = self.context, self.context.settings
    draw = lambda n: [(list(record), c.encode(record)) for record in prompts.take(n)]
    policy = c.policy(state)
    total = {"steps": 0, "row_steps": 0, "seconds": 0.0}
    figures = {}

    def decode(call):
      start = time.perf_counter()
      host, steps, row_steps, f = partial.decode_round(
          policy, call, self.key, plan=c.plan, sampling=c.sampling, budget=r.decode_budget, pad_id=c.pad_id,
          cache_dtype=c.cache_dtype, jit=c.layout.jit, place=c.layout.place)
      for name, value in (("steps", steps), ("row_steps", row_steps),
                          ("seconds", time.perf_counter() - start)):
        total[name] += value
      figures.update({k: figures.get(k, 0.0) + v if k in SUMMED else max(figures.get(k, 0.0), v) for k,
                      v in f.items()})
      return host

    groups, restarted, rounds = self.carry.step(version, r.prompts_per_step, draw, decode,
                                                queues=c.plan.queues)
    policy = None  # The rollout copy (tensor_parallel > 1) is dropped: its memory is free for scoring.
    arrays = self.carry.batch_arrays(groups, version=version)
    stale = arrays.pop("stale")
    out = c.place(common.Rollout(**arrays))
    rewards, correct, verified = c.verify(out, [g.record[1] for g in groups for _ in g.rows])
    stats = rollout.rollout_metrics(arrays["response_lengths"], arrays["finish_reason"],
                                    seconds=total["seconds"], decode_steps=total["steps"], rows=c.plan.slots,
                                    row_steps=total["row_steps"]) | figures | {
        "rollout/queue_pages": float(c.plan.queue_pages),
        "rollout/sampling_rounds": float(rounds), "rollout/carried_sequences": float(self.carry.carried()),
        "rollout/stale_token_frac": partial.stale_token_frac(stale, arrays["response_lengths"]),
        "rollout/restarted_sequences": float(restarted)}
    return out, rewards, correct, stats | verified
