"""The refill engine samples exactly what the static engine samples, sequence by sequence."""

import heapq
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_utils import FIXTURES
from vapo_jax import generation, refill, rollout
from vapo_jax.models import checkpoint, sharding
from vapo_jax.models.transformer import positions_from_mask

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [40], [3, 3, 8, 21]]
EOS = 2


@pytest.fixture(scope="module")
def model():
  return checkpoint.load_causal_lm(str(FIXTURES / "qwen2_untied"))


def sample(model, prompts, engine, *, group, key=0, limits=None, **settings):
  spec = rollout.Sampling(**({"max_new_tokens": 10, "stop_token_ids": (EOS,)} | settings))
  tokens, mask = rollout.pad_prompts(prompts, pad_id=0)
  return generation.sample(model, tokens, mask, jax.random.key(key), sampling=spec, samples_per_prompt=group,
                        engine=engine, pad_id=0, length_limits=limits)


def assert_same(refilled: rollout.Rollout, static: rollout.Rollout):
  for field in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "response_lengths",
                "finish_reason"):
    np.testing.assert_array_equal(getattr(refilled, field), getattr(static, field), err_msg=field)
  for field in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(refilled, field), getattr(static, field), atol=1e-5, err_msg=field)


def queue_steps(lengths, slots: int) -> int:
  """Decode iterations of a queue served in order by `slots` slots (a free slot takes the next at once)."""
  free = [0] * slots
  for length in lengths:
    heapq.heappush(free, heapq.heappop(free) + int(length))
  return max(free)


@jax.jit
def _first_greedy_token(model, tokens, mask):
  return jnp.argmax(model(tokens, positions_from_mask(mask), mask)[0][:, -1], -1)


# greedy: prompt 1's first greedy token is also a stop token, so its 3 samples end at the first
# step; temperature: no stop tokens, every sequence runs to the length limit; filters: EOS stops.
CASES = {"greedy-stop-at-first-step": dict(temperature=0.0),
         "temperature-all-at-limit": dict(temperature=0.7, stop_token_ids=()),
         "top-k-top-p": dict(temperature=1.3, top_k=5, top_p=0.8)}


@pytest.mark.parametrize("case", CASES)
def test_refill_equals_static(model, case):
  settings = dict(CASES[case])
  if case.startswith("greedy"):
    tokens, mask = rollout.pad_prompts(PROMPTS, pad_id=0)
    settings["stop_token_ids"] = (EOS, int(_first_greedy_token(model, tokens, mask)[1]))
  static, static_metrics = sample(model, PROMPTS, generation.Engine(kind="static"), group=3, key=3, **settings)
  engine = generation.Engine(kind="refill", slots=5, steps_per_call=3)  # 12 sequences; several host calls.
  refilled, metrics = sample(model, PROMPTS, engine, group=3, key=3, **settings)
  assert_same(refilled, static)
  lengths = np.asarray(static.response_lengths)
  if case.startswith("greedy"):
    assert lengths[3:6].tolist() == [1, 1, 1] and np.all(np.asarray(static.finish_reason)[3:6] == rollout.FINISH_STOP)
  if case.startswith("temperature"):
    assert np.all(lengths == 10) and np.all(np.asarray(static.finish_reason) == rollout.FINISH_LENGTH)
  if case.startswith("top"):
    assert 0 < np.mean(lengths < 10) < 1
  assert metrics["rollout/decode_steps"] == queue_steps(lengths, 5) and metrics["rollout/slots"] == 5
  assert metrics["rollout/slot_utilization"] == pytest.approx(lengths.sum() / (5 * queue_steps(lengths, 5)))
  for name in ("rollout/response_len_p50", "rollout/response_len_p90", "rollout/finish_stop_frac"):
    assert metrics[name] == static_metrics[name]


