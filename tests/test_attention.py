"""Attention implementations against the dense reference, and the reference against a loop."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vapo_jax.errors import ConfigError
from vapo_jax.models import attention, flash, sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM


def _inputs(batch, queries, keys, kv_heads, groups, head_dim=8, seed=0):
  """q, k, v and output weights, float32 (numpy draws: no eager JAX compilations)."""
  rng = np.random.default_rng(seed)
  n = kv_heads * groups
  shapes = ((batch, queries, n, head_dim), (batch, keys, kv_heads, head_dim), (batch, keys, kv_heads, head_dim),
            (batch, queries, n, head_dim))
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)


def _out_and_grads(fn, q, k, v, weights):
  """fn's output and the gradients of Σ w ∘ out with respect to q, k, v, in one jitted program."""
  def run(q, k, v, weights):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(weights)
  return jax.jit(run)(q, k, v, weights)


def _loop_attention(q, k, v, sees):
  """Attention written from its definition, one query row and head at a time (numpy, float64):
  query i of row b attends to the keys s with sees(b, i, s)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  groups = n // k.shape[2]
  out = np.zeros_like(q)
  for row in range(b):
    for i in range(t):
      seen = [s for s in range(k.shape[1]) if sees(row, i, s)]
      for head in range(n if seen else 0):
        scores = np.array([q[row, i, head] @ k[row, s, head // groups] for s in seen]) / np.sqrt(h)
        weights = np.exp(scores - scores.max())
        out[row, i, head] = (weights / weights.sum()) @ v[row, seen, head // groups]
  return out


def _range_sees(start, end, offset, causal):
  real = lambda row, slot: start[row] <= slot < end[row]
  return lambda row, i, s: real(row, offset + i) and real(row, s) and (not causal or s <= offset + i)


def _segments(rows, length):
  """`[B, T]` int32 segment ids: row b holds sequences of the lengths rows[b] end to end (ids 1, 2,
  ...), then padding (0)."""
  ids = np.zeros((len(rows), length), np.int32)
  for b, lengths in enumerate(rows):
    ids[b, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  return ids


def test_key_ranges_and_visibility():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 0]])
  start, end = jax.jit(attention.key_ranges)(mask)
  np.testing.assert_array_equal(start, [2, 0, 0, 1])
  np.testing.assert_array_equal(end, [5, 3, 0, 4])
  visible = jax.jit(lambda s, e: attention.visibility(s, e, queries=2, keys=5, query_offset=3))(start[:1], end[:1])
  np.testing.assert_array_equal(visible[0], [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])


@pytest.mark.parametrize("causal", [True, False])
def test_reference_equals_the_definition(causal):
  q, k, v, _ = _inputs(3, 6, 9, kv_heads=2, groups=2, seed=1)
  start, end, offset = np.array([0, 4, 2]), np.array([9, 9, 8]), 3
  expected = _loop_attention(q, k, v, _range_sees(start, end, offset, causal))
  ranges = dict(key_start=jnp.asarray(start), key_end=jnp.asarray(end), query_offset=offset, causal=causal)
  np.testing.assert_allclose(jax.jit(lambda *a: attention.reference(*a, **ranges))(q, k, v), expected, atol=1e-5)


# (batch rows' [start, end), T, S, kv heads, G, query offset, causal, block)
CASES = {
    "left-right-padding-empty-row": ([(5, 37), (0, 21), (0, 0), (0, 37)], 37, 37, 2, 2, 0, True, 8),
    "gqa7-not-causal": ([(3, 29), (0, 20)], 29, 29, 1, 7, 0, False, 8),
    "mha-prefill-into-cache": ([(3, 26), (0, 26), (9, 26)], 5, 40, 3, 1, 21, True, 8),
    "decode-one-token": ([(3, 26), (0, 26), (25, 26)], 1, 40, 2, 2, 25, True, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_equals_reference_in_values_and_gradients(case):
  rows, t, s, kv_heads, groups, offset, causal, block = CASES[case]
  q, k, v, weights = _inputs(len(rows), t, s, kv_heads, groups)
  start, end = (jnp.array(x, jnp.int32) for x in zip(*rows))
  ranges = dict(key_start=start, key_end=end, query_offset=offset, causal=causal)
  expected = _out_and_grads(lambda *a: attention.reference(*a, **ranges), q, k, v, weights)
  got = _out_and_grads(lambda *a: flash.chunked(*a, **ranges, block_q=block, block_k=block), q, k, v, weights)
  for name, want, have in zip(("out", "dq", "dk", "dv"), expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5, err_msg=name)
  if case == "left-right-padding-empty-row":
    assert not np.any(got[0][2]) and not np.any(got[1][2]), "an all-padding row attends to nothing"
    every_block = jax.jit(lambda *a: flash.chunked(*a, **ranges, block_q=block, block_k=block,
                                                       skip_masked_blocks=False))
    np.testing.assert_allclose(every_block(q, k, v), got[0], atol=1e-6)


def test_segment_visibility_and_key_intervals():
  ids = jnp.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0]])
  visible = attention.segment_visibility(ids)
  np.testing.assert_array_equal(visible[0, 3], [0, 0, 1, 1, 0, 0])
  assert not np.any(visible[0, 5]) and not np.any(visible[1, 4:])
  np.testing.assert_array_equal(attention.segment_visibility(ids, causal=False)[0, 2], [0, 0, 1, 1, 1, 0])
  for causal in (True, False):
    lo, hi = flash.key_intervals(queries=6, keys=6, segment_ids=ids, causal=causal)
    by_interval = (jnp.arange(6) >= lo[..., None]) & (jnp.arange(6) < hi[..., None])
    np.testing.assert_array_equal(by_interval, attention.segment_visibility(ids, causal=causal))
  np.testing.assert_array_equal(lo, [[0, 0, 2, 2, 2, 6], [0, 0, 0, 0, 6, 6]])
  np.testing.assert_array_equal(hi, [[2, 2, 5, 5, 5, 0], [4, 4, 4, 4, 0, 0]])


@pytest.mark.parametrize("causal", [True, False])
def test_reference_with_segments_equals_the_definition(causal):
  q, k, v, _ = _inputs(2, 11, 11, kv_heads=2, groups=2, seed=6)
  ids = _segments([[4, 1, 5], [3, 6]], 11)
  sees = lambda b, i, s: ids[b, i] != 0 and ids[b, i] == ids[b, s] and (not causal or s <= i)
  got = jax.jit(lambda *a: attention.reference(*a, segment_ids=jnp.asarray(ids), causal=causal))(q, k, v)
  np.testing.assert_allclose(got, _loop_attention(q, k, v, sees), atol=1e-5)


# (each row's segment lengths (the rest is padding), T, kv heads, G, causal, block)
SEGMENT_CASES = {
    "spanning-blocks-and-end-padding": ([[5, 9, 3], [1, 1, 2, 13], [11, 2]], 21, 2, 2, True, 4),
    "one-segment-per-row": ([[24], [19], [0]], 24, 1, 3, True, 8),
    "many-short-and-an-empty-row": ([[2] * 9 + [1, 3], [], [7, 7, 7]], 22, 2, 1, True, 4),
    "not-causal": ([[6, 10], [3, 3, 3, 7]], 17, 2, 2, False, 4),
}


@pytest.mark.parametrize("case,skip", [pytest.param(case, True, id=case) for case in SEGMENT_CASES] + [
    pytest.param(case, False, id=f"{case}-every-block")
    for case in ("spanning-blocks-and-end-padding", "many-short-and-an-empty-row")])
def test_chunked_with_segments_equals_reference_in_values_and_gradients(case, skip):
  rows, t, kv_heads, groups, causal, block = SEGMENT_CASES[case]
  q, k, v, weights = _inputs(len(rows), t, t, kv_heads, groups, seed=7)
  mask = dict(segment_ids=jnp.asarray(_segments(rows, t)), causal=causal)
  expected = _out_and_grads(lambda *a: attention.reference(*a, **mask), q, k, v, weights)
  got = _out_and_grads(lambda *a: flash.chunked(*a, **mask, block_q=block, block_k=block,
                                                    skip_masked_blocks=skip), q, k, v, weights)
  for name, want, have in zip(("out", "dq", "dk", "dv"), expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5, err_msg=name)
  padding = _segments(rows, t) == 0
  assert not np.any(np.asarray(got[0])[padding]) and not np.any(np.asarray(got[1])[padding])


def test_block_pairs_visited_grow_with_the_sum_of_squared_lengths():
  t, block = 256, 8
  pairs = lambda rows: [int(x) for x in jax.jit(lambda ids: flash.visited_block_pairs(
      t, t, block_q=block, block_k=block, segment_ids=ids))(jnp.asarray(_segments(rows, t)))]
  triangle = lambda lengths: sum((n // block) * (n // block + 1) // 2 for n in lengths)  # Block-aligned segments.
  one, sixteen = [[256]], [[16] * 16]
  assert pairs(one) == [triangle([256])] * 2 == [528, 528]  # 32 query blocks: Σ (i + 1).
  assert pairs(sixteen) == [triangle([16] * 16)] * 2 == [48, 48]  # Σ length² is 16× smaller.
  assert pairs([[64] * 4]) == [triangle([64] * 4)] * 2
  short = pairs([[5] * 51])  # Unaligned: each query block reaches back at most one block.
  assert short[0] == short[1] <= 2 * 32
  every = jax.jit(lambda ids: flash.visited_block_pairs(t, t, block_q=block, block_k=block,
                                                            skip_masked_blocks=False, segment_ids=ids))
  assert [int(x) for x in every(jnp.asarray(_segments(sixteen, t)))] == [32 * 32] * 2
  # The range form: a left-padded row of 200 real tokens (25 blocks), causal.
  ranges = flash.visited_block_pairs(t, t, block_q=block, block_k=block, key_start=jnp.array([56]),
                                         key_end=jnp.array([t]))
  assert [int(x) for x in ranges] == [triangle([t - 56])] * 2


def _pairs_by_definition(visible, block: int) -> int:
  """Σ over rows b of the (query block i, key block j) pairs where some query of block i of row b sees
  some key of block j of row b: a loop over the dense `[B, T, S]` visibility (T, S multiples of block)."""
  visible, (b, t, s) = np.asarray(visible), visible.shape
  return sum(bool(visible[row, i * block:(i + 1) * block, j * block:(j + 1) * block].any())
             for row in range(b) for i in range(t // block) for j in range(s // block))


def test_each_row_visits_only_its_own_block_pairs():
  """Segments (a full row, short segments, an empty row) and ranges (left and right padding, an empty row):
  each row's pairs (forward and backward) are those it needs, not those of the union of the call's rows."""
  t, block = 128, 8
  count = jax.jit(lambda **validity: flash.visited_block_pairs(t, t, block_q=block, block_k=block, **validity))
  ids = jnp.asarray(_segments([[128], [16, 5, 40, 3, 8, 24], []], t))
  want = _pairs_by_definition(attention.segment_visibility(ids), block)
  assert [int(x) for x in count(segment_ids=ids)] == [want] * 2 and want < 2 * 136
  with flash.defaults(per_row=False):  # The union: every row at the full row's 136 (16 query blocks: Σ (i + 1)).
    assert int(flash.visited_block_pairs(t, t, block_q=block, block_k=block, segment_ids=ids)[0]) == 3 * 136
  ranges = dict(key_start=jnp.array([72, 0, 0, 17]), key_end=jnp.array([128, 64, 0, 100]))
  want = _pairs_by_definition(attention.visibility(**ranges, queries=t, keys=t), block)
  assert [int(x) for x in count(**ranges)] == [want] * 2


def test_a_row_never_reads_blocks_that_only_another_row_needs():
  """Row 0 is one segment, row 1 three block-aligned ones; NaN in row 1's first segment's keys and values
  and in its third segment's queries. A masked score does not hide NaN in `P·V` or in `dS·Q`, so row 1's
  middle segment keeps the reference's outputs and gradients only if its loops (forward and backward)
  never visit the key blocks that row 0's queries reach and its own do not."""
  t, block = 32, 4
  q, k, v, weights = _inputs(2, t, t, kv_heads=1, groups=2, seed=10)
  ids = jnp.asarray(_segments([[32], [4, 4, 4]], t))
  expected = _out_and_grads(lambda *a: attention.reference(*a, segment_ids=ids), q, k, v, weights)
  q, k, v = q.at[1, 8:12].set(jnp.nan), k.at[1, :4].set(jnp.nan), v.at[1, :4].set(jnp.nan)
  got = _out_and_grads(lambda *a: flash.chunked(*a, segment_ids=ids, block_q=block, block_k=block), q, k, v, weights)
  for name, want, have in zip(("out", "dq", "dk", "dv"), expected, got):
    for part in (np.s_[0], np.s_[1, 4:8]):
      np.testing.assert_allclose(have[part], want[part], atol=1e-5, rtol=1e-5, err_msg=name)


