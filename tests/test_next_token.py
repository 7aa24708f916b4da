"""Sort-free top-k / top-p (threshold bisection) keeps the sorted definition's set; the sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.rollout import next_token


def kept_by_definition(logits: np.ndarray, *, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """Boolean kept set from the definitions, in float64: top-k keeps every logit ≥ the k-th largest;
  top-p then keeps z when the mass of the logits strictly above z is < top_p."""
  z = logits.astype(np.float64) / temperature
  keep = np.ones(z.shape, bool)
  for b, row in enumerate(z):
    if top_k:
      keep[b] &= row >= np.sort(row)[::-1][top_k - 1]
    if top_p < 1:
      probs = np.where(keep[b], np.exp(row - row.max()), 0.0)
      probs /= probs.sum()
      above = np.array([probs[row > value].sum() for value in row])
      keep[b] &= above < top_p
  return keep


_filters = {name: jax.jit(fn, static_argnames=("temperature", "top_k", "top_p"))
            for name, fn in (("bisection", next_token.filter_logits), ("sort", next_token.filter_logits_sorted))}


def kept(name, logits, **settings):
  return np.isfinite(np.asarray(_filters[name](jnp.asarray(logits), **settings)))


SETTINGS = [dict(temperature=1.0, top_k=0, top_p=0.7), dict(temperature=0.6, top_k=0, top_p=0.95),
            dict(temperature=1.0, top_k=0, top_p=0.05), dict(temperature=1.3, top_k=5, top_p=1.0),
            dict(temperature=1.0, top_k=40, top_p=0.9), dict(temperature=1.0, top_k=1, top_p=1.0)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"t{s['temperature']}-k{s['top_k']}-p{s['top_p']}")
def test_random_logits_keep_the_sorted_set(settings):
  rng = np.random.default_rng(0)
  logits = (rng.normal(size=(12, 2003)) * rng.uniform(0.5, 6.0, size=(12, 1))).astype(np.float32)
  expected = kept_by_definition(logits, **settings)
  np.testing.assert_array_equal(kept("sort", logits, **settings), expected)
  np.testing.assert_array_equal(kept("bisection", logits, **settings), expected)
  filtered = np.asarray(_filters["bisection"](jnp.asarray(logits), **settings))
  np.testing.assert_allclose(filtered[expected], (logits / settings["temperature"])[expected], rtol=1e-6)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"t{s['temperature']}-k{s['top_k']}-p{s['top_p']}")
def test_tied_logits_keep_the_sorted_set(settings):
  """Logits on a grid of 9 values: ties everywhere, including at every threshold (all tied are kept)."""
  rng = np.random.default_rng(1)
  logits = rng.integers(-4, 5, size=(16, 301)).astype(np.float32) * 0.75
  logits[0] = 1.0  # A row of one value.
  expected = kept_by_definition(logits, **settings)
  np.testing.assert_array_equal(kept("sort", logits, **settings), expected)
  np.testing.assert_array_equal(kept("bisection", logits, **settings), expected)
  assert kept("bisection", logits, **settings)[0].all()


def test_removed_tokens_and_extreme_values():
  """−∞ logits (already removed) stay removed; a dominant token alone reaches top_p; huge spreads."""
  logits = np.array([[0.0, -np.inf, 1.0, -np.inf, 0.5, 2.0], [50.0, 0.0, -1e6, -3.0, 49.0, 1e-3],
                     [-np.inf, -np.inf, -np.inf, 3.0, -np.inf, -np.inf]], np.float32)
  for settings in (dict(temperature=1.0, top_k=3, top_p=1.0), dict(temperature=1.0, top_k=0, top_p=0.5),
                   dict(temperature=1.0, top_k=4, top_p=0.99)):
    expected = kept_by_definition(np.where(np.isfinite(logits), logits, -1e30), **settings) & np.isfinite(logits)
    np.testing.assert_array_equal(kept("bisection", logits, **settings), expected)
    np.testing.assert_array_equal(kept("sort", logits, **settings), expected)


def test_large_vocabulary_matches_sort():
  """The benchmark's shape: [16, 151936] logits, top-p 0.7."""
  logits = np.asarray(jax.random.normal(jax.random.key(0), (16, 151936))) * 3.0
  np.testing.assert_array_equal(kept("bisection", logits, temperature=1.0, top_k=0, top_p=0.7),
                                kept("sort", logits, temperature=1.0, top_k=0, top_p=0.7))


