"""Batch statistics by relative position within each response: where in a response the advantages
and the critic's errors sit (the early-token advantages and the value bias that VAPO §4.1 describes).

Pure functions of arrays: no flax, no config. Inputs are `[B, T]` response-aligned arrays with a
`response_mask`; holes are allowed, and a token's index counts the valid tokens before it, as GAE
skips masked positions.

Relative position. Valid token i (0-based) of a response of l valid tokens lies in bin ⌊bins·i/l⌋
of `bins` equal parts of the response (integer arithmetic, so exact): with 10 bins, bin 0 is the
first 10 % of the response, its ⌈l/10⌉ first tokens (at least one), and bin 9 its last 10 %; a
response shorter than `bins` tokens leaves some bins empty.

Means over a bin are token means over the whole batch (Σ over every response's tokens in the bin /
their number), the weighting of the token-level loss; an empty bin gives 0, never NaN.
"""

import jax
import jax.numpy as jnp


def position_bins(response_mask: jax.Array, *, bins: int) -> jax.Array:
  """`[B, T]` int32: each valid token's bin ⌊bins·i/l⌋ (module docstring); −1 where masked."""
  mask = jnp.asarray(response_mask).astype(bool)
  index = jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1  # i: valid tokens before this one.
  length = jnp.sum(mask, axis=-1, dtype=jnp.int32, keepdims=True)  # l.
  return jnp.where(mask, (bins * index) // jnp.maximum(length, 1), -1)


def binned_means(x: jax.Array, response_mask: jax.Array, *, bins: int) -> jax.Array:
  """`[bins]`: the token mean of `x` `[B, T]` over the batch's valid tokens in each relative-position
  bin (0 for an empty bin). O(B·T): one segment sum, no `[B, T, bins]` one-hot."""
  which = position_bins(response_mask, bins=bins)
  which = jnp.where(which < 0, bins, which).reshape(-1)  # Masked tokens into a discarded bin.
  x = jnp.where(jnp.asarray(response_mask).astype(bool), jnp.asarray(x, jnp.float32), 0.0).reshape(-1)
  sums = jax.ops.segment_sum(x, which, num_segments=bins + 1)[:bins]
  counts = jax.ops.segment_sum(jnp.ones_like(x), which, num_segments=bins + 1)[:bins]
  return sums / jnp.maximum(counts, 1.0)
