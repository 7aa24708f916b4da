"""Statistics by relative position in a response (`rl/positions.py`): cases worked by hand, and random
masks (holes included) against the definition written as a loop."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import numpy as np

from vapo_jax.rl import positions


def reference_bins(mask, bins):
  """⌊bins·i/l⌋ of each valid token, i counting the valid tokens before it; −1 where masked."""
  out = np.full(mask.shape, -1)
  for b, row in enumerate(mask):
    valid = [t for t in range(mask.shape[1]) if row[t]]
    for i, t in enumerate(valid):
      out[b, t] = int(np.floor(bins * i / len(valid)))
  return out


def reference_means(x, mask, bins):
  which = reference_bins(mask, bins)
  return np.array([x[which == k].mean() if np.any(which == k) else 0.0 for k in range(bins)])


def test_deciles_by_hand(maybe_jit):
  mask = np.zeros((3, 12), bool)
  mask[0], mask[1, :3], mask[2, [0, 2, 5]] = True, True, True  # l = 12; l = 3; l = 3 with holes.
  expected = np.full((3, 12), -1)
  expected[0] = [0, 0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9]  # 10·i // 12.
  expected[1, :3] = [0, 3, 6]  # 10·i // 3: bins 1, 2, 4, 5, 7, 8 and 9 of this response are empty.
  expected[2, [0, 2, 5]] = [0, 3, 6]
  np.testing.assert_array_equal(maybe_jit(positions.position_bins, bins=10)(mask), expected)


def test_binned_means_by_hand(maybe_jit):
  mask = np.array([[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
  x = np.array([[1.0, 2, 3, 4], [10, 99, 20, 99], [7, 7, 7, 7]], np.float32)
  # Halves: row 0 → {1, 2} | {3, 4}; row 1 (l = 2, a hole) → {10} | {20}; row 2 has no valid token.
  np.testing.assert_allclose(maybe_jit(positions.binned_means, bins=2)(x, mask), [13 / 3, 9.0], rtol=1e-6)
  # Four bins of a 2-token response: bins 1 and 3 are empty in row 1, so they hold row 0's alone.
  np.testing.assert_allclose(maybe_jit(positions.binned_means, bins=4)(x, mask), [5.5, 2.0, 11.5, 4.0], rtol=1e-6)
  np.testing.assert_array_equal(positions.binned_means(x, np.zeros_like(mask), bins=3), [0.0, 0.0, 0.0])


# Random cases at one padded shape under one `jit` per bin count (a few programs, not one per drawn shape):
# a drawn [batch, steps] case sits in the top-left corner and the padding is masked, so it tests shorter
# and fewer rows as well.
BATCH, STEPS = 6, 40
_bins = jax.jit(positions.position_bins, static_argnames="bins")
_means = jax.jit(positions.binned_means, static_argnames="bins")


@st.composite
def binned_inputs(draw):
  batch, steps = draw(st.integers(1, BATCH)), draw(st.integers(1, STEPS))
  mask = np.zeros((BATCH, STEPS), bool)
  mask[:batch, :steps] = draw(hnp.arrays(np.bool_, (batch, steps)))
  x = draw(hnp.arrays(np.float32, (BATCH, STEPS), elements=st.floats(-3, 3, width=32)))
  return x, mask, draw(st.sampled_from([1, 3, 10, 12]))


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(binned_inputs())
def test_random_masks_against_the_definition(inputs):
  x, mask, bins = inputs
  np.testing.assert_array_equal(_bins(mask, bins=bins), reference_bins(mask, bins))
  np.testing.assert_allclose(_means(x, mask, bins=bins), reference_means(x, mask, bins), rtol=1e-5, atol=1e-5)