def test_threshold_is_exact_in_few_bisection_steps():
  """With no bisection step at all the exact finish alone walks down to τ (correct, just slower)."""
  values = jnp.asarray(np.random.default_rng(2).normal(size=(4, 50)), jnp.float32)
  weights = jnp.ones_like(values)
  target = jnp.asarray([1.0, 7.0, 7.0, 50.0])
  for steps in (0, 3, 20):
    tau = next_token.largest_threshold(values, weights, target, jnp.min(values, -1), steps=steps)
    np.testing.assert_array_equal(tau, [np.sort(np.asarray(v))[::-1][int(k) - 1] for v, k in zip(values, target)])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 0, 0.7), (1.2, 10, 0.9), (0.0, 0, 1.0)])
def test_sample_tokens_bisection_equals_sort(temperature, top_k, top_p):
  """Same tokens and log-probs from either filter; sampler log-prob of a token = log-softmax of the
  filtered logits; policy = plain log-softmax; greedy = argmax with sampler 0."""
  logits = jnp.asarray(np.random.default_rng(3).normal(size=(32, 500)) * 2.5, jnp.float32)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(32))
  fn = jax.jit(next_token.sample_tokens, static_argnames=("temperature", "top_k", "top_p", "sorted_filter"))
  fast = fn(keys, logits, temperature=temperature, top_k=top_k, top_p=top_p)
  slow = fn(keys, logits, temperature=temperature, top_k=top_k, top_p=top_p, sorted_filter=True)
  np.testing.assert_array_equal(fast[0], slow[0])
  np.testing.assert_allclose(fast[1], slow[1], atol=1e-6)
  tokens = np.asarray(fast[0])
  np.testing.assert_allclose(fast[2], jax.nn.log_softmax(logits)[np.arange(32), tokens], atol=1e-6)
  if temperature == 0:
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    assert not np.any(fast[1])
  else:
    keep = kept_by_definition(np.asarray(logits), temperature=temperature, top_k=top_k, top_p=top_p)
    assert keep[np.arange(32), tokens].all()  # Never a removed token.
    z = np.where(keep, np.asarray(logits, np.float64) / temperature, -np.inf)
    log_probs = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
    np.testing.assert_allclose(fast[1], log_probs[np.arange(32), tokens], atol=1e-5)


def test_log_softmax_at_one_token_is_the_log_softmax_entry():
  """The sampler's gathered log-softmax equals the entry of the full `[B, V]` log-softmax (same
  arithmetic, so the same bits under jit), with removed (−∞) tokens in the row, and in float64."""
  logits = np.random.default_rng(4).normal(size=(16, 3000)) * 4
  logits[:, :50] = -np.inf
  tokens = np.random.default_rng(5).integers(50, 3000, 16)
  fast = jax.jit(next_token.log_softmax_at)(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens))
  full = jax.jit(lambda x, t: jnp.take_along_axis(jax.nn.log_softmax(x, -1), t[:, None], -1)[:, 0])
  np.testing.assert_array_equal(fast, full(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens)))
  finite = logits[:, 50:]
  exact = (finite - finite.max(-1, keepdims=True)
           - np.log(np.exp(finite - finite.max(-1, keepdims=True)).sum(-1, keepdims=True)))
  np.testing.assert_allclose(fast, exact[np.arange(16), tokens - 50], rtol=1e-6, atol=1e-6)
