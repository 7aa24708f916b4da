"""Masked reductions against numpy on the valid entries."""

import numpy as np

from vapo_jax.rl import masked


def test_masked_statistics():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 9)).astype(np.float32)
  mask = rng.uniform(size=(4, 9)) < 0.6
  valid = x[mask]
  np.testing.assert_allclose(masked.masked_sum(x, mask), valid.sum(), rtol=1e-6)
  np.testing.assert_allclose(masked.masked_mean(x, mask), valid.mean(), rtol=1e-6)
  np.testing.assert_allclose(masked.masked_var(x, mask), valid.var(), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_var(x, mask, unbiased=True), valid.var(ddof=1), rtol=1e-5)
  per_row = [x[b][mask[b]].mean() if mask[b].any() else 0.0 for b in range(4)]
  np.testing.assert_allclose(masked.masked_mean(x, mask, axis=-1), per_row, rtol=1e-6)


def test_masked_whiten():
  rng = np.random.default_rng(1)
  x = rng.normal(3.0, 2.0, size=(5, 7)).astype(np.float32)
  mask = rng.uniform(size=(5, 7)) < 0.7
  w = np.asarray(masked.masked_whiten(x, mask))
  np.testing.assert_allclose(w[mask], (x[mask] - x[mask].mean()) / np.sqrt(x[mask].var() + 1e-8), rtol=1e-4)
  assert not np.any(w[~mask])
  np.testing.assert_allclose(w[mask].mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(w[mask].std(), 1.0, atol=1e-4)
  kept = np.asarray(masked.masked_whiten(x, mask, shift_mean=False))
  np.testing.assert_allclose(kept[mask].mean(), x[mask].mean(), rtol=1e-4)


def test_all_masked_is_zero_not_nan():
  x = np.ones((2, 3), np.float32)
  mask = np.zeros((2, 3), bool)
  assert float(masked.masked_mean(x, mask)) == 0.0
  assert float(masked.masked_var(x, mask)) == 0.0
  assert not np.any(np.asarray(masked.masked_whiten(x, mask)))
