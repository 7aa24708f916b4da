"""The refill engine samples exactly what the static engine samples, sequence by sequence."""

import dataclasses
import heapq
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import EOS, PROMPTS, place_module, training_layout_model
from vapo_jax import rollout
from vapo_jax.config import RolloutConfig
from vapo_jax.models import sharding
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rollout import common
from vapo_jax.rollout.layout import layout_for
from vapo_jax.rollout.refill import engine as refill
from vapo_jax.rollout.refill import replay
from vapo_jax.rollout.static import make_generate
from vapo_jax.roofline import decode_cost

STATIC = RolloutConfig(engine="static")


def plan(model, prompts, config: RolloutConfig, *, samples_per_prompt: int, max_response_tokens: int = 10,
         devices: int = 1, **options):
  """`config`'s plan for `prompts` (token lists) × `samples_per_prompt` at this length cap on `devices`
  data-parallel groups, its pool checked against the prompts' own lengths (as `responses.generate_responses`
  plans); `options`: `plan_rollout`'s (`budgeted=True`: the refill engine whatever the sizes)."""
  config = dataclasses.replace(config, max_response_tokens=max_response_tokens)
  return rollout.plan_rollout(config, model.cfg, prompts=len(prompts), samples_per_prompt=samples_per_prompt,
                              dtype=jnp.float32, devices=devices,
                              prompt_tokens=common.prompt_bucket(max(map(len, prompts))),
                              prompt_lengths=np.array([len(p) for p in prompts]), **options)


def sample(model, prompts, config: RolloutConfig, *, samples_per_prompt, key=0, limits=None, devices: int = 1,
           **settings):
  """`rollout.sample` with `config`'s plan (`plan`), the sampler's `settings`; (rollout, metrics)."""
  spec = common.Sampling(**({"max_response_tokens": 10, "stop_token_ids": (EOS,)} | settings))
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  chosen = plan(model, prompts, config, samples_per_prompt=samples_per_prompt,
                max_response_tokens=spec.max_response_tokens, devices=devices)
  return rollout.sample(model, tokens, mask, jax.random.key(key), sampling=spec, plan=chosen, pad_id=0,
                        length_limits=limits)


def assert_same(refilled: common.Rollout, static: common.Rollout, *, rtol: float = 0.0):
  for field in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "response_lengths",
                "finish_reason"):
    np.testing.assert_array_equal(getattr(refilled, field), getattr(static, field), err_msg=field)
  for field in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(refilled, field), getattr(static, field), atol=1e-5, rtol=rtol,
                               err_msg=field)


def queue_steps(lengths, slots: int) -> int:
  """Decode iterations of a queue served in order by `slots` slots (a free slot takes the next at once)."""
  free = [0] * slots
  for length in lengths:
    heapq.heappush(free, heapq.heappop(free) + int(length))
  return max(free)


def queue_row_steps(lengths, slots: int, min_slots: int, queues: int = 1) -> int:
  """Σ rows × iterations of that queue (or of `queues` queues, each serving its own contiguous share of
  the sequences in its own rows / queues slots) when the rows shrink in its tail: sizes are
  min_slots·2^k; after an iteration that leaves the queues empty and the rows that hold the live
  sequences (queues × the fullest queue's) at most the largest size ≤ rows / 2, the rows become the
  smallest size holding them. Step by step, from the definition."""
  sizes = [min_slots * 2**k for k in range(16)] if min_slots else []
  share = len(lengths) // queues
  waiting = [list(map(int, lengths[q * share:(q + 1) * share])) for q in range(queues)]
  running, rows, total = [[] for _ in range(queues)], slots, 0
  while any(waiting) or any(running):
    for q in range(queues):
      while waiting[q] and len(running[q]) < rows // queues:
        running[q].append(waiting[q].pop(0))
    total += rows
    running = [[r - 1 for r in part if r > 1] for part in running]
    needed = queues * max(map(len, running))
    below_half = [size for size in sizes if 2 * size <= rows]
    if not any(waiting) and needed and below_half and needed <= max(below_half):
      rows = min(size for size in sizes if size >= needed)
  return total


