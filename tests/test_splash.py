"""The splash kernel (`models/splash.py`) in the Pallas TPU interpreter on packed rows of several blocks: its block
masks narrowed row by row to the pairs whose blocks share a segment, against attention written from its definition
and the dense reference's gradients, and the pairs it visits counted."""

import jax.numpy as jnp
import numpy as np

from test_attention import _inputs, _loop_attention, _out_and_grads, _segments
from vapo_jax.models import attention
from vapo_jax.models import splash as splash_kernel


def test_splash_visits_only_blocks_sharing_a_segment_and_equals_the_definition():
  """On packed rows of four 128-token blocks, splash (in the Pallas interpreter; its block masks narrowed to the
  pairs of blocks that share a segment, the backward's two kernels' too) gives the loop's attention and the
  reference's gradients; the pairs it visits are those that share a segment, fewer than the causal blocks."""
  rows = [[200, 60, 130, 50], [512], [70, 10]]  # Segments across blocks, within one, and padding after.
  q, k, v, weights = _inputs(3, 512, 512, kv_heads=1, groups=2, head_dim=16, seed=7)
  segments = _segments(rows, 512)
  got = _out_and_grads(lambda *a: attention.splash(*a, segment_ids=jnp.asarray(segments), interpret=True, block=128),
                       q, k, v, weights)
  same = lambda row, i, s: segments[row, i] != 0 and segments[row, i] == segments[row, s] and s <= i
  np.testing.assert_allclose(got[0], _loop_attention(q, k, v, same), atol=1e-5, rtol=1e-5)
  expected = _out_and_grads(lambda *a: attention.reference(*a, segment_ids=jnp.asarray(segments)), q, k, v, weights)
  for want, have in zip(expected, got):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)
  # Causal pairs per row: 10. Row 0's blocks hold segments 1 | 1, 2 | 2, 3 | 3, 4, padding: 7 pairs share one;
  # row 1 is one segment; row 2 is one block of two segments, then padding, which sees only its own block.
  assert [splash_kernel.visited_blocks(segments[r:r + 1], 128) for r in range(3)] == [7, 10, 4]