def test_chunked_on_a_mesh_runs_each_device_on_its_rows():
  """On a (data 2, fsdp 2, tensor 2) mesh of 8 CPU devices (`use_rules`), forward and backward equal the reference."""
  q, k, v, weights = _inputs(4, 24, 24, kv_heads=2, groups=2, seed=11)
  mask = dict(segment_ids=jnp.asarray(_segments([[24], [3, 9, 5], [], [7, 7]], 24)))
  expected = _out_and_grads(lambda *a: attention.reference(*a, **mask), q, k, v, weights)
  with sharding.use_rules(sharding.make_mesh(data=2, fsdp=2, tensor=2), sharding.PRESETS["fsdp_tp"]):
    got = _out_and_grads(lambda *a: attention.attend(*a, **mask, impl="chunked", block_q=8), q, k, v, weights)
  for name, want, have in zip(("out", "dq", "dk", "dv"), expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_skipped_blocks_are_never_read():
  """NaN in the first segment's keys and values and in the third segment's queries: a masked score
  does not hide NaN in `P·V` or in `dS·Q`, so the middle segment's outputs and gradients stay finite
  only if the loops (forward and backward) never visit a block pair across segments; without
  skipping they turn NaN."""
  t, block = 32, 4
  q, k, v, weights = _inputs(1, t, t, kv_heads=1, groups=2, seed=8)
  ids = jnp.asarray(_segments([[8, 12, 12]], t))  # Block-aligned: no block holds two segments.
  k, v = (x.at[:, :8].set(jnp.nan) for x in (k, v))
  q = q.at[:, 20:].set(jnp.nan)
  run = lambda skip: _out_and_grads(lambda *a: flash.chunked(
      *a, segment_ids=ids, block_q=block, block_k=block, skip_masked_blocks=skip), q, k, v, weights)
  middle = lambda arrays: [np.asarray(x)[:, 8:20] for x in arrays]
  assert all(np.all(np.isfinite(x)) for x in middle(run(True)))
  out, dq, dk, _ = middle(run(False))  # (dv = Pᵀ·dO meets no NaN: P is zeroed where masked.)
  assert np.all(np.isnan(out)) and np.all(np.isnan(dq)) and np.all(np.isnan(dk))


def test_segments_run_pallas_gpu_on_a_gpu_fall_back_where_it_refuses_and_are_refused_by_cudnn():
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(2, 40, 40, kv_heads=2, groups=2, seed=9))
  ids = jnp.asarray(_segments([[5, 11], [16]], 40))  # 40 tokens: not a multiple of the GPU kernel's 16.
  attention._WARNED.clear()
  auto = lambda *a: attention.attend(*a, segment_ids=ids, impl="auto", platform="gpu")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = jax.jit(auto)(q, k, v)
    jax.eval_shape(auto, q, k, v)
  assert len(caught) == 1 and "pallas_gpu needs rows of a multiple of 16 tokens (here 40)" in str(caught[0].message)
  want = jax.jit(lambda *a: flash.chunked(*a, segment_ids=ids))(q, k, v)
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ConfigError, match="model.attention='cudnn' cannot run here.*no segment ids"):
    jax.eval_shape(lambda *a: attention.attend(*a, segment_ids=ids, impl="cudnn", platform="gpu"), q, k, v)
  with pytest.raises(ValueError, match="whole-sequence calls"):
    attention.attend(q[:, :4], k, v, segment_ids=ids, query_offset=12, impl="chunked")
  with pytest.raises(ValueError, match="not both"):
    attention.attend(q, k, v, segment_ids=ids, key_start=jnp.zeros(2, int), key_end=jnp.zeros(2, int))


