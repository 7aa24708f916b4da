"""int8 pages (`models/paged_int8.py`): the quantisation against its definition (each entry within half a
scale step), a written token read back as its own quantisation (nothing else moved), and the Pallas TPU kernel
in the interpreter against the contiguous oracle of
`test_paged_attention.py` on the dequantised pools: shared and out-of-order pages, rows of length 0, 1, a page
and a partial page. Compiled for a v5p chip by libtpu (skipped without it), the kernel reads about half the
bytes of JAX's bfloat16 kernel and makes no copy of its scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_paged_attention import LENGTHS, TABLE, oracle, pool_and_query
from vapo_jax.memory import hlo_walk, topologies
from vapo_jax.models import paged_int8, sharding


def test_quantize_keeps_each_entry_within_half_a_scale_step():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 16)).astype(np.float32) * rng.uniform(0.01, 10, size=(3, 5, 1)).astype(np.float32)
  x[1, 2] = 0.0  # A zero vector: scale 0, every entry 0.
  q, scales = paged_int8.quantize(jnp.asarray(x))
  assert q.dtype == jnp.int8 and q.shape == x.shape and scales.shape == (3, 5)
  step = np.abs(x).max(axis=-1) / 127.0  # [3, 5], from the definition.
  np.testing.assert_allclose(np.asarray(scales), step, rtol=1e-7)
  back = np.asarray(paged_int8.dequantize(q, scales))
  assert np.all(np.abs(back - x) <= step[..., None] / 2 * (1 + 1e-6))
  assert np.all(back[1, 2] == 0.0) and int(np.abs(np.asarray(q)).max()) == 127


@pytest.mark.slow  # make test runs the kernel alone and under shard_map in test_kv_int8.py.
def test_the_kernel_in_the_interpreter_equals_the_oracle_on_the_dequantised_pools():
  from jax.experimental.pallas import tpu as pltpu

  q, keys, values = pool_and_query(7)
  (kq, ks), (vq, vs) = paged_int8.quantize_pool(jnp.asarray(keys)), paged_int8.quantize_pool(jnp.asarray(values))
  assert ks.shape == keys.shape[:3] + (8, keys.shape[4])  # 7 pages' scales in a multiple of 8.
  dk, dv = np.asarray(paged_int8.dequantize(kq, ks)), np.asarray(paged_int8.dequantize(vq, vs))
  for layer in (0, 2):
    expected = np.asarray(oracle(q, dk, dv, layer))
    with pltpu.force_tpu_interpret_mode():
      got = np.asarray(jax.jit(paged_int8.attend)(q, kq, ks, vq, vs, TABLE, LENGTHS, layer))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=layer)
    np.testing.assert_array_equal(got[2], 0.0)  # A row holding nothing reads nothing.
    reference = paged_int8.attend_reference(q, kq, ks, vq, vs, TABLE, LENGTHS, layer)
    np.testing.assert_allclose(np.asarray(reference), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
def test_compiled_for_a_v5p_chip_it_reads_about_half_of_bfloat16s_bytes():
  """One device of `aime`'s rollout group (1 KV head, 5 query heads, head dim 128, pages of 128 tokens): the
  kernel's operands walked from the compiled HLO, int8 against JAX's kernel on the bfloat16 pool."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  target = topologies.named("v5p:2x2x1")
  device = jax.sharding.SingleDeviceSharding(target.devices[0])
  on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
  kv, layers, pages, tg, h, rows, width = 1, 2, 512, 128, 128, 16, 32
  q, table, lengths = on((rows, 5, h), jnp.bfloat16), on((rows, width), jnp.int32), on((rows,), jnp.int32)
  pool, scales = on((kv, layers, 1, pages, tg, h), jnp.int8), on((kv, layers, 1, pages, tg), jnp.float32)
  with topologies.persistent_cache_for(target):
    int8 = jax.jit(paged_int8.attend).lower(q, pool, scales, pool, scales, table, lengths, 1).compile()
    bf16_pages = on((kv, layers * pages, tg, h), jnp.bfloat16)
    with jax.default_matmul_precision("default"):  # JAX's kernel compiles at the default precision only.
      bf16 = jax.jit(lambda q, k, v, l, i: paged_attention(q, k, v, l, i, pages_per_compute_block=1)).lower(
          q, bf16_pages, bf16_pages, lengths, table).compile()
  ours, theirs = hlo_walk.walk(int8.as_text()), hlo_walk.walk(bf16.as_text())
  assert 0.45 < ours.kernel_bytes / theirs.kernel_bytes < 0.55, (ours.kernel_bytes, theirs.kernel_bytes)
  assert int8.memory_analysis().temp_size_in_bytes < 2**20  # No copy of the pool or its scales.


@pytest.mark.parametrize("implementation,mesh", [("gather", None), ("kernel", None), ("kernel", (2, 2, 2))])
def test_a_written_token_reads_back_as_its_own_quantisation_and_nothing_else_moves(implementation, mesh):
  """The gather's scatters batched over queues; the kernel's on one device, and under shard_map on a 2 × 2 × 2 mesh
  (queues over data, KV heads over tensor)."""
  rng = np.random.default_rng(3)
  kv, layers, queues, pages, tg, h, rows = 2, 3, 2, 5, 4, 8, 4
  pool, scales = paged_int8.quantize_pool(jnp.asarray(rng.normal(size=(kv, layers, queues, pages, tg, h)),
                                                      jnp.float32))
  new = rng.normal(size=(rows, kv, h)).astype(np.float32)
  page, offset = np.array([1, 4, 0, 5], np.int32), np.array([2, 0, 3, 1], np.int32)  # Row 3's page 5: none.
  write = lambda *a: paged_int8.write(*a, implementation=implementation)
  if mesh is None:
    got_pool, got_scales = jax.jit(write)(pool, scales, new, page, offset, 2)
  else:
    mesh = sharding.make_mesh(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    on = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
    rules = dict(sharding.PRESETS["tp"], batch="data")
    got_pool, got_scales = sharding.jit(write, mesh, rules)(
        on(pool, "tensor", None, "data"), on(scales, "tensor", None, "data"), on(new, "data", "tensor"),
        on(page, "data"), on(offset, "data"), 2)
    assert len(got_scales.sharding.device_set) == 8
  want = np.array(paged_int8.dequantize(pool, scales))
  for r in range(3):  # Rows 0-1 are queue 0's, rows 2-3 queue 1's; each token quantised on its own.
    q, s = paged_int8.quantize(jnp.asarray(new[r]))
    want[:, 2, r // 2, page[r], offset[r]] = np.asarray(paged_int8.dequantize(q, s))
  np.testing.assert_array_equal(np.asarray(paged_int8.dequantize(got_pool, got_scales)), want)
