"""What the roofline charges scoring and the update (`memory/micro_batch_cost.py`): the micro-batches that run on
a profile's lengths, the same number the trainer's packing plan runs (`packed_batch.plan_rows`) and a first-fit
decreasing written here as a slow loop gives; the update's token fill is one minus the plan's
`perf/padding_frac_update`; `fitting_micro_rows` is the largest micro-batch within the padding bound; and the
shipped `aime` micro-batch meets that bound under the roofline's long-tailed profile (B)."""

import dataclasses
from types import SimpleNamespace

import numpy as np

from experiments import get_experiment
from vapo_jax.memory import micro_batch_cost, schedule
from vapo_jax.train import packed_batch

GROUP = 16


def _config(**rollout):
  c = get_experiment("aime")
  return dataclasses.replace(c, rollout=dataclasses.replace(c.rollout, prompts_per_step=32, prompts_per_generation=32,
                                                            slots=512, **rollout),
                             algo=dataclasses.replace(c.algo, mini_batch_responses=128, ppo_epochs=2),
                             packing=dataclasses.replace(c.packing, micro_batch_rows=8))


def _rows_by_hand(lengths, row_tokens: int) -> int:
  """First fit decreasing, one sequence at a time: the rows opened."""
  free = []
  for n in sorted(lengths, reverse=True):
    for i, room in enumerate(free):
      if n <= room:
        free[i] -= n
        break
    else:
      free.append(row_tokens - n)
  return len(free)


def test_the_micro_batches_charged_are_those_that_run():
  c = _config()
  rng = np.random.default_rng(1)
  responses = np.clip(rng.lognormal(np.log(4000), 1.0, 512), 1, 20480).astype(np.int64)
  prompts = rng.integers(50, 400, 32)
  report = SimpleNamespace(config=c, mesh_shape={"data": 1, "fsdp": 8})
  profile = schedule.Profile("", responses, prompts)
  tokens = np.repeat(prompts, GROUP) + responses
  m, row_tokens = 8, packed_batch.row_tokens(c)
  parts = micro_batch_cost.update_parts(c)
  by_hand = sum(-(-_rows_by_hand(tokens[p], row_tokens) // m) for p in parts)
  assert micro_batch_cost.trips(report, "update", profile) == 2 * by_hand  # Two epochs.
  assert micro_batch_cost.trips(report, "scoring", profile) == -(-_rows_by_hand(tokens, row_tokens) // m)
  orders = np.stack([np.stack(parts)] * 2)
  plan = packed_batch.plan_rows(np.repeat(prompts, GROUP), responses, orders, row_tokens=row_tokens, micro_rows=m)
  assert plan.update_metrics["perf/micro_batches"] * len(parts) == by_hand
  fill = micro_batch_cost.token_fill(c, tokens, m)
  np.testing.assert_allclose(fill, 1 - plan.update_metrics["perf/padding_frac_update"], rtol=1e-12)
  picked = micro_batch_cost.fitting_micro_rows(c, tokens, 8)
  fits = [k for k in range(8, 513, 8) if 1 - micro_batch_cost.token_fill(c, tokens, k) <= micro_batch_cost.MAX_PADDING]
  assert picked == max(fits, default=8) and picked % 8 == 0


def test_aimes_micro_batch_pads_at_most_15_percent_of_the_updates_slots_under_profile_b():
  c = get_experiment("aime")
  prompts, where = schedule.prompt_lengths(c)
  b = schedule.log_normal(c, prompts, where)
  tokens = np.repeat(b.prompts, c.rollout.samples_per_prompt) + b.responses
  multiple = c.mesh.data * c.mesh.fsdp
  assert c.packing.micro_batch_rows == micro_batch_cost.fitting_micro_rows(c, tokens, multiple)
  assert micro_batch_cost.token_fill(c, tokens, c.packing.micro_batch_rows) >= 1 - micro_batch_cost.MAX_PADDING