@jax.jit
def _first_greedy_token(model, tokens, mask):
  return jnp.argmax(model(tokens, positions_from_mask(mask), mask)[0][:, -1], -1)


# greedy: prompt 1's first greedy token is also a stop token, so its 3 samples end at the first
# step; temperature: no stop tokens, every sequence runs to the length limit; filters: EOS stops.
CASES = {"greedy-stop-at-first-step": dict(temperature=0.0),
         "temperature-all-at-limit": dict(temperature=0.7, stop_token_ids=()),
         "top-k-top-p": dict(temperature=1.3, top_k=5, top_p=0.8)}


# make test-slow, for time (16 s): make test holds the refill engine to the static one's tokens and log-probs
# with top-k and top-p, whole pools and preempting ones
# (test_pages.py::test_preemption_restarts_sequences_with_…).
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_refill_equals_static(model, case):
  settings = dict(CASES[case])
  if case.startswith("greedy"):
    tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
    settings["stop_token_ids"] = (EOS, int(_first_greedy_token(model, tokens, mask)[1]))
  static, static_metrics = sample(model, PROMPTS, STATIC, samples_per_prompt=3, key=3, **settings)
  engine = RolloutConfig(slots=5, decode_steps_per_call=3)  # 12 sequences; several host calls.
  refilled, metrics = sample(model, PROMPTS, engine, samples_per_prompt=3, key=3, **settings)
  assert_same(refilled, static)
  lengths = np.asarray(static.response_lengths)
  if case.startswith("greedy"):
    assert lengths[3:6].tolist() == [1, 1,
                                     1] and np.all(np.asarray(static.finish_reason)[3:6] == common.FINISH_STOP)
  if case.startswith("temperature"):
    assert np.all(lengths == 10) and np.all(np.asarray(static.finish_reason) == common.FINISH_LENGTH)
  if case.startswith("top"):
    assert 0 < np.mean(lengths < 10) < 1
  assert metrics["rollout/decode_steps"] == queue_steps(lengths, 5) and metrics["rollout/slots"] == 5
  # The default engine shrinks 5 slots to 2, then 1 (min_slots 1) in the tail.
  row_steps = queue_row_steps(lengths, 5, 1)
  assert metrics["rollout/slot_utilization"] == pytest.approx(lengths.sum() / row_steps)
  assert row_steps < 5 * queue_steps(lengths, 5) or np.all(lengths == lengths[0])
  fixed, fixed_metrics = sample(model, PROMPTS, dataclasses.replace(engine, shrink_slots=False),
                                samples_per_prompt=3, key=3, **settings)
  assert_same(fixed, static)
  assert fixed_metrics["rollout/slot_utilization"] == pytest.approx(lengths.sum() / (5 * queue_steps(lengths,
                                                                                                     5)))
  for name in ("rollout/response_len_p50", "rollout/response_len_p90", "rollout/finish_stop_frac"):
    assert metrics[name] == static_metrics[name]


@pytest.mark.slow  # For time (half a minute).
def test_fewer_sequences_than_slots_and_length_limits(model):
  """4 sequences with 6 slots asked (the plan gives 4), with per-sequence length limits 3, 10, 1, 7: the rows
  shrink in the tail as the queue empties."""
  spec = common.Sampling(max_response_tokens=10, stop_token_ids=(EOS,), temperature=1.0)
  tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
  limits = jnp.asarray([3, 10, 1, 7], jnp.int32)
  static = make_generate(sampling=spec, samples_per_prompt=1, pad_id=0)(
      model, tokens, mask, jax.random.key(9), 0, limits)
  chosen = plan(model, PROMPTS, RolloutConfig(slots=6, pages=40, page_tokens=4, decode_steps_per_call=4),
                samples_per_prompt=1, budgeted=True)
  refilled, steps, row_steps, figures = refill.generate_refill(
      model, tokens, mask, jax.random.key(9), plan=chosen, sampling=spec, length_limits=limits)
  assert_same(refilled, static)
  lengths = np.asarray(static.response_lengths)
  assert np.all(lengths <= np.asarray(limits)) and lengths[2] == 1 and steps == lengths.max()
  assert chosen.slots == 4  # 6 asked: the plan gives no more slots than sequences.
  assert row_steps == queue_row_steps(lengths, chosen.slots, chosen.min_slots) < 4 * steps
  assert figures["rollout/preemptions"] == 0 and figures["rollout/queue_pages_free_after"] == 40
  at_limit = lengths == np.asarray(limits)
  assert np.all(np.asarray(static.finish_reason)[at_limit & ~np.isin(np.asarray(static.response_tokens)[
      np.arange(4), lengths - 1], [EOS])] == common.FINISH_LENGTH)