def test_chunked_bfloat16_is_as_close_to_float32_as_the_reference():
  q, k, v, _ = _inputs(2, 40, 40, kv_heads=2, groups=3, head_dim=16, seed=2)
  ranges = dict(key_start=jnp.array([0, 7]), key_end=jnp.array([40, 33]))
  reference = jax.jit(lambda *a: attention.reference(*a, **ranges))
  exact = reference(q, k, v)
  half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  chunked = jax.jit(lambda *a: flash.chunked(*a, **ranges, block_q=16, block_k=16))(*half)
  assert chunked.dtype == jnp.bfloat16
  err = lambda x: np.max(np.abs(np.asarray(x, np.float32) - np.asarray(exact)))
  assert err(chunked) <= 2 * err(reference(*half)) + 1e-3


def test_kernel_wrapper_rotation_equals_reference():
  # The cudnn path (rows rotated to start at slot 0, sequence lengths) run by the XLA implementation.
  q, k, v, weights = _inputs(3, 24, 24, kv_heads=2, groups=2, seed=3)
  ranges = dict(key_start=jnp.array([0, 5, 0]), key_end=jnp.array([24, 19, 0]))
  expected = _out_and_grads(lambda *a: attention.reference(*a, **ranges), q, k, v, weights)
  got = _out_and_grads(lambda *a: attention.cudnn(*a, **ranges, implementation="xla"), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["ranges", "segments"])
