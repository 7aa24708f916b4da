"""Paged decode attention: each row sees exactly its own first `lengths[r]` tokens, wherever its pages sit.

The oracle is written from the definition here: row r's tokens copied out of the pool page by page with a
Python loop into a contiguous cache, then the dense masked softmax of the contiguous cache
(`decode_attention.attend_one_reference`). Pages are shared between rows (a group's prompt), out of order,
and rows have lengths 0 (nothing: 0 out), 1, a page's worth and a partial last page."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.models import decode_attention, paged_attention, pallas_gpu, sharding

KV_HEADS, GROUPS, HEAD_DIM, LAYERS, QUEUES, PAGES, PAGE_TOKENS, WIDTH = 2, 3, 8, 3, 2, 7, 4, 4
# Queue 0: rows 0-2, queue 1: rows 3-5; page ids are within the row's queue. Rows 0 and 1 share pages 5 and 2 (a
# prompt's), row 2 holds nothing; the entries past a row's length point anywhere (7: none).
TABLE = np.array([[5, 2, 0, 7], [5, 2, 6, 3], [7, 7, 7, 7], [1, 0, 4, 2], [6, 7, 7, 7], [3, 5, 7, 7]], np.int32)
LENGTHS = np.array([9, 16, 0, 13, 1, 4], np.int32)


def pool_and_query(seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  shape = (KV_HEADS, LAYERS, QUEUES, PAGES, PAGE_TOKENS, HEAD_DIM)
  keys, values = (rng.normal(size=shape).astype(dtype) for _ in range(2))
  q = rng.normal(size=(TABLE.shape[0], KV_HEADS * GROUPS, HEAD_DIM)).astype(dtype)
  return q, keys, values


def oracle(q, keys, values, layer):
  """Row by row, token by token: the contiguous copy of each row's tokens, then the dense softmax."""
  rows, rows_per_queue = TABLE.shape[0], TABLE.shape[0] // QUEUES
  slots = WIDTH * PAGE_TOKENS
  k, v = (np.zeros((rows, KV_HEADS, slots, HEAD_DIM), np.float32) for _ in range(2))
  for r in range(rows):
    for t in range(LENGTHS[r]):
      page = TABLE[r, t // PAGE_TOKENS]
      k[r, :, t] = keys[:, layer, r // rows_per_queue, page, t % PAGE_TOKENS]
      v[r, :, t] = values[:, layer, r // rows_per_queue, page, t % PAGE_TOKENS]
  mask = np.arange(slots)[None] < LENGTHS[:, None]
  return decode_attention.attend_one_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, LENGTHS - 1)


@pytest.mark.parametrize("implementation,block_pages", [("reference", 1), ("gather", 1), ("gather", 2),
                                                        ("gather", 4)])
def test_paged_attention_equals_the_contiguous_oracle(implementation, block_pages):
  q, keys, values = pool_and_query()
  fn = jax.jit(lambda *a: paged_attention.attend(*a, implementation=implementation, block_pages=block_pages))
  for layer in range(LAYERS):
    got = np.asarray(fn(q, keys, values, TABLE, LENGTHS, layer))
    np.testing.assert_allclose(got, oracle(q, keys, values, layer), rtol=1e-5, atol=1e-6, err_msg=layer)
    np.testing.assert_array_equal(got[2], 0.0)  # A row holding nothing reads nothing.


def test_what_a_row_does_not_hold_changes_nothing():
  """Pages nobody points at, and a row's own page past its length, are never read: new contents there
  give bit-identical outputs."""
  q, keys, values = pool_and_query()
  fn = jax.jit(lambda *a: paged_attention.attend(*a, layer=1, implementation="gather", block_pages=2))
  before = np.asarray(fn(q, keys, values, TABLE, LENGTHS))
  held = np.zeros((QUEUES, PAGES, PAGE_TOKENS), bool)
  for r in range(TABLE.shape[0]):
    for t in range(LENGTHS[r]):
      held[r // 3, TABLE[r, t // PAGE_TOKENS], t % PAGE_TOKENS] = True
  noise = np.random.default_rng(9).normal(size=keys.shape).astype(np.float32) * 100
  changed = lambda x: np.where(held[None, None, :, :, :, None], x, noise)
  np.testing.assert_array_equal(np.asarray(fn(q, changed(keys), changed(values), TABLE, LENGTHS)), before)


def test_gather_on_a_mesh_equals_one_device():
  """Queues split over the data-parallel devices (2 × 4 KV heads... here 2 queues over data 2, heads over
  tensor 2): the sharded gather gives the one-device numbers."""
  q, keys, values = pool_and_query(3)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = dict(sharding.PRESETS["tp"], batch="data")
  fn = lambda *a: paged_attention.attend(*a, layer=2, implementation="gather", block_pages=2)
  expected = np.asarray(jax.jit(fn)(q, keys, values, TABLE, LENGTHS))
  pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None, "data"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  args = (jax.device_put(q, rows), jax.device_put(keys, pool), jax.device_put(values, pool),
          jax.device_put(TABLE, rows), jax.device_put(LENGTHS, rows))
  got = sharding.jit(fn, mesh, rules)(*args)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-7)


def test_read_tokens_counts_each_rows_own_blocks():
  # Blocks of 2 pages of 4 tokens: ⌈9/8⌉ + ⌈16/8⌉ + 0 + ⌈13/8⌉ + ⌈1/8⌉ + ⌈4/8⌉ = 2 + 2 + 0 + 2 + 1 + 1 = 8 blocks.
  assert paged_attention.read_tokens(LENGTHS, page_tokens=4, block_pages=2) == 8 * 8
  # The contiguous layout reads every row up to the longest: 6 rows × 16 slots (blocks of 8), at most the cache.
  assert decode_attention.read_tokens(LENGTHS - 1, rows=6, block=8, slots=16) == 6 * 16
  assert decode_attention.read_tokens(LENGTHS - 1, rows=6, block=12, slots=16) == 6 * 16
  assert decode_attention.read_tokens(LENGTHS - 1, rows=6, block=12) == 6 * 24


# Blocks of 2 pages in make test; of 1 in make test-slow (the interpreter: 4 s each).
@pytest.mark.parametrize("block_pages", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_the_tpu_kernel_in_the_interpreter_equals_the_gather(block_pages):
  """The shipped Pallas kernel (`jax.experimental.pallas.ops.tpu.paged_attention`, run by the TPU interpreter on
  this CPU) against the gather on keys and values rounded to bfloat16 (the kernel loads them so): one device,
  and under shard_map on a 2 × 2 × 2 mesh (queues over data, KV heads over tensor)."""
  from jax.experimental.pallas import tpu as pltpu

  q, keys, values = pool_and_query(5)
  rounded = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  keys, values = rounded(keys), rounded(values)
  kernel = lambda *a: paged_attention.attend(*a, layer=1, implementation="kernel", block_pages=block_pages)
  expected = np.asarray(oracle(q, keys, values, 1))
  with pltpu.force_tpu_interpret_mode():
    got = np.asarray(jax.jit(kernel)(q, keys, values, TABLE, LENGTHS))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    rules = dict(sharding.PRESETS["tp"], batch="data")
    pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None, "data"))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded = np.asarray(sharding.jit(kernel, mesh, rules)(
        jax.device_put(q, rows), jax.device_put(keys, pool), jax.device_put(values, pool),
        jax.device_put(TABLE, rows), jax.device_put(LENGTHS, rows)))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[2], 0.0)


