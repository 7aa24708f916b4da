"""The refill engine's pages: a group's prompt is stored once, every page comes back, and a pool too small for the
slots preempts and restarts sequences without changing a token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import contiguous_refill as contiguous
from model_utils import EOS, PROMPTS
from test_refill import STATIC, assert_same, plan, queue_steps, sample
from vapo_jax.config import RolloutConfig
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import pages

SAMPLING = dict(temperature=1.3, top_k=5, top_p=0.8)  # EOS stops some sequences early: lengths 1..10.


def test_the_free_list_hands_out_what_is_free_and_takes_it_back():
  free = pages.initial(2, 6, jnp.asarray([2, 5]))  # Queue 0: pages 2-5 free; queue 1: page 5.
  assert free.count.tolist() == [4, 1] and free.peak.tolist() == [2, 5]
  want = jnp.asarray([[True, False, True], [True, True, False]])
  free, got = pages.take(free, want)
  assert got.tolist() == [[5, 6, 4], [5, 6, 6]]  # 6: none (not wanted, or none left in queue 1).
  assert free.count.tolist() == [2, 0] and free.peak.tolist() == [4, 6]
  free = pages.give_back(free, jnp.asarray([[5, 9, 4], [5, 0, 0]]), jnp.asarray([[True, False, True],
                                                                               [True, False, False]]))
  assert free.count.tolist() == [4, 1] and sorted(free.stack[0, :4].tolist()) == [2, 3, 4, 5]
  assert free.stack[1, 0] == 5


def test_a_groups_prompt_is_stored_once_when_its_samples_start(model):
  """After the first iteration, the pages in use are the prompts the queues took for their next sequences
  (⌈length / page⌉ each, once for their G samples) and a page of each sample that started; a prompt's pages hold its
  real tokens from slot 0: the whole prefill's keys (to float rounding: chunked), padding dropped."""
  tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
  spec = common.Sampling(max_response_tokens=10, stop_token_ids=(EOS,))
  config = RolloutConfig(slots=6, pages=12, page_tokens=4, block_pages=1, decode_steps_per_call=1,
                         prefill_chunk=3)
  chosen = plan(model, PROMPTS, config, samples_per_prompt=3, devices=2,
                budgeted=True)  # Queue 0: prompts 0-1; 1: prompts 2-3.
  assert (chosen.queues, chosen.queue_pages, chosen.prefill_chunk) == (2, 12, 3)
  fns = chosen.programs(sampling=spec, pad_id=0, cache_dtype=jnp.float32, jit=jax.jit)
  state, _ = fns.decode(model, fns.start(model, tokens, mask), jax.random.key(0))
  held = [-(-len(p) // 4) for p in PROMPTS]  # 1, 2, 1, 1 pages. Prompts 1 (7 tokens) and 3 (4) are in their chunks:
  assert np.asarray(state.prompts.done).tolist() == [3, 3, 1, 3]
  # ...each queue's first prompt's 3 samples started, one page each.
  assert state.free.count.tolist() == [12 - held[0] - held[1] - 3, 12 - held[2] - held[3] - 3]
  _, prefilled = common.prefill(model, jnp.asarray(tokens), jnp.asarray(mask), cache_dtype=jnp.float32,
                                decode_block=None)
  table, pool = np.asarray(state.prompts.table), np.asarray(state.cache.keys)  # [K, L, Q, Pq, Tg, H]
  for p, prompt in enumerate(PROMPTS):
    for t in range(int(state.prompts.done[p])):
      page = table[p, t // 4]
      padded = np.asarray(prefilled.keys)[:, p, :, tokens.shape[1] - len(prompt) + t]  # [L, K, H]
      np.testing.assert_allclose(pool[:, :, p // 2, page, t % 4], padded.swapaxes(0, 1), atol=1e-5)


# make test: chunks of 1 and 3 tokens (3: chunks that straddle the 4-token pages); make test-slow adds 16, for time.
# For time (12 s, 19 s): make test prefills in chunks of 3 against the unbudgeted rollout (test_partial_rollout.py)
# and a chunk over int8 pages against the reference (test_kv_int8.py).
@pytest.mark.parametrize("sizes", [pytest.param((1, 3), marks=pytest.mark.slow),
                                   pytest.param((1, 3, 16), marks=pytest.mark.slow)],
                         ids=["1-3", "1-3-16"])
def test_chunked_prefill_equals_whole_prefill(model, sizes):
  """Prompts of 3 to 21 tokens (a 32-token bucket) prefilled through the pages in chunks of `sizes` tokens: the
  tokens of the static engine's whole prefill exactly and its log-probs within 1e-5 in float32, the same prompt
  tokens prefilled, in more chunks the smaller the chunk."""
  prompts = [p * 3 for p in PROMPTS]
  static, _ = sample(model, prompts, STATIC, samples_per_prompt=3, key=3, **SAMPLING)
  paged = RolloutConfig(slots=6, page_tokens=4, block_pages=2, decode_steps_per_call=4, shrink_slots=False)
  chunks, tokens = [], []
  for chunk in sizes:
    out, metrics = sample(model, prompts, dataclasses.replace(paged, prefill_chunk=chunk),
                          samples_per_prompt=3, key=3, **SAMPLING)
    assert_same(out, static)
    chunks.append(metrics["rollout/prefill_chunks"])
    tokens.append(metrics["rollout/prefill_tokens"])
    assert metrics["rollout/queue_pages_free_after"] == metrics["rollout/queue_pages"]
  assert len(set(tokens)) == 1 and all(a > b for a,
                                       b in zip(chunks, chunks[1:])) and chunks[-1] > len(prompts), (
      chunks, tokens)


@pytest.mark.slow  # For time (19 s): make test runs aime's rehearsal, which preempts and gets every page back.
def test_preemption_restarts_sequences_with_the_same_tokens(model):
  """6 slots over 10 pages of 4 tokens (the 4 prompts hold 5; one sequence needs at most 4 more, 6 would need 24):
  the engine preempts the latest-started sequences again and again, restarts them from their prompts, and
  samples the static engine's tokens, log-probs and lengths; every page is free at the end."""
  static, _ = sample(model, PROMPTS, STATIC, samples_per_prompt=3, key=3, **SAMPLING)
  tight = RolloutConfig(slots=6, decode_steps_per_call=3, pages=10, page_tokens=4, block_pages=2)
  refilled, metrics = sample(model, PROMPTS, tight, samples_per_prompt=3, key=3, **SAMPLING)
  assert_same(refilled, static)
  assert metrics["rollout/preemptions"] >= 2 and metrics["rollout/recomputed_tokens"] > 0
  assert metrics["rollout/queue_pages_free_after"] == 10 and metrics["rollout/queue_pages_peak"] == 10
  roomy, roomy_metrics = sample(model, PROMPTS, dataclasses.replace(tight, pages=None), samples_per_prompt=3,
                                key=3, **SAMPLING)
  assert_same(roomy,
              static)  # Pages for every slot at the cap: nothing preempted, and the queue's own replay.
  assert roomy_metrics["rollout/preemptions"] == 0 and roomy_metrics["rollout/recomputed_tokens"] == 0
  lengths = np.asarray(static.response_lengths)
  assert roomy_metrics["rollout/decode_steps"] == queue_steps(lengths, 6) < metrics["rollout/decode_steps"]
  assert roomy_metrics["rollout/queue_pages_free_after"] == roomy_metrics["rollout/queue_pages"]


def test_a_pool_that_cannot_hold_one_sequence_is_refused_naming_the_setting(model):
  tight = RolloutConfig(slots=6, pages=5, page_tokens=4)  # The longest prompt's 2 + 4 for one sequence.
  with pytest.raises(MemoryError, match=r"pool of 5 pages of 4 tokens per queue cannot hold its longest "
                                        r"prompt "
                                        r"\(2 pages\) and one 10-token response \(6 pages in all\): set "
                                        r"rollout.pages=6 or more"):
    sample(model, PROMPTS, tight, samples_per_prompt=3, key=3, **SAMPLING)


@pytest.mark.slow  # For time (10 s): make test preempts in a pool of a few sequences (test_preemption_restarts_…).
def test_a_pool_of_one_sequence_runs_them_one_at_a_time(model):
  tight = RolloutConfig(slots=6, pages=6, page_tokens=4)  # The longest prompt's 2 + 4 for one sequence.
  refilled, metrics = sample(model, PROMPTS, tight, samples_per_prompt=3, key=3, **SAMPLING)
  assert_same(refilled,
              sample(model, PROMPTS, STATIC, samples_per_prompt=3, key=3, **SAMPLING)[0])  # One at a time.
  assert metrics["rollout/queue_pages_free_after"] == 6 and metrics["rollout/prefills"] > len(PROMPTS)


@pytest.mark.slow  # For time (4 s): the benchmark's baseline engine, not the run's.
def test_the_contiguous_reference_engine_samples_the_static_tokens(model):
  """The contiguous refill engine (each slot owning prompt + cap tokens), the benchmark's baseline."""
  static, _ = sample(model, PROMPTS, STATIC, samples_per_prompt=3, key=3, **SAMPLING)
  tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
  spec = common.Sampling(max_response_tokens=10, stop_token_ids=(EOS,), **SAMPLING)
  out, steps, _ = contiguous.generate_contiguous(model, tokens, mask, jax.random.key(3), sampling=spec,
                                                 samples_per_prompt=3, slots=5, steps_per_call=3, min_slots=1)
  assert_same(out, static)
  assert steps == queue_steps(np.asarray(static.response_lengths), 5)


@pytest.mark.slow  # For time (16 s): make test replays a preempting pool's schedule against the engine (test_refill).
def test_the_roofline_schedule_replays_the_engine(model):
  """`rollout/refill/replay.simulate` (the roofline's model of the decode loop) gives the engine's decode steps, row
  steps, preemptions, recomputed tokens and peak pages on the engine's own lengths, with and without preemption."""
  from vapo_jax.rollout.refill import replay

  static, _ = sample(model, PROMPTS, STATIC, samples_per_prompt=3, key=3, **SAMPLING)
  lengths = np.asarray(static.response_lengths)
  for pool in (10, None):
    engine = RolloutConfig(slots=6, decode_steps_per_call=3, pages=pool, page_tokens=4, block_pages=2)
    _, metrics = sample(model, PROMPTS, engine, samples_per_prompt=3, key=3, **SAMPLING)
    load = replay.simulate(lengths, np.array([len(p) for p in PROMPTS]), samples_per_prompt=3, slots=6,
                           min_slots=1,
                           paged=replay.Paged(int(metrics["rollout/queue_pages"]), 4, 2, lanes=4, chunk=16))
    assert load.steps == metrics["rollout/decode_steps"], pool
    assert lengths.sum() / load.rows.sum() == pytest.approx(metrics["rollout/slot_utilization"]), pool
    assert (load.preemptions, load.recomputed_tokens, load.peak_pages, load.prefills, load.chunks.sum(),
            load.prefill_tokens.sum()) == (
        metrics["rollout/preemptions"], metrics["rollout/recomputed_tokens"],
        metrics["rollout/queue_pages_peak"], metrics["rollout/prefills"], metrics["rollout/prefill_chunks"],
        metrics["rollout/prefill_tokens"]), pool