# For time (19 s each): make test runs the refill engine sharded in aime's rehearsal (tensor-parallel groups,
# fsdp_tp).
@pytest.mark.parametrize("slots",
                         [pytest.param(8, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_sharded_refill_equals_unsharded(model, slots):
  """16 sequences in 8 slots (one per device) / 32 sequences of lengths ≤ 1..8 in 16 slots, shrinking to 8 in
  the tail: 8 data-parallel groups, a queue each, split over 8 devices; the static engine's tokens on one."""
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]] + [[4, 5],
                                                                          [6]] * (4 if slots == 16 else 0)
  limits = None if slots == 8 else np.arange(2 * len(prompts), dtype=np.int32) % 8 + 1
  engine = RolloutConfig(slots=slots, decode_steps_per_call=4)
  chosen = plan(model, prompts, engine, samples_per_prompt=2, max_response_tokens=8, devices=8)
  assert (chosen.engine, chosen.queues, chosen.min_slots) == ("refill", 8, 8)
  expected, _ = sample(model, prompts, STATIC, samples_per_prompt=2, key=5, max_response_tokens=8,
                       limits=limits)
  lengths = np.asarray(expected.response_lengths)
  mesh = sharding.make_mesh(data=8)
  rules = sharding.PRESETS["dp"]
  sharded_model = place_module(model, mesh, rules)
  place = lambda tree: sharding.place(tree, mesh, rules)
  spec = common.Sampling(max_response_tokens=8, stop_token_ids=(EOS,))
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out, sharded_metrics = rollout.sample(
        sharded_model, tokens, mask, jax.random.key(5), sampling=spec, plan=chosen, pad_id=0,
        jit=lambda fn, **kw: sharding.jit(fn, mesh, rules, **kw), place=place, length_limits=limits)
  assert len(out.response_tokens.sharding.device_set) == 8
  assert_same(out, expected)
  row_steps = queue_row_steps(lengths, slots, 8, queues=8)
  assert sharded_metrics["rollout/slot_utilization"] == pytest.approx(lengths.sum() / row_steps)
  assert (row_steps < slots * sharded_metrics["rollout/decode_steps"]) == (slots == 16)  # 16 slots shrink to 8.


def test_fewer_queues_than_groups_share_a_pool_the_plan_and_the_engine_agree_on(model):
  """2 prompts over 4 data-parallel groups: 2 queues (the most dividing the groups and the prompts), each
  holding half of a group's pages (the pool is replicated over the groups); the engine allocates what the plan
  says, the pool runs short and preempts, and the rollout is the static engine's; the roofline's replay of the
  plan's queues gives the engine's schedule."""
  prompts = PROMPTS[:2]
  least = plan(model, prompts, RolloutConfig(slots=4, pages=1000, page_tokens=4), samples_per_prompt=3,
               devices=4).least_pages
  config = RolloutConfig(slots=4, pages=2 * least, page_tokens=4, decode_steps_per_call=3)
  chosen = plan(model, prompts, config, samples_per_prompt=3, devices=4)
  assert (chosen.engine, chosen.queues, chosen.pages, chosen.queue_pages) == ("refill", 2, 2 * least, least)
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  spec = common.Sampling(max_response_tokens=10, stop_token_ids=(EOS,), temperature=1.3, top_k=5)
  fns = chosen.programs(sampling=spec, pad_id=0, cache_dtype=jnp.float32, jit=jax.jit)
  state = fns.start(model, tokens, mask)
  assert state.cache.keys.shape[2:4] == (2, least) and state.free.stack.shape == (2, least)
  out, metrics = sample(model, prompts, config, samples_per_prompt=3, key=4, devices=4, temperature=1.3,
                        top_k=5)
  static, _ = sample(model, prompts, STATIC, samples_per_prompt=3, key=4, temperature=1.3, top_k=5)
  assert_same(out, static)
  assert metrics["rollout/queue_pages"] == least and metrics["rollout/queue_pages_free_after"] == least
  assert metrics["rollout/preemptions"] > 0
  # The roofline's schedule of the same plan (each queue replayed on its own share of the sequences, as
  # `roofline/decode_cost.paged` replays one): the engine's decode steps, preemptions and peak pages.
  lengths, share = np.asarray(static.response_lengths), len(prompts) * 3 // chosen.queues
  loads = [replay.simulate(lengths[q * share:(q + 1) * share], np.array([len(p) for p in prompts])[
      q * share // 3:(q + 1) * share // 3], samples_per_prompt=3, slots=chosen.slots // chosen.queues,
      min_slots=chosen.min_slots // chosen.queues, paged=decode_cost.paged_settings(chosen))
      for q in range(chosen.queues)]
  assert (max(x.steps for x in loads), sum(x.preemptions for x in loads),
          max(x.peak_pages for x in loads)) == (
      metrics["rollout/decode_steps"], metrics["rollout/preemptions"], metrics["rollout/queue_pages_peak"])


def test_the_plan_fits_slots_and_pages_to_the_budget():
  """The pool per data-parallel group is what `kv_cache_budget_gib` holds per chip (pages of 128 tokens split
  by KV heads over a group's chips), the default slots what it holds with every response at the cap beside the
  prompts in flight; the pages shrink to what the slots need when every sequence has a slot."""
  from vapo_jax.models.config import preset
  from vapo_jax.models.kv_cache import KVCache

  cfg = preset("qwen2.5-32b")
  page_bytes = 128 * KVCache.bytes_per_token(cfg,
                                             jnp.bfloat16) // 8  # A group of 8 chips splits the KV heads.
  r = RolloutConfig(max_response_tokens=20480, kv_cache_budget_gib=40.0, tensor_parallel=8, page_tokens=128)
  on = lambda config, prompts=512, samples_per_prompt=16, devices=32, **options: rollout.plan_rollout(
      config, cfg, prompts=prompts, samples_per_prompt=samples_per_prompt, prompt_tokens=1024,
      dtype=jnp.bfloat16, devices=devices, **options)
  chosen = on(r)
  pages = 40 * 2**30 // page_bytes
  per_sequence, prompt_pages, lanes = 20480 // 128 + 1, 1024 // 128, 4  # 16 prompts of 8 pages per group.
  assert chosen.engine == "refill" and chosen.queues == 32 and chosen.page_tokens == 128 and chosen.lanes == lanes
  # Slots at the cap beside the prompts in flight: one per 16 slots (their group) and one per prefill lane.
  per_group = (pages - lanes * prompt_pages) * 16 // (per_sequence * 16 + prompt_pages)
  assert chosen.slots == 32 * per_group  # The pages those slots need at the cap, and no more:
  in_flight = min(16, -(-per_group // 16) + lanes) * prompt_pages
  assert chosen.pages == chosen.queue_pages == in_flight + per_group * per_sequence <= pages
  assert chosen.least_pages == prompt_pages + per_sequence
  fits = lambda **call: on(r, prompts=32, samples_per_prompt=8,
                           **call)  # 256 sequences: 8 a group, each with a slot...
  assert fits().engine == "static"  # ...and the pool holds them all at the cap: nothing to refill or page.
  assert fits(budgeted=True).pages == 8 * per_sequence + 1024 // 128  # Refilled anyway: only their pages.
  small = on(r, prompts=20,
             samples_per_prompt=15)  # 300 sequences of 20 prompts: 4 queues (dividing the prompts and the groups).
  assert (small.queues, small.slots, small.engine) == (4, 300, "refill")
  assert small.queue_pages == pages // 4 and small.pages == 4 * (pages // 4)  # Each device holds the 4 pools.
  fixed = on(RolloutConfig(slots=64, decode_steps_per_call=32, pages=5000, page_tokens=64))
  assert (fixed.slots, fixed.steps_per_call, fixed.min_slots, fixed.queues, fixed.pages, fixed.queue_pages,
          fixed.page_tokens) == (64, 32, 32, 32, 5000, 5000, 64)
  assert on(RolloutConfig(slots=64, shrink_slots=False)).min_slots == 0
  static = on(RolloutConfig(engine="static", prompts_per_generation=8), devices=256)
  assert (static.engine, static.prompts_per_round, static.rounds, static.decode_rows) == ("static", 8, 64,
                                                                                          128)
  with pytest.raises(MemoryError, match="pool of .* cannot hold .* raise rollout.kv_cache_budget_gib"):
    on(RolloutConfig(kv_cache_budget_gib=1.0), devices=256)
  with pytest.raises(MemoryError,
                     match="rollout.slots=60 does not split over the 32 .* set rollout.slots=64"):
    on(RolloutConfig(slots=60))


@pytest.mark.slow  # For time (20 s): make test rehearses aime's tensor-parallel refill (test_rehearsal.py).
def test_tensor_parallel_layout_equals_static():
  """The training layout fsdp (data 2 x fsdp 4) resharded into the rollout layout (data 2 x tensor 4): each
  group runs its own queue of 8 sequences (lengths ≤ 1..8) in 4 slots, shrinking to 1 per group in the tail,
  and samples the static engine's greedy tokens on one device, log-probs to float tolerance."""
  model, trained, mesh, rules = training_layout_model()
  config = RolloutConfig(tensor_parallel=4, slots=8, decode_steps_per_call=4, max_response_tokens=8,
                         samples_per_prompt=2, prompts_per_step=8)
  layout = layout_for(config, mesh, compute_dtype="float32", training_rules=rules)
  engine = rollout.plan_rollout(config, model.cfg, prompts=8, samples_per_prompt=2, prompt_tokens=16,
                                dtype=jnp.float32, devices=layout.data_devices)
  per_group = 4 * 1 + 4 * 2  # 4 prompts of one page; 4 slots of a response page and the last prompt page's copy.
  assert (engine.engine, engine.slots, engine.steps_per_call, engine.min_slots, engine.queues, engine.pages,
          engine.queue_pages) == ("refill", 8, 4, 2, 2, per_group, per_group)
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]]
  limits = (np.arange(16, dtype=np.int32) * 5) % 8 + 1
  expected, _ = sample(model, prompts, STATIC, samples_per_prompt=2, key=5, temperature=0.0,
                       max_response_tokens=8, limits=limits)
  graphdef, state = nnx.split(trained)
  spec = common.Sampling(max_response_tokens=8, stop_token_ids=(EOS,), temperature=0.0)
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out, metrics = rollout.sample(nnx.merge(graphdef, layout.reshard(state)), tokens, mask, jax.random.key(5),
                                  sampling=spec, plan=engine, pad_id=0, jit=layout.jit, place=layout.place,
                                  length_limits=limits)
  assert out.response_tokens.sharding.shard_shape(out.response_tokens.shape) == (8,
                                                                                 8)  # Split over the groups.
  assert_same(out, expected, rtol=1e-5)
  lengths = np.asarray(expected.response_lengths)
  assert metrics["rollout/decode_steps"] == max(queue_steps(lengths[:8], 4), queue_steps(lengths[8:], 4))
  row_steps = queue_row_steps(lengths, 8, 2, queues=2)
  assert row_steps < 8 * metrics["rollout/decode_steps"]  # The groups shrank.
  assert metrics["rollout/slot_utilization"] == pytest.approx(lengths.sum() / row_steps)
