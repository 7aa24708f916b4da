"""Masked reductions over `[B, T]` token arrays.

Pure functions of arrays: no flax, no config. Every reduction is taken in float32 and counts only
positions where `mask` is true; an all-masked input gives 0 (never NaN).
"""

import jax
import jax.numpy as jnp


def _f32(x: jax.Array) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ x over valid positions."""
  return jnp.sum(jnp.where(mask, _f32(x), 0.0), axis=axis)


def masked_count(mask: jax.Array, axis=None) -> jax.Array:
  """Number of valid positions, as float32."""
  return jnp.sum(_f32(mask != 0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ x·m / Σ m; 0 where there is no valid position."""
  return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x: jax.Array, mask: jax.Array, *, unbiased: bool = False) -> jax.Array:
  """Variance over all valid positions (population variance unless `unbiased`)."""
  n = masked_count(mask)
  centred = jnp.where(mask, _f32(x) - masked_mean(x, mask), 0.0)
  denominator = jnp.maximum(n - 1.0, 1.0) if unbiased else jnp.maximum(n, 1.0)
  return jnp.sum(centred**2) / denominator


def masked_whiten(
    x: jax.Array, mask: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
  """Batch-wide whitening over valid tokens: (x − μ) / √(σ² + eps), masked positions set to 0.

  μ and σ² are taken over every valid token of the batch (not per sequence). With
  `shift_mean=False` the mean is added back, so only the scale changes.
  """
  x = _f32(x)
  mean = masked_mean(x, mask)
  whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
  if not shift_mean:
    whitened = whitened + mean
  return jnp.where(mask, whitened, 0.0)
