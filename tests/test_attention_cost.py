"""What the roofline charges for attention's splash kernel (`roofline/attention_cost.py`): the block pairs it
visits on the rows the trainer's packing plan fills, against a set-by-set count written here from the kernel's
rule (a pair runs when its blocks share a real segment, or covers the same tokens); one sequence filling a row
visits every causal pair; and the products a pair read off the compiled calls (the forward twice without kept
residuals)."""

import dataclasses
from types import SimpleNamespace

import numpy as np

from experiments import get_experiment
from vapo_jax.models import splash
from vapo_jax.roofline import attention_cost, micro_batch_cost, profiles
from vapo_jax.train import packed_batch

ROW, GROUP = 2048, 16


def _config(**packing):
  c = get_experiment("aime")
  return dataclasses.replace(
      c, rollout=dataclasses.replace(c.rollout, prompts_per_step=8, prompts_per_generation=8, slots=128,
                                     max_prompt_tokens=128, max_response_tokens=1920),
      algo=dataclasses.replace(c.algo, mini_batch_responses=32, ppo_epochs=1),
      packing=dataclasses.replace(c.packing, micro_batch_rows=4, row_tokens=ROW, **packing))


def _pairs_by_hand(ids: np.ndarray, block: int) -> int:
  """Causal block pairs whose blocks share a real segment (sets of ids), or lie over the same tokens."""
  blocks = [set(ids[i:i + block].tolist()) - {0} for i in range(0, ids.size, block)]
  return sum(1 for a in range(len(blocks)) for b in range(a + 1) if a == b or blocks[a] & blocks[b])


def test_the_pairs_visited_are_those_the_trainers_rows_give():
  rng = np.random.default_rng(3)
  c = _config(fill_micro_batches=False)
  responses = np.clip(rng.lognormal(np.log(500), 1.0, 128), 1, 1900).astype(np.int64)
  prompts = rng.integers(20, 128, 8)
  report = SimpleNamespace(config=c, mesh_shape={"data": 1, "fsdp": 4})
  profile = profiles.Profile("", responses, prompts)
  parts = micro_batch_cost.update_parts(c)
  plan = packed_batch.plan_rows(np.repeat(prompts, GROUP), responses, np.stack(parts)[None], row_tokens=ROW,
                                micro_rows=4)
  lengths = np.repeat(prompts, GROUP) + responses
  block = splash.block_size(ROW)
  for phase, index, groups in (("scoring", 0, [np.arange(lengths.size)]), ("update", 1, parts)):
    row, offset = np.asarray(plan.placement[index])
    by_hand = 0
    for part in groups:  # The trainer's segment ids, row by row, of the micro-batches that run.
      needed = int(row[part].max()) + 1
      for r in range(-(-needed // 4) * 4):
        ids = np.zeros(ROW, np.int64)
        for s, b in enumerate(sorted((b for b in part if row[b] == r), key=lambda b: offset[b]), 1):
          ids[offset[b]:offset[b] + lengths[b]] = s
        by_hand += _pairs_by_hand(ids, block)
    assert attention_cost.visited(report, profile, phase) == by_hand, phase


def test_one_sequence_filling_a_row_visits_every_causal_pair_and_packed_rows_fewer():
  c = _config(fill_micro_batches=False)
  report = SimpleNamespace(config=c, mesh_shape={"data": 1, "fsdp": 4})
  n = ROW // splash.block_size(ROW)
  full = profiles.Profile("", np.full(128, ROW - 128), np.full(8, 128))
  assert attention_cost.visited(report, full, "scoring") == 128 * n * (n + 1) // 2
  short = profiles.Profile("", np.full(128, 412), np.full(8, 100))  # Four sequences a row, one a block.
  assert attention_cost.visited(report, short, "scoring") == 32 * n


def test_the_products_a_pair_are_read_off_the_compiled_calls():
  calls = lambda fwd, dq, dkv: {"splash_mha_fwd_segmented_residuals": fwd, "splash_mha_dq_segmented_no_residuals": dq,
                                "splash_mha_dkv_segmented_no_residuals": dkv, "paged_attention": 5.0}
  assert attention_cost.products(calls(128, 0, 0)) == 2  # Scoring: the forward alone.
  assert attention_cost.products(calls(128, 128, 128)) == 2 + 3 + 4  # Residuals kept: one forward a backward.
  assert attention_cost.products(calls(256, 128, 128)) == 2 * 2 + 3 + 4  # The forward again in the backward.
  assert attention_cost.products({"paged_attention": 5.0}) is None
