"""A training step's rollout under `rollout.decode_budget`: rounds of the refill engine until P groups are complete.

  partial = PartialSampling(experience)               # holds the `rollout.partial.Carry` (saved in the checkpoint)
  sampled = partial.sample(state, prompts, version=v)  # the `Sampled` of P complete groups

Each round decodes the carried sequences and new groups' (`rollout/partial.py`) for at most `decode_budget`
steps with the step's one set of weights; the step trains on the P oldest complete groups. Metrics beside the
rollout's: `rollout/carried_sequences` (sequences decoding when the step's rounds end, continued next step),
`rollout/stale_token_frac` (trained tokens sampled by an older policy), `rollout/restarted_sequences` (restarted
for `max_staleness`) and `rollout/sampling_rounds`; the decode steps, rows, time and pool figures are summed over
the rounds.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import distributed, rollout
from vapo_jax.data import problems
from vapo_jax.rollout import common, partial
from vapo_jax.train.state import TrainState

# Folded into the run's seed for the partial rollouts' key: sequence i of the run samples from fold_in(key, i).
PARTIAL_STREAM = 0x70617274  # "part"
SUMMED = ("rollout/preemptions", "rollout/recomputed_tokens")


class PartialSampling:
  """The partial rollouts of one run (`Experience`'s config, programs, layout and verifier)."""

  def __init__(self, experience):
    self.experience = experience
    config, r = experience.config, experience.config.rollout
    self.width = partial.prompt_width(r.max_prompt_tokens, r.max_response_tokens)
    self.carry = partial.Carry(group=r.samples_per_prompt, sequences=partial.OVERPROVISION * r.responses_per_step,
                               max_response_tokens=r.max_response_tokens, max_staleness=r.max_staleness,
                               pad_id=experience.tokenizer.pad_token_id, prompt_width=self.width)
    self.key = distributed.replicate_local(jax.random.fold_in(jax.random.key(config.seed), PARTIAL_STREAM),
                                           experience.steps.mesh)

  def plan(self) -> rollout.RolloutPlan:
    """A round's plan (a `ConfigError` when it cannot run): the call's sequences (`partial.OVERPROVISION` × P·G,
    one per prompt) in the slots a P·G call has, so that a slot freed before the budget takes the next sequence."""
    r = self.experience.config.rollout
    return self.experience.plan_for(prompts=self.carry.sequences, group=1, prompt_tokens=self.width, budgeted=True,
                                    slot_sequences=r.responses_per_step)

  def sample(self, state: TrainState, prompts, *, version: int):
    """P complete groups at policy version `version` (the RL steps done): the rollout and the rewards and verdicts
    (global arrays), the metrics, and the groups' records."""
    x = self.experience
    config, r = x.config, x.config.rollout
    draw = lambda n: [(record, problems.encode_prompt(record, x.tokenizer, config)) for record in prompts.take(n)]
    how = x.sampling_for(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    plan, policy = self.plan(), x.policy(state)
    total = {"steps": 0, "row_steps": 0, "seconds": 0.0}
    figures = {}

    def decode(call):
      start = time.perf_counter()
      host, steps, row_steps, f = partial.decode_round(
          policy, call, self.key, plan=plan, sampling=how, budget=r.decode_budget,
          pad_id=x.tokenizer.pad_token_id, cache_dtype=jnp.dtype(config.model.dtype), jit=x.layout.jit,
          place=x.layout.place)
      for name, value in (("steps", steps), ("row_steps", row_steps), ("seconds", time.perf_counter() - start)):
        total[name] += value
      figures.update({k: figures.get(k, 0.0) + v if k in SUMMED else max(figures.get(k, 0.0), v) for k, v in f.items()})
      return host

    groups, restarted, rounds = self.carry.step(version, r.prompts_per_step, draw, decode)
    policy = None  # The rollout copy (tensor_parallel > 1) is dropped: its memory is free for scoring.
    arrays = partial.batch_arrays(groups, max_response_tokens=r.max_response_tokens, pad_id=x.tokenizer.pad_token_id,
                                  version=version)
    stale = arrays.pop("stale")
    out = x.steps.place(common.Rollout(**arrays))
    records = [g.record for g in groups]
    answers = [record[1] for record in records for _ in range(r.samples_per_prompt)]
    scored = x.verify(out, answers)
    rewards, correct = x.place_share(scored, out)
    stats = rollout.rollout_metrics(arrays["response_lengths"], arrays["finish_reason"], seconds=total["seconds"],
                                    decode_steps=total["steps"], rows=plan.slots,
                                    row_steps=total["row_steps"]) | figures | {
        "rollout/pages": float(plan.pages),
        "rollout/sampling_rounds": float(rounds), "rollout/carried_sequences": float(self.carry.carried()),
        "rollout/stale_token_frac": partial.stale_token_frac(stale, arrays["response_lengths"]),
        "rollout/restarted_sequences": float(restarted)}
    return out, rewards, correct, stats | scored.metrics, np.asarray(records, dtype=object)