@pytest.mark.parametrize("block_pages", [1, 2])
def test_the_gpu_kernel_in_the_interpreter_equals_the_oracle(block_pages):
  """The shipped Pallas GPU kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, split-K over each row's
  pages, in the Pallas interpreter on this CPU): rows of different lengths (0, 1, a page, a partial page), pages
  shared and out of order, 3 query heads per KV head; on one device and under the rollout layout's shard_map on
  a 2 × 2 × 2 mesh (queues over data, KV heads over tensor)."""
  q, keys, values = pool_and_query(6)
  kernel = lambda *a: paged_attention.attend(*a, layer=2, implementation="gpu_kernel", block_pages=block_pages)
  expected = np.asarray(oracle(q, keys, values, 2))
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None, "data"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  with pallas_gpu.interpret():
    got = np.asarray(jax.jit(kernel)(q, keys, values, TABLE, LENGTHS))
    sharded = np.asarray(sharding.jit(kernel, mesh, dict(sharding.PRESETS["tp"], batch="data"))(
        jax.device_put(q, rows), jax.device_put(keys, pool), jax.device_put(values, pool),
        jax.device_put(TABLE, rows), jax.device_put(LENGTHS, rows)))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[2], 0.0)
  assert pallas_gpu.k_splits(WIDTH, block_pages) == (4 if block_pages == 1 else 2)  # Split-K ran: partitions > 1.


