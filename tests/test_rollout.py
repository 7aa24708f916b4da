"""Static rollout engine: greedy = uncached argmax, log-probs, group sampling, padding, stops, sharding,
metrics. (The refill engine is checked against it in test_refill.py.)"""

import dataclasses
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
from vapo_jax.models.config import preset
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rollout import common, next_token, static
from vapo_jax.rollout.layout import layout_for


def run(model, prompts, *, key=0, samples_per_prompt=1, engine=RolloutConfig(engine="static"), metrics=False,
        **sampling):
  sampling = common.Sampling(**({"max_response_tokens": 10, "stop_token_ids": (EOS,)} | sampling))
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  plan = static_plan(model, engine, tokens, samples_per_prompt, sampling.max_response_tokens)
  out, stats = rollout.sample(model, tokens, mask, jax.random.key(key), sampling=sampling, plan=plan,
                              pad_id=0)
  return (out, stats) if metrics else out


def static_plan(model, engine: RolloutConfig, tokens, samples_per_prompt: int,
                max_response_tokens: int) -> rollout.RolloutPlan:
  return rollout.plan_rollout(dataclasses.replace(engine, max_response_tokens=max_response_tokens), model.cfg,
                              prompts=tokens.shape[0], samples_per_prompt=samples_per_prompt,
                              prompt_tokens=tokens.shape[1], dtype=jnp.float32, devices=1)


@jax.jit
def _forward(model, tokens, mask):
  return model(tokens, positions_from_mask(mask), mask)[0][0]


def full_logits(model, sequence, length=32):
  """Uncached logits of one sequence (right-padded to a fixed length: causal, so harmless)."""
  tokens = np.zeros((1, length), np.int32)
  tokens[0, :len(sequence)] = sequence
  mask = np.arange(length)[None] < len(sequence)
  return np.asarray(_forward(model, tokens, mask))[:len(sequence)]


def test_greedy_equals_uncached_argmax(model):
  out = run(model, PROMPTS, temperature=0.0, max_response_tokens=12)
  compared = 0
  for b, prompt in enumerate(PROMPTS):
    sequence = list(prompt)
    for t in range(int(out.response_lengths[b])):
      logits = full_logits(model, sequence)[-1]
      top2 = np.sort(logits)[-2:]
      if top2[1] - top2[0] < 1e-4:
        break  # A near-tie: either token is a correct greedy choice.
      assert int(out.response_tokens[b, t]) == int(np.argmax(logits)), (b, t)
      sequence.append(int(np.argmax(logits)))
      compared += 1
  assert compared > 30


@pytest.mark.parametrize("temperature,top_k,top_p", [pytest.param(1.0, 0, 1.0, marks=pytest.mark.slow),
                                                     pytest.param(0.7, 0, 1.0, marks=pytest.mark.slow),
                                                     (1.3, 5, 0.8)])
def test_logprobs_match_full_forward(model, temperature, top_k, top_p):
  out = run(model, PROMPTS, temperature=temperature, top_k=top_k, top_p=top_p, key=3)
  for b, prompt in enumerate(PROMPTS):
    n = int(out.response_lengths[b])
    response = [int(t) for t in out.response_tokens[b, :n]]
    logits = full_logits(model, prompt + response)[len(prompt) - 1:len(prompt) - 1 + n]
    policy = jax.nn.log_softmax(logits, -1)[np.arange(n), response]
    np.testing.assert_allclose(out.policy_logprobs[b, :n], policy, atol=1e-4)
    processed = next_token.filter_logits_sorted(jnp.asarray(logits), temperature=temperature, top_k=top_k,
                                                top_p=top_p)
    sampler = jax.nn.log_softmax(processed, -1)[np.arange(n), response]
    np.testing.assert_allclose(out.sampler_logprobs[b, :n], sampler, atol=1e-4)
    assert np.all(np.isfinite(sampler))  # A sampled token is never one the filter removed.
    assert not np.any(out.policy_logprobs[b, n:]) and not np.any(out.sampler_logprobs[b, n:])
  if (temperature, top_k, top_p) == (1.0, 0, 1.0):
    np.testing.assert_allclose(out.sampler_logprobs, out.policy_logprobs, atol=1e-6)


@pytest.mark.parametrize("filter_fn", [next_token.filter_logits, next_token.filter_logits_sorted],
                         ids=["bisection", "sort"])