def test_splash_in_the_pallas_interpreter_equals_reference(form):
  q, k, v, weights = _inputs(2, 128, 128, kv_heads=2, groups=2, head_dim=16, seed=4)
  if form == "ranges":
    mask = dict(key_start=jnp.array([7, 0]), key_end=jnp.array([128, 100]))
  else:  # A segment across splash's 128-token block, one-token segments, padding at the row end.
    mask = dict(segment_ids=jnp.asarray(_segments([[40, 1, 1, 70], [100]], 128)))
  expected = _out_and_grads(lambda *a: attention.reference(*a, **mask), q, k, v, weights)
  got = _out_and_grads(lambda *a: attention.splash(*a, **mask, interpret=True), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)


# Both in make test-slow, for time (the interpreter's 5 s and 20 s): make test runs the shipped path under shard_map
# in the TPU interpreter on packed rows with grouped queries, and its placement (tests/test_splash.py).
@pytest.mark.slow
@pytest.mark.parametrize("form", ["ranges", "segments"])
def test_splash_under_shard_map_equals_chunked_in_the_interpreter(form):
  """On a (data 2, fsdp 2, tensor 2) mesh of the 8 CPU devices with fsdp_tp's rules, splash runs under
  shard_map, each device on its rows and its kv head's query heads; output and gradients are chunked's."""
  q, k, v, weights = _inputs(4, 128, 128, kv_heads=2, groups=2, head_dim=16, seed=6)
  if form == "ranges":
    mask = dict(key_start=jnp.array([7, 0, 0, 128]), key_end=jnp.array([128, 100, 128, 128]))
  else:
    mask = dict(segment_ids=jnp.asarray(_segments([[40, 1, 1, 70], [100], [128], [3, 125]], 128)))
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = sharding.PRESETS["fsdp_tp"]
  heads, rows = attention._splash_specs(mesh, rules, batch=4, heads=4, kv_heads=2)
  assert heads == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
  assert rows == jax.sharding.PartitionSpec(("data", "fsdp"), None)
  expected = _out_and_grads(lambda *a: flash.chunked(*a, **mask), q, k, v, weights)
  with sharding.use_rules(mesh, rules):
    got = _out_and_grads(lambda *a: attention.splash(*a, **mask, interpret=True, block=128), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)


