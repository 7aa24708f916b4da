"""Length-bounded decode attention equals the dense full-cache step; per-row cache lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.models import decode_attention
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import positions_from_mask


def slow_reference(q, keys, values, mask, slots):
  """out[b, n] = Σ_s softmax(q·k_s/√H) v_s over s ≤ slots[b] with mask[b, s], by loops (0 if none)."""
  b_size, n_heads, h = q.shape
  groups = n_heads // keys.shape[1]
  out = np.zeros(q.shape, np.float64)
  for b in range(b_size):
    visible = [s for s in range(keys.shape[2]) if mask[b, s] and s <= slots[b]]
    for n in range(n_heads):
      if not visible:
        continue
      k, v = keys[b, n // groups, visible].astype(np.float64), values[b, n // groups, visible].astype(np.float64)
      scores = k @ q[b, n].astype(np.float64) / np.sqrt(h)
      weights = np.exp(scores - scores.max())
      out[b, n] = weights @ v / weights.sum()
  return out


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  b, s, k, g, h = 5, 37, 2, 3, 8  # S = 37 is a multiple of no block size used.
  q = rng.normal(size=(b, k * g, h)).astype(np.float32)
  # Heads-major [B, K, S, H], as the KV cache stores them.
  keys, values = (rng.normal(size=(b, s, k, h)).astype(np.float32).transpose(0, 2, 1, 3) for _ in range(2))
  slots = np.array([0, 5, 17, 36, 20], np.int32)
  starts = np.array([0, 2, 9, 0, 21])  # Left padding; row 4 has nothing visible (start > slot).
  mask = (np.arange(s)[None] >= starts[:, None]) & (np.arange(s)[None] <= slots[:, None] + 3)
  return q, keys, values, mask, slots


@pytest.mark.parametrize("block", [1, 8, 16, 64])
def test_bounded_equals_reference(case, block, maybe_jit):
  q, keys, values, mask, slots = case
  expected = slow_reference(q, keys, values, mask, slots)
  reference = maybe_jit(decode_attention.attend_one_reference)(q, keys, values, mask, slots)
  bounded = maybe_jit(decode_attention.attend_one, block=block)(q, keys, values, mask, slots)
  np.testing.assert_allclose(reference, expected, atol=1e-5)
  np.testing.assert_allclose(bounded, reference, atol=1e-5)
  assert not np.any(np.asarray(bounded)[4])  # Nothing visible: 0.


def test_reads_only_filled_blocks(case):
  """Slots past the longest row are never read: garbage there (even NaN) changes nothing."""
  q, keys, values, mask, slots = case
  short = np.minimum(slots, 14)
  poisoned_k, poisoned_v = keys.copy(), values.copy()
  poisoned_k[:, :, 16:], poisoned_v[:, :, 16:] = np.nan, np.nan  # Blocks of 8: [0, 16) hold every slot ≤ 14.
  clean = decode_attention.attend_one(q, keys, values, mask, short, block=8)
  poisoned = decode_attention.attend_one(q, poisoned_k, poisoned_v, mask, short, block=8)
  np.testing.assert_array_equal(clean, poisoned)
  assert np.all(np.isnan(decode_attention.attend_one_reference(q, poisoned_k, poisoned_v, mask, short)[:4]))


_step = jax.jit(lambda model, tokens, positions, cache: model(tokens, positions, jnp.ones_like(tokens, bool), cache))
_forward = jax.jit(lambda model, tokens, mask: model(tokens, positions_from_mask(mask), mask))


@pytest.mark.parametrize("block", [4, 0], ids=["bounded", "dense"])
def test_ragged_rows_equal_uncached_forward(model, block):
  """One cache length per row (4, 7 and 9 prompt tokens, right-padded): three greedy one-token steps
  give each row the logits of an uncached forward of its own sequence, at 1e-4."""
  lengths = np.array([4, 7, 9])
  tokens = np.random.default_rng(1).integers(3, 90, (3, 9)).astype(np.int32)
  mask = np.arange(9)[None] < lengths[:, None]
  cache = KVCache.zeros(model.cfg, 3, 12, jnp.float32, decode_block=block)
  logits, cache = model(jnp.asarray(tokens), positions_from_mask(mask), jnp.asarray(mask), cache)
  cache = cache.replace(length=jnp.asarray(lengths, jnp.int32))
  last = np.asarray(logits)[np.arange(3), lengths - 1]
  sequences = [list(tokens[b, :lengths[b]]) for b in range(3)]
  for t in range(3):
    step = np.argmax(last, -1).astype(np.int32)
    for b in range(3):
      sequences[b].append(int(step[b]))
    logits, cache = _step(model, jnp.asarray(step[:, None]), jnp.asarray(lengths[:, None] + t), cache)
    last = np.asarray(logits[:, -1])
    for b in range(3):
      padded = np.zeros((1, 12), np.int32)
      padded[0, :len(sequences[b])] = sequences[b]
      full = _forward(model, jnp.asarray(padded), jnp.arange(12)[None] < len(sequences[b]))[0]
      np.testing.assert_allclose(last[b], np.asarray(full)[0, len(sequences[b]) - 1], atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(cache.length, lengths + 3)
  assert cache.decode_block == block