def test_filter_logits_reference(filter_fn):
  logits = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]], np.float32)
  top_k = np.asarray(filter_fn(jnp.asarray(logits), temperature=1.0, top_k=3, top_p=1.0))
  assert np.isfinite(top_k).sum() == 3 and set(np.flatnonzero(np.isfinite(top_k[0]))) == {0, 1, 5}
  probs = np.exp(logits[0] - logits[0].max()) / np.exp(logits[0] - logits[0].max()).sum()
  order = np.argsort(-probs)
  keep = order[:np.searchsorted(np.cumsum(probs[order]), 0.8) + 1]  # Smallest set with mass ≥ 0.8.
  top_p = np.asarray(filter_fn(jnp.asarray(logits), temperature=1.0, top_k=0, top_p=0.8))
  assert set(np.flatnonzero(np.isfinite(top_p[0]))) == set(keep.tolist()) == {0, 5}
  scaled = filter_fn(jnp.asarray(logits), temperature=2.0, top_k=0, top_p=1.0)
  np.testing.assert_allclose(scaled, logits / 2.0)


def test_group_sampling_shares_prefill_exactly(model):
  samples_per_prompt = 3
  shared = run(model, PROMPTS, samples_per_prompt=samples_per_prompt, key=7)
  repeated = run(model, [p for p in PROMPTS for _ in range(samples_per_prompt)], samples_per_prompt=1, key=7)
  np.testing.assert_array_equal(shared.response_tokens, repeated.response_tokens)
  np.testing.assert_array_equal(shared.response_lengths, repeated.response_lengths)
  np.testing.assert_allclose(shared.policy_logprobs, repeated.policy_logprobs, atol=1e-5)
  # The G samples of one prompt differ from each other.
  assert len({tuple(np.asarray(r)) for r in shared.response_tokens[:samples_per_prompt]}) > 1


def test_deterministic_for_a_key(model):
  a, b, c = run(model, PROMPTS, key=1), run(model, PROMPTS, key=1), run(model, PROMPTS, key=2)
  np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
  assert not np.array_equal(a.response_tokens, c.response_tokens)


def test_padding_and_batchmates_change_nothing(model):
  alone = run(model, [PROMPTS[2]], temperature=0.0)
  together = run(model, PROMPTS, temperature=0.0)
  np.testing.assert_array_equal(alone.response_tokens[0], together.response_tokens[2])
  np.testing.assert_allclose(alone.policy_logprobs[0], together.policy_logprobs[2], atol=1e-5)
  assert together.prompt_tokens.shape[1] == 16 and not together.prompt_mask[2, :15].any()


def test_stop_at_first_step_and_length_limit(model):
  greedy = run(model, PROMPTS, temperature=0.0, stop_token_ids=())
  assert np.all(greedy.finish_reason == common.FINISH_LENGTH) and np.all(greedy.response_lengths == 10)
  assert np.all(greedy.response_mask)
  first = int(greedy.response_tokens[1, 0])  # Make prompt 1's first greedy token a stop token.
  out = run(model, PROMPTS, temperature=0.0, stop_token_ids=(first,))
  assert int(out.response_lengths[1]) == 1 and int(out.finish_reason[1]) == common.FINISH_STOP
  assert out.response_mask[1].tolist() == [True] + [False] * 9
  assert int(out.response_tokens[1, 0]) == first and not np.any(out.response_tokens[1, 1:])
  for b in (0, 2, 3):  # Other rows run on; each stops at its own first stop token or at the limit.
    row = greedy.response_tokens[b].tolist()
    expected = row.index(first) + 1 if first in row else 10
    assert int(out.response_lengths[b]) == expected


def test_stops_early_when_all_done(model):
  out = run(model, [PROMPTS[1]], temperature=0.0, max_response_tokens=50, stop_token_ids=tuple(range(97)))
  assert int(out.response_lengths[0]) == 1 and out.response_tokens.shape == (1, 50)


@pytest.mark.parametrize("preset_name,mesh_shape", [pytest.param("dp", dict(data=8), marks=pytest.mark.slow),
                                                    ("fsdp_tp", dict(data=2, fsdp=2, tensor=2))])
def test_sharded_equals_unsharded(model, preset_name, mesh_shape):
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]]
  expected = run(model, prompts, key=5, max_response_tokens=8)
  mesh = sharding.make_mesh(**mesh_shape)
  rules = sharding.PRESETS[preset_name]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fsdp_tp replicates the 97-entry vocabulary (not divisible by 2).
    sharded_model = place_module(model, mesh, rules)
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  data = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  fn = static.make_generate(sampling=common.Sampling(max_response_tokens=8, stop_token_ids=(EOS,)),
                             samples_per_prompt=1, pad_id=0)
  with sharding.use_rules(mesh, rules), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = fn(sharded_model, jax.device_put(tokens, data), jax.device_put(mask, data), jax.random.key(5))
  assert len(out.response_tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(out.response_tokens, expected.response_tokens)
  np.testing.assert_allclose(out.policy_logprobs, expected.policy_logprobs, atol=1e-5)


@pytest.mark.slow  # make test covers the layout: test_refill.py::test_tensor_parallel_layout_equals_static.
@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=1.3, top_k=5, top_p=0.8)],
                         ids=["greedy", "top-k-top-p"])