def test_selection_and_errors():
  assert attention.select("auto", jnp.float32, "cpu") == "chunked"
  assert attention.select("auto", jnp.bfloat16, "gpu") == "cudnn"
  assert attention.select("auto", jnp.float32, "gpu") == "chunked"
  assert attention.select("auto", jnp.bfloat16, "tpu") == "splash"
  with pytest.raises(ConfigError, match="'cudnn' needs an NVIDIA GPU, but JAX runs on 'cpu'"):
    attention.select("cudnn", jnp.bfloat16, "cpu")
  with pytest.raises(ConfigError, match="'cudnn' needs bfloat16 or float16 compute, got float32"):
    attention.select("cudnn", jnp.float32, "gpu")
  with pytest.raises(ConfigError, match="'splash' needs a TPU"):
    attention.select("splash", jnp.float32, "cpu")
  with pytest.raises(ConfigError, match="must be one of"):
    attention.select("flash", jnp.float32, "cpu")
  with pytest.raises(ConfigError, match="'cudnn' needs an NVIDIA GPU"):
    CausalLM(preset("tiny"), dtype="bfloat16", attention="cudnn", rngs=nnx.Rngs(0))


def test_auto_falls_back_once_with_the_reason_and_explicit_raises():
  q, k, v, _ = _inputs(2, 40, 40, kv_heads=2, groups=2, seed=5)  # 40: not a multiple of splash's 128.
  ranges = dict(key_start=jnp.array([0, 3]), key_end=jnp.array([40, 40]))
  attention._WARNED.clear()
  auto = lambda *a: attention.attend(*a, **ranges, impl="auto", platform="tpu")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = jax.jit(auto)(q, k, v)
    jax.eval_shape(auto, q, k, v)  # Traced again: no second warning.
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1 and "multiple of 128, got 40" in messages[0] and "'chunked'" in messages[0]
  np.testing.assert_allclose(first, jax.jit(lambda *a: attention.reference(*a, **ranges))(q, k, v), atol=1e-5)
  with pytest.raises(ConfigError, match="model.attention='splash' cannot run here.*multiple of 128"):
    jax.eval_shape(lambda *a: attention.attend(*a, **ranges, impl="splash", platform="tpu"), q, k, v)