def test_each_platform_chooses_its_paged_attention():
  assert paged_attention.default_implementation("cpu", head_dim=8, page_tokens=4) == "gather"
  assert paged_attention.default_implementation("tpu", head_dim=128, page_tokens=16) == "kernel"
  assert paged_attention.default_implementation("gpu", head_dim=128, page_tokens=16) == "gpu_kernel"
  assert paged_attention.default_implementation("cuda", head_dim=64, page_tokens=128) == "gpu_kernel"
  with pytest.warns(UserWarning, match="the GPU kernel needs pages of a power of two of at least 16 tokens"):
    assert paged_attention.default_implementation("gpu", head_dim=128, page_tokens=8) == "gather"
  with pytest.warns(UserWarning, match="the GPU kernel needs a head dim that is a power of two"):
    assert paged_attention.default_implementation("gpu", head_dim=96, page_tokens=16) == "gather"
  # Split-K: the most partitions (≤ 16) of whole blocks.
  assert [pallas_gpu.k_splits(w, b) for w, b in ((64, 4), (48, 4), (24, 4), (7, 1), (40, 8))] == [16, 12, 6, 7, 5]


def test_the_kernels_write_equals_the_batched_one():
  """Each row's token into its page and offset: the TPU layout's write (rows of the pool flattened to token slots,
  under shard_map on a mesh) gives the pool the batched scatter gives, a page ≥ Pq dropped."""
  _, keys, _ = pool_and_query(7)
  new = np.random.default_rng(8).normal(size=(TABLE.shape[0], KV_HEADS, HEAD_DIM)).astype(np.float32)
  page = np.array([2, 6, PAGES, 4, 6, 3], np.int32)  # Row 2 holds nothing.
  offset = np.array([1, 3, 0, 2, 0, 3], np.int32)
  batched = np.asarray(paged_attention.write(keys, new, page, offset, 1, implementation="gather"))
  expected = keys.copy()
  for r in range(TABLE.shape[0]):
    if page[r] < PAGES:
      expected[:, 1, r // 3, page[r], offset[r]] = new[r]
  np.testing.assert_array_equal(batched, expected)
  flat = lambda *a: paged_attention.write(*a, 1, implementation="kernel")
  np.testing.assert_array_equal(np.asarray(jax.jit(flat)(keys, new, page, offset)), expected)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = dict(sharding.PRESETS["tp"], batch="data")
  pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", None, "data"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = sharding.jit(flat, mesh, rules)(jax.device_put(keys, pool), jax.device_put(new, rows),
                                            jax.device_put(page, rows), jax.device_put(offset, rows))
  np.testing.assert_array_equal(np.asarray(sharded), expected)


@pytest.mark.parametrize("megacore", ["batch", "kv_head"])
def test_the_tpu_kernel_split_over_two_cores_equals_the_oracle(megacore):
  """The shipped kernel with its grid split over a megacore chip's two TensorCores (as `megacore_mode` picks on
  v5p: by KV heads when a device holds an even number, else by rows), in the TPU interpreter."""
  from jax.experimental.pallas import tpu as pltpu

  q, keys, values = pool_and_query(6)
  rounded = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  keys, values = rounded(keys), rounded(values)
  kernel = lambda *a: paged_attention._kernel_local(*a, block_pages=2, megacore=megacore)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(num_cores_or_threads=2)):  # Both cores interpreted.
    got = np.asarray(jax.jit(kernel)(q, keys, values, TABLE, LENGTHS, jnp.int32(2)))
  np.testing.assert_allclose(got, np.asarray(oracle(q, keys, values, 2)), rtol=1e-5, atol=1e-6)
  assert paged_attention.megacore_mode("TPU v5", 256, 1) == "batch"
  assert paged_attention.megacore_mode("TPU v5", 256, 2) == "kv_head"
  assert paged_attention.megacore_mode("TPU v5", 3, 1) is None
  assert paged_attention.megacore_mode("TPU v6 lite", 256, 2) is None