def test_tensor_parallel_layout_equals_unsharded(settings):
  """The training layout fsdp (data 2 x fsdp 4) resharded into the rollout layout (data 2 x tensor 4: heads,
  MLP and the 264-entry vocabulary split over 4 chips, the KV cache by its 4 heads): the static engine
  samples the tokens it samples on one device, log-probs to float tolerance. make test covers the layout
  with test_refill.py::test_tensor_parallel_layout_equals_static (the refill engine in this layout samples
  the static engine's greedy tokens on one device)."""
  model, trained, mesh, rules = training_layout_model()
  layout = layout_for(RolloutConfig(tensor_parallel=4), mesh, compute_dtype="float32", training_rules=rules)
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]]
  expected = run(model, prompts, key=5, samples_per_prompt=2, max_response_tokens=8, **settings)
  graphdef, state = nnx.split(trained)
  spec = common.Sampling(max_response_tokens=8, stop_token_ids=(EOS,), **settings)
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  out, _ = rollout.sample(nnx.merge(graphdef, layout.reshard(state)), tokens, mask, jax.random.key(5),
                          sampling=spec,
                          plan=static_plan(model, RolloutConfig(engine="static"), tokens, 2, 8), pad_id=0,
                          jit=layout.jit, place=layout.place)
  assert (out.response_tokens.sharding.mesh.shape == layout.mesh.shape
          and len(out.response_tokens.sharding.device_set) == 8)
  np.testing.assert_array_equal(out.response_tokens, expected.response_tokens)
  np.testing.assert_array_equal(out.response_lengths, expected.response_lengths)
  for field in ("policy_logprobs", "sampler_logprobs"):
    np.testing.assert_allclose(getattr(out, field), getattr(expected, field), rtol=1e-5, atol=1e-5,
                               err_msg=field)


def test_metrics(model):
  out, m = run(model, PROMPTS, samples_per_prompt=3, key=7, metrics=True)
  lengths = np.asarray(out.response_lengths)
  assert m["rollout/decode_steps"] == lengths.max() and m["rollout/slots"] == 12
  assert m["rollout/slot_utilization"] == pytest.approx(lengths.sum() / (12 * lengths.max()))
  assert m["perf/rollout_tokens_per_s"] == pytest.approx(lengths.sum() / m["time/rollout_s"])
  assert m["rollout/response_len_p50"] == np.median(lengths) and m["rollout/response_len_max"] == lengths.max()
  assert m["rollout/response_len_p90"] == pytest.approx(np.percentile(lengths, 90))
  stopped = np.mean(np.asarray(out.finish_reason) == common.FINISH_STOP)
  assert 0 < stopped < 1 and m["rollout/finish_stop_frac"] == stopped and m["rollout/finish_length_frac"] == 1 - stopped


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_rounds_sample_like_one_call(model):
  whole = run(model, PROMPTS, samples_per_prompt=3,
              key=7)  # The same call as test_group_sampling_shares_prefill_exactly.
  rounds = run(model, PROMPTS, samples_per_prompt=3, key=7,
               engine=RolloutConfig(engine="static", prompts_per_generation=2))
  np.testing.assert_array_equal(rounds.response_tokens, whole.response_tokens)
  np.testing.assert_allclose(rounds.policy_logprobs, whole.policy_logprobs, atol=1e-5)


def test_cache_memory_is_reported_and_refused():
  cfg = preset("qwen2.5-32b")
  needed = common.cache_bytes(cfg, batch=8192, prompt_tokens=1024, max_response_tokens=20480,
                               dtype=jnp.bfloat16, devices=256)
  # 2 (k, v) · 64 layers · 32 rows · 21504 slots · 8 kv heads · 128 dims · 2 bytes, plus the slot mask.
  assert needed == 2 * 64 * 32 * 21504 * 8 * 128 * 2 + 32 * 21504
  with pytest.raises(MemoryError, match=r"needs 168\.\d\d GiB per device .* lower rollout.prompts_per_step"):
    common.check_cache_fits(cfg, batch=8192, prompt_tokens=1024, max_response_tokens=20480,
                             budget_bytes=40 * 2**30, dtype=jnp.bfloat16, devices=256)
  tiny = preset("tiny")
  cache = jax.eval_shape(lambda: KVCache.zeros(tiny, 4, 48, jnp.float32))
  allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) - 4  # minus the length scalar
  assert common.cache_bytes(tiny, batch=4, prompt_tokens=16, max_response_tokens=32) == allocated