def test_chunked_never_holds_a_score_matrix():
  t = 2048
  q, k, v, weights = _inputs(1, t, t, kv_heads=2, groups=2, head_dim=32)
  ranges = dict(key_start=jnp.array([0]), key_end=jnp.array([t]))
  loss = lambda q, k, v: jnp.sum(flash.chunked(q, k, v, **ranges) * weights)
  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < t * t * 4  # One head's [T, S] float32 scores.


def _model_batch(cfg, length=300):
  """Two rows: a left-padded one and a right-padded one (prompt, response, padding)."""
  tokens = (np.arange(2 * length).reshape(2, length) * 7 + 3) % cfg.vocab_size
  slot = np.arange(length)
  mask = np.stack([slot >= 40, slot < length - 61]).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)  # positions_from_mask, in numpy.
  return tokens, positions, mask


def test_model_with_chunked_equals_reference():
  # 300 tokens: two query blocks of 256, the second partial, and a shifted last key block.
  cfg = dataclasses.replace(preset("tiny"), num_layers=1)
  tokens, positions, mask = _model_batch(cfg)
  valid = np.asarray(mask, bool)

  rng = np.random.default_rng(3)  # One set of weights (numpy draws) for both implementations.
  weights = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype),
                         nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))))

  def logits_and_grads(impl):
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, attention=impl, rngs=nnx.Rngs(0)))), weights)
    def loss(m):
      logits = m(tokens, positions, mask)[0]
      return jnp.sum(jnp.where(mask[..., None] == 1, jax.nn.log_softmax(logits), 0.0)) / 1e3, logits
    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return logits, grads

  (ref_logits, ref_grads), (logits, grads) = logits_and_grads("reference"), logits_and_grads("chunked")
  np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref_logits)[valid], atol=1e-5, rtol=1e-5)
  for want, have in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-4)

