"""An int8 KV cache (`rollout.kv_cache_dtype="int8"`), read every way a rollout reads one, against oracles on the
dequantised values: the paged pool through the gather, the TPU kernel in the interpreter (one device and under
shard_map) and a prefill chunk; the contiguous cache (the static engine's) through its blocks of slots and a
prefill's whole layer. The quantisation the oracles use is written here from the definition (per token and KV
head, s = max|x| / 127, q = round(x / s)). The plan sizes an int8 pool at 2·L·K·(H + 4) bytes a token: about
twice a bfloat16 pool's tokens for the budget. Both engines sample the same from an int8 cache; with the cache in
the model's dtype, both sample bitwise what they sampled before int8 caches existed
(tests/fixtures/bf16_rollout)."""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_paged_attention import LENGTHS, TABLE, oracle, pool_and_query
from vapo_jax import rollout
from vapo_jax.config import ExperimentConfig, RolloutConfig
from vapo_jax.models import decode_attention, kv_cache, paged_attention, paged_int8, sharding
from vapo_jax.models.config import preset

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "bf16_rollout"


def quantised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The definition, vector by vector along the last axis: (int8 values, float32 scales without that axis)."""
  scale = np.abs(x).max(axis=-1) / np.float32(127)
  safe = np.where(scale > 0, scale, 1).astype(np.float32)
  return np.clip(np.round(x / safe[..., None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def int8_pool(x: np.ndarray):
  """A pool `[K, L, Q, Pq, Tg, H]` as (int8 pool, scales `[K, L, Q, P8, Tg]` (P8: Pq in a multiple of 8), its
  dequantised values)."""
  q, s = quantised(x)
  padded = np.zeros(s.shape[:3] + (paged_int8.scale_pages(s.shape[3]), s.shape[4]), np.float32)
  padded[:, :, :, :s.shape[3]] = s
  return q, padded, q.astype(np.float32) * s[..., None]


@pytest.mark.parametrize("implementation,block_pages", [("gather", 1), ("gather", 2), ("reference", 1)])
def test_paged_int8_equals_the_oracle_on_the_dequantised_pool(implementation, block_pages):
  q, keys, values = pool_and_query(11)
  (kq, ks, kd), (vq, vs, vd) = int8_pool(keys), int8_pool(values)
  fn = jax.jit(lambda *a: paged_int8.attend_pages(*a, implementation=implementation, block_pages=block_pages))
  for layer in (0, 2):
    got = np.asarray(fn(q, kq, ks, vq, vs, TABLE, LENGTHS, layer))
    np.testing.assert_allclose(got, oracle(q, kd, vd, layer), rtol=1e-5, atol=1e-6, err_msg=layer)
    np.testing.assert_array_equal(got[2], 0.0)


def test_paged_int8_kernel_in_the_interpreter_on_one_device_and_under_shard_map():
  """The shipped kernel (`paged_int8.attend`) as the cache runs it: alone, and on a 2 × 2 × 2 mesh with the
  queues over data and the KV heads over tensor (`paged_attention.attend_kernel`'s shard_map)."""
  from jax.experimental.pallas import tpu as pltpu

  q, keys, values = pool_and_query(12)
  (kq, ks, kd), (vq, vs, vd) = int8_pool(keys), int8_pool(values)
  expected = np.asarray(oracle(q, kd, vd, 1))
  kernel = lambda *a: paged_int8.attend_pages(*a, layer=1, implementation="kernel")
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = dict(sharding.PRESETS["tp"], batch="data")
  pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None, "data"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  with pltpu.force_tpu_interpret_mode():
    alone = np.asarray(jax.jit(kernel)(q, kq, ks, vq, vs, TABLE, LENGTHS))
    sharded = np.asarray(sharding.jit(kernel, mesh, rules)(
        jax.device_put(q, rows), *(jax.device_put(x, pool) for x in (kq, ks, vq, vs)),
        jax.device_put(TABLE, rows), jax.device_put(LENGTHS, rows)))
  np.testing.assert_allclose(alone, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-6)


def test_a_prefill_chunk_over_int8_pages_equals_the_reference_on_the_dequantised_pool():
  rng = np.random.default_rng(13)
  _, keys, values = pool_and_query(13)
  (kq, ks, kd), (vq, vs, vd) = int8_pool(keys), int8_pool(values)
  starts = np.array([5, 12, 0, 9, 0, 1], np.int32)  # Each chunk's 3 queries end within the row's table.
  q = rng.normal(size=(TABLE.shape[0], 3, q_heads := 6, keys.shape[-1])).astype(np.float32)
  assert q_heads == keys.shape[0] * 3
  want = paged_attention.attend_chunk(q, kd, vd, TABLE, starts, 2, implementation="reference")
  got = jax.jit(lambda *a: paged_attention.attend_chunk(*a, 2, implementation="gather", block_pages=2,
                                                        key_scales=ks, value_scales=vs))(q, kq, vq, TABLE, starts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_contiguous_int8_cache_reads_back_each_tokens_own_quantisation():
  """The static engine's cache: a prefill of 5 tokens, then one token per row at each row's own slot; the whole
  layer (a prefill's read) and the decode's blocks of slots against the dequantised definition."""
  rng = np.random.default_rng(14)
  cfg = dataclasses.replace(preset("micro"), num_layers=2)
  batch, slots, k, h, n = 3, 12, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  cache = kv_cache.KVCache.zeros(cfg, batch, slots, jnp.int8, decode_block=4)
  assert cache.keys.dtype == jnp.int8 and cache.key_scales.shape == (2, batch, k, slots)
  first, second = (rng.normal(size=(batch, steps, k, h)).astype(np.float32) for steps in (5, 1))
  cache = cache.write(1, first, -first).replace(length=jnp.array([5, 3, 4], jnp.int32))  # Rows' own lengths.
  cache = cache.write(1, second, -second)
  want = np.zeros((batch, slots, k, h), np.float32)
  q8, s = quantised(first)
  want[:, :5] = q8 * s[..., None]
  q8, s = quantised(second)
  for b, at in enumerate((5, 3, 4)):
    want[b, at] = (q8 * s[..., None])[b, 0]
  np.testing.assert_array_equal(np.asarray(cache.keys[1]).transpose(0, 2, 1, 3), quantised(want)[0])
  got_k, got_v = cache.layer_keys_values(1)  # The scales within an ulp: XLA divides by 127 as × (1 / 127).
  np.testing.assert_allclose(np.asarray(got_k), want, rtol=2.4e-7, atol=0)
  np.testing.assert_allclose(np.asarray(got_v), -want, rtol=2.4e-7, atol=0)
  query = rng.normal(size=(batch, n, h)).astype(np.float32)
  mask, at = np.arange(slots)[None] <= np.array([5, 3, 4])[:, None], jnp.array([5, 3, 4], jnp.int32)
  heads_major = jnp.asarray(want).transpose(0, 2, 1, 3)
  expected = decode_attention.attend_one_reference(query, heads_major, -heads_major, mask, at)
  got = cache.attend_one(query, 1, mask, at[:, None])
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_an_int8_pool_holds_about_twice_the_tokens_of_a_bfloat16_one_at_the_same_budget():
  cfg = preset("qwen2.5-32b")  # Head dim 128: (2·128) / (128 + 4) = 1.94 × the tokens.
  assert kv_cache.token_bytes(cfg, jnp.int8) == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
  # 4,096 slots: more than the budget holds at the cap, so the pool is what the budget holds.
  r = RolloutConfig(max_response_tokens=4096, kv_cache_budget_gib=8.0, slots=4096)
  pages = {}
  for dtype in (jnp.bfloat16, jnp.int8):
    plan = rollout.plan_rollout(r, cfg, prompts=512, samples_per_prompt=16, prompt_tokens=256, dtype=jnp.dtype(dtype),
                                devices=8, platform="tpu", budgeted=True)
    pages[dtype] = plan.queue_pages
    pool = kv_cache.PagedKVCache.pool_bytes(cfg, queues=1, pages=plan.queue_pages, page_tokens=plan.page_tokens,
                                            dtype=dtype)
    assert pool <= 8 * 2**30 < pool + plan.page_tokens * kv_cache.token_bytes(cfg, dtype)  # Fills the budget.
  assert 1.93 < pages[jnp.int8] / pages[jnp.bfloat16] < 1.95
  # A token is its int8 vectors and their scales: (128 + 4) / 256 of a bfloat16 token, which the kernel and the
  # gather read alike (the kernel copies each page's scale row alone).
  assert kv_cache.token_bytes(cfg, jnp.int8) / kv_cache.token_bytes(cfg, jnp.bfloat16) == 132 / 256


def test_the_setting_chooses_the_cache_and_only_int8_carries_scales():
  config = ExperimentConfig(name="x")
  assert config.cache_dtype == config.model.dtype
  int8 = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, kv_cache_dtype="int8"))
  assert int8.cache_dtype == "int8"
  cfg = preset("micro")
  plain = kv_cache.PagedKVCache.zeros(cfg, rows=2, queues=1, pages=3, page_tokens=4, table_pages=2,
                                      dtype=jnp.float32)
  assert plain.key_scales is None and set(plain.pool_arrays()) == {"keys", "values"}
  assert len(jax.tree.leaves(plain)) == 5  # keys, values, table, lengths, live: as before int8 caches.
  paged = kv_cache.PagedKVCache.zeros(cfg, rows=2, queues=1, pages=3, page_tokens=4, table_pages=2, dtype=jnp.int8)
  assert paged.key_scales.shape == paged.keys.shape[:3] + (8, 4) and len(paged.pool_arrays()) == 4
  with pytest.raises(ValueError, match="int8 KV cache .* not 'gpu_kernel'"):
    paged_int8.attend_pages(None, None, None, None, None, None, None, 0, implementation="gpu_kernel")


@pytest.mark.slow  # 25 s; bitwise against a file written on this machine's CPU (x86-64, XLA's CPU backend).
def test_with_the_cache_in_the_models_dtype_both_engines_sample_bitwise_as_before_and_int8_agrees_between_them():
  sys.path.insert(0, str(FIXTURE))
  import make  # tests/fixtures/bf16_rollout/make.py: what wrote the fixture.

  with np.load(FIXTURE / "rollout.npz") as before:
    before = dict(before)
  for engine in make.ENGINES:
    for field, x in make.sample(engine, jnp.dtype(jnp.bfloat16)).items():
      np.testing.assert_array_equal(x, before[f"{engine}/{field}"], err_msg=f"{engine} {field}")
  refill, static = (make.sample(engine, jnp.dtype(jnp.int8)) for engine in ("refill", "static"))
  for field in make.FIELDS:
    np.testing.assert_allclose(refill[field], static[field], atol=1e-5, rtol=0, err_msg=field)
  differs = np.abs(refill["sampler_logprobs"] - before["refill/sampler_logprobs"])
  assert 0 < differs.max() < 0.1  # Sampled from the int8 cache: close to bfloat16's, not the same.
