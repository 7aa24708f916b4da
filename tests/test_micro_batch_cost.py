"""What the roofline charges scoring and the update (`roofline/micro_batch_cost.py`): the micro-batches that run on
a profile's lengths, the same number the trainer's packing plan runs (`packed_batch.plan_rows`) and a first-fit
decreasing written here as a slow loop gives; the update's token fill is one minus the plan's
`perf/padding_frac_update`; `fitting_micro_rows` is the largest micro-batch within the padding bound; and the
shipped `aime` micro-batch is the one that bound picks under the roofline's long-tailed profile (B); and the decode
prices a cache read on one of a chip's two TensorCores at half its bandwidth."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from experiments import get_experiment
from vapo_jax.rollout.refill import replay
from vapo_jax.roofline import micro_batch_cost, profiles
from vapo_jax.train import packed_batch

GROUP = 16


def _config(fill: bool = False, **rollout):
  c = get_experiment("aime")
  return dataclasses.replace(c, rollout=dataclasses.replace(c.rollout, prompts_per_step=32, prompts_per_generation=32,
                                                            slots=512, **rollout),
                             algo=dataclasses.replace(c.algo, mini_batch_responses=128, ppo_epochs=2),
                             packing=dataclasses.replace(c.packing, micro_batch_rows=8, fill_micro_batches=fill))


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
  profile = profiles.Profile("", responses, prompts)
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


def test_mini_batches_cut_to_fill_micro_batches_are_charged_as_the_plan_cuts_them():
  """`packing.fill_micro_batches`: the roofline's micro-batches are the plan's on the same orders, and fewer
  than equal mini-batches run."""
  c, equal = _config(fill=True), _config()
  rng = np.random.default_rng(1)
  responses = np.clip(rng.lognormal(np.log(4000), 1.0, 512), 1, 20480).astype(np.int64)
  prompts = rng.integers(50, 400, 32)
  report = SimpleNamespace(config=c, mesh_shape={"data": 1, "fsdp": 8})
  profile = profiles.Profile("", responses, prompts)
  parts = micro_batch_cost.update_parts(c)
  plan = packed_batch.plan_rows(np.repeat(prompts, GROUP), responses, np.stack([np.stack(parts)] * 2),
                                row_tokens=packed_batch.row_tokens(c), micro_rows=8, fill=True)
  run = micro_batch_cost.trips(report, "update", profile)
  assert plan.update_metrics["perf/micro_batches"] * len(parts) * 2 == run
  assert run < micro_batch_cost.trips(SimpleNamespace(config=equal, mesh_shape=report.mesh_shape), "update", profile)
  tokens = np.repeat(prompts, GROUP) + responses
  np.testing.assert_allclose(micro_batch_cost.token_fill(c, tokens, 8),
                             1 - plan.update_metrics["perf/padding_frac_update"], rtol=1e-12)


@pytest.mark.slow  # For time (7 s): a property of aime's speed, not of its results.
def test_aimes_micro_batch_pads_at_most_15_percent_of_the_updates_slots_under_profile_b():
  """`aime`'s micro-batch is one row per FSDP group (64), the fewest its mesh allows; equal mini-batches of 512
  would leave 28 % of its slots empty there (over the bound: `fitting_micro_rows` finds no size within it), so
  `aime` cuts its mini-batches to fill micro-batches, and pads less than 1 % (34 micro-batches, the least its
  tokens allow: 33.8). On the mesh it had before (FSDP
  over 32, micro-batches of 32 rows) equal mini-batches stayed within the bound, at 85.6 %."""
  c = get_experiment("aime")
  prompts, where = profiles.prompt_lengths(c)
  b = profiles.log_normal(c, prompts, where)
  tokens = np.repeat(b.prompts, c.rollout.samples_per_prompt) + b.responses
  multiple = c.mesh.data * c.mesh.fsdp
  equal = dataclasses.replace(c, packing=dataclasses.replace(c.packing, fill_micro_batches=False))
  assert c.packing.fill_micro_batches and c.packing.micro_batch_rows == multiple == 64
  assert micro_batch_cost.fitting_micro_rows(equal, tokens, multiple) == multiple
  assert micro_batch_cost.token_fill(equal, tokens, multiple) < 1 - micro_batch_cost.MAX_PADDING
  assert micro_batch_cost.token_fill(c, tokens, multiple) >= 0.99
  assert micro_batch_cost.fitting_micro_rows(equal, tokens, 32) == 32
  assert micro_batch_cost.token_fill(equal, tokens, 32) >= 1 - micro_batch_cost.MAX_PADDING


def test_a_cache_read_on_one_of_two_cores_takes_twice_the_reads_time():
  """`decode_cost.cost`: the paged kernel without megacore reads the cache at half a v5p chip's bandwidth."""
  from vapo_jax.memory import topologies
  from vapo_jax.roofline import decode_cost

  chip = topologies.CHIPS["TPU v5"]
  load = replay.Load(rows=np.full(3, 8), live=np.full(3, 8), read_tokens=np.full(3, 1e6), preemptions=0,
                       recomputed_tokens=0, peak_pages=0)
  prices = decode_cost.Prices(rows=8, weights=1e9, rest=0.0, flops=0.0, collectives=0.0, token_bytes=1e3,
                              attention_flops=0.0)
  both, one = (decode_cost.cost(load, prices._replace(read_cores=cores), chip, engine="paged", slots=8, copied_tokens=0)
               for cores in (2, 1))
  kv = 3 * 1e6 * 1e3 / chip.hbm_bandwidth
  np.testing.assert_allclose(one.seconds - both.seconds, kv, rtol=1e-9)