def test_fewer_sequences_than_slots_and_length_limits(model):
  """4 sequences in 6 slots (2 never used), with per-sequence length limits 3, 10, 1, 7."""
  spec = rollout.Sampling(max_new_tokens=10, stop_token_ids=(EOS,), temperature=1.0)
  tokens, mask = rollout.pad_prompts(PROMPTS, pad_id=0)
  limits = jnp.asarray([3, 10, 1, 7], jnp.int32)
  static = rollout.make_generate(sampling=spec, samples_per_prompt=1, pad_id=0)(
      model, tokens, mask, jax.random.key(9), 0, limits)
  refilled, steps = refill.generate(model, tokens, mask, jax.random.key(9), sampling=spec, samples_per_prompt=1,
                                    slots=6, steps_per_call=4, length_limits=limits)
  assert_same(refilled, static)
  lengths = np.asarray(static.response_lengths)
  assert np.all(lengths <= np.asarray(limits)) and lengths[2] == 1 and steps == lengths.max()
  at_limit = lengths == np.asarray(limits)
  assert np.all(np.asarray(static.finish_reason)[at_limit & ~np.isin(np.asarray(static.response_tokens)[
      np.arange(4), lengths - 1], [EOS])] == rollout.FINISH_LENGTH)


def test_sharded_refill_equals_unsharded(model):
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]]
  engine = generation.Engine(kind="refill", slots=8, steps_per_call=4)  # 16 sequences in 8 slots, one per device.
  expected, _ = sample(model, prompts, engine, group=2, key=5, max_new_tokens=8)
  mesh = sharding.make_mesh(data=8)
  rules = sharding.PRESETS["dp"]
  sharded_model = sharding.shard_module(model, mesh, rules)
  rows = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  place = lambda tree: jax.tree.map(lambda x: jax.device_put(x, rows), tree)
  spec = rollout.Sampling(max_new_tokens=8, stop_token_ids=(EOS,))
  tokens, mask = rollout.pad_prompts(prompts, pad_id=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out, _ = generation.sample(sharded_model, tokens, mask, jax.random.key(5), sampling=spec, samples_per_prompt=2,
                            engine=engine, pad_id=0, jit=lambda fn, **kw: sharding.jit(fn, mesh, rules, **kw),
                            place=place)
  assert len(out.response_tokens.sharding.device_set) == 8
  assert_same(out, expected)


def test_engine_from_config_fits_slots_to_the_budget():
  from vapo_jax.config import RolloutConfig
  from vapo_jax.models.config import preset

  cfg = preset("qwen2.5-32b")
  per_sequence = rollout.cache_bytes(cfg, batch=1, prompt_tokens=1024, max_new_tokens=20480, dtype=jnp.bfloat16)
  r = RolloutConfig(max_response_tokens=20480, kv_cache_budget_gib=40.0)
  engine = generation.engine_for(r, cfg, sequences=8192, prompt_tokens=1024, dtype=jnp.bfloat16, devices=256)
  assert engine.kind == "refill" and engine.slots == 256 * (40 * 2**30 // per_sequence) and engine.slots % 256 == 0
  assert rollout.cache_bytes(cfg, batch=engine.slots, prompt_tokens=1024, max_new_tokens=20480, dtype=jnp.bfloat16,
                             devices=256) <= 40 * 2**30
  small = generation.engine_for(r, cfg, sequences=300, prompt_tokens=1024, dtype=jnp.bfloat16, devices=256)
  assert small.slots == 512  # Every sequence fits: 2 per device (300 rounded up), nothing to refill.
  fixed = generation.engine_for(RolloutConfig(slots=64, decode_steps_per_call=32, decode_block=128), cfg,
                                sequences=8192, prompt_tokens=1024, dtype=jnp.bfloat16, devices=256)
  assert fixed == generation.Engine(kind="refill", slots=64, steps_per_call=32, decode_block=128)
  static = generation.engine_for(RolloutConfig(engine="static", prompts_per_generation=8), cfg, sequences=8192,
                                 prompt_tokens=1024, dtype=jnp.bfloat16, devices=256)
  assert static == generation.Engine(kind="static", prompts_per_round=8)
  with pytest.raises(MemoryError, match="lower rollout"):
    generation.engine_for(RolloutConfig(kv_cache_budget_gib=1.0), cfg, sequences=8192, prompt_tokens=1024,
                          dtype=jnp.bfloat16, devices=256)
