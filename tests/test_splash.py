"""The splash kernel (`models/splash.py`) on packed rows of several blocks, its block masks narrowed row by row to the
pairs whose blocks share a segment: the shipped path in the TPU interpreter under shard_map against the dense
reference (make test), the Pallas interpreter against attention written from its definition (make test-slow), the
pairs it visits counted, and its placement under fsdp_tp's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from test_attention import _inputs, _loop_attention, _out_and_grads, _segments
from vapo_jax.models import attention, sharding
from vapo_jax.models import splash as splash_kernel

ROWS = [[200, 60, 130, 50], [512], [70, 10]]  # Segments across blocks, within one, and padding after.


def test_the_pairs_visited_are_those_whose_blocks_share_a_segment():
  # Causal pairs per row: 10. Row 0's blocks hold segments 1 | 1, 2 | 2, 3 | 3, 4, padding: 7 pairs share one;
  # row 1 is one segment; row 2 is one block of two segments, then padding, which sees only its own block.
  segments = _segments(ROWS, 512)
  assert [splash_kernel.visited_blocks(segments[r:r + 1], 128) for r in range(3)] == [7, 10, 4]


@pytest.mark.slow  # For time (10 s): make test runs the shipped path in the TPU interpreter (below).
def test_splash_in_the_pallas_interpreter_equals_the_definition():
  """On packed rows of four 128-token blocks, splash (in the Pallas interpreter; its block masks narrowed to the
  pairs of blocks that share a segment, the backward's two kernels' too) gives the loop's attention and the
  reference's gradients."""
  q, k, v, weights = _inputs(3, 512, 512, kv_heads=1, groups=2, head_dim=16, seed=7)
  segments = _segments(ROWS, 512)
  got = _out_and_grads(lambda *a: attention.splash(*a, segment_ids=jnp.asarray(segments), interpret=True, block=128),
                       q, k, v, weights)
  same = lambda row, i, s: segments[row, i] != 0 and segments[row, i] == segments[row, s] and s <= i
  np.testing.assert_allclose(got[0], _loop_attention(q, k, v, same), atol=1e-5, rtol=1e-5)
  expected = _out_and_grads(lambda *a: attention.reference(*a, segment_ids=jnp.asarray(segments)), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)

def test_splash_in_the_tpu_interpreter_under_shard_map_equals_the_reference():
  """The shipped path, `interpret=False`, in the TPU interpreter (`force_tpu_interpret_mode`: scalar prefetch and
  block copies as the chip runs them) under shard_map on a (fsdp 2, tensor 2) mesh, rows and heads split: output
  and gradients are the dense reference's on packed rows whose narrowed masks skip pairs, two query heads to a kv
  head."""
  q, k, v, weights = _inputs(2, 256, 256, kv_heads=2, groups=2, head_dim=16, seed=8)
  rows = [[60, 68, 100], [128, 50]]  # Each row's second block shares no segment with its first: a pair skipped.
  segments = jnp.asarray(_segments(rows, 256))
  assert splash_kernel.visited_blocks(np.asarray(segments), 128) == 2 * 2
  expected = _out_and_grads(lambda *a: attention.reference(*a, segment_ids=segments), q, k, v, weights)
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])
  with pltpu.force_tpu_interpret_mode(), sharding.use_rules(mesh, sharding.PRESETS["fsdp_tp"]):
    got = _out_and_grads(lambda *a: attention.splash(*a, segment_ids=segments, block=128), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)


def test_splash_places_rows_and_kv_heads_on_fsdp_tp():
  """fsdp_tp's rules put splash's rows on (data, fsdp) and its kv heads' query heads on tensor; heads that do not
  divide the tensor axis stay whole on every device (rows still split)."""
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = sharding.PRESETS["fsdp_tp"]
  heads, rows = attention._splash_specs(mesh, rules, batch=4, heads=4, kv_heads=2)
  assert heads == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
  assert rows == jax.sharding.PartitionSpec(("data", "fsdp"), None)
  assert attention._splash_specs(mesh, rules, batch=4, heads=6, kv_heads=3)[0] == jax.sharding.PartitionSpec(
      ("data", "fsdp"), None, None, None)
