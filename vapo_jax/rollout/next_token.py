"""Token sampling from logits: temperature, top-k and top-p (nucleus) filtering without a sort.

Filtering keeps, per row, every token whose logit is at least a threshold τ (ties at τ are all
kept) and sets the rest to −∞:

  top-k  τ = the k-th largest logit;
  top-p  τ = the smallest logit z with  Σ_{z_j > z} p_j < top_p  (p = softmax of the logits after
         temperature and top-k): the smallest set of most likely tokens whose mass reaches
         top_p; the most likely token is always kept (Holtzman et al. 2020).

Both are "the largest value τ among the row's logits with Σ_{z_j ≥ τ} w_j ≥ target", for
weights w = 1 and target k (top-k) or w = exp(z − max z) and target top_p·Σ w (top-p); the
left side only falls as τ rises. `filter_logits` finds τ without sorting the vocabulary: a fixed
number of bisection steps on the value of τ (one masked sum over the row each), then an exact
finish that steps down through the distinct logits left in the bracket (one max and one sum
each; usually one step). As in EasyDeL, sglang-jax, T5X and tpu-inference, it replaces a
`[B, V]` sort per decode step: on 16 × 151,936 float32 logits on a CPU it is ~10× faster.

`filter_logits_sorted` is the sort-based definition (the oracle of the tests). The two keep the
same set except where summation order decides a mass exactly at top_p. Pure; no config.
"""

import jax
import jax.numpy as jnp
from jax import lax

BISECTION_STEPS = 20  # Bisection steps before the exact finish.


def filter_logits_sorted(logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """Temperature, then top-k, then top-p filtering of `[..., V]` logits (float32) with a full sort."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k > 0:
    kth = lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p  # The most likely token is always kept.
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def largest_threshold(values: jax.Array, weights: jax.Array, target: jax.Array, lower: jax.Array, *,
                      steps: int = BISECTION_STEPS) -> jax.Array:
  """Per row of `[B, V]` values: the largest entry τ with Σ_{values ≥ τ} weights ≥ target `[B]`.

  Weights are ≥ 0 and the condition must hold at the row's smallest entry; `lower` `[B]` is a value
  at which it holds (a bisection start; exactness never depends on it, only the step count).
  Returns τ `[B]`, one of the row's values."""
  mass = lambda t: jnp.sum(jnp.where(values >= t[:, None], weights, 0.0), axis=-1)

  def bisect(_, bracket):  # Invariant: lo ≤ τ ≤ hi.
    lo, hi = bracket
    mid = lo + (hi - lo) / 2
    ok = mass(mid) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  _, hi = lax.fori_loop(0, steps, bisect, (lower, jnp.max(values, axis=-1)))

  def finish(state):  # The largest entry ≤ hi is τ, or τ lies below it.
    hi, tau, done = state
    candidate = jnp.max(jnp.where(values <= hi[:, None], values, -jnp.inf), axis=-1)
    found = ~done & (mass(candidate) >= target)
    return (jnp.where(found | done, hi, jnp.nextafter(candidate, -jnp.inf)),
            jnp.where(found, candidate, tau), done | found)

  _, tau, _ = lax.while_loop(lambda s: ~jnp.all(s[2]), finish,
                             (hi, jnp.full_like(hi, -jnp.inf), jnp.zeros(hi.shape, bool)))
  return tau


def filter_logits(logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """`filter_logits_sorted` by threshold bisection (no sort): `[B, V]` logits → float32."""
  logits = logits.astype(jnp.float32) / temperature
  vocab = logits.shape[-1]
  if 0 < top_k < vocab:
    finite = jnp.where(jnp.isfinite(logits), logits, jnp.finfo(jnp.float32).min)  # −∞ stays removed.
    lowest = jnp.min(finite, axis=-1)
    kth = largest_threshold(finite, jnp.ones_like(finite), jnp.full(lowest.shape, float(top_k)), lowest)
    logits = jnp.where(logits < kth[:, None], -jnp.inf, logits)
  if top_p < 1.0:
    top = jnp.max(logits, axis=-1)
    weights = jnp.exp(logits - top[:, None])
    # Tokens below top − log(V / (1 − top_p)) − 1 together hold mass < 1 − top_p: τ is above.
    lower = top - (jnp.log(vocab / (1.0 - top_p)) + 1.0)
    tau = largest_threshold(logits, weights, top_p * jnp.sum(weights, axis=-1), lower)
    logits = jnp.where(logits < tau[:, None], -jnp.inf, logits)
  return logits


def argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (first index of the maximum, NaN counting as the maximum) as two
  plain reductions. XLA:CPU fuses the Gumbel noise into argmax's (value, index) reduction, which then
  runs slower than drawing the noise: sampling 16 rows of 152k logits took ~50 ms this way against
  ~100 ms with `jax.random.categorical`, next to a ~0.5 s decode step of the 0.5B model."""
  best = jnp.max(x, axis=-1, keepdims=True)
  index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  is_best = (x == best) | jnp.isnan(x)
  return jnp.min(jnp.where(is_best, index, x.shape[-1]), axis=-1)


def sample_tokens(keys: jax.Array, logits: jax.Array, *, temperature: float, top_k: int, top_p: float,
                  sorted_filter: bool = False):
  """One token per row from `[B, V]` logits with per-row keys `[B]`.

  Returns (tokens [B] int32, sampler_logprobs [B], policy_logprobs [B]): the log-probability under
  the filtered, renormalised distribution sampled from (0 for greedy, temperature 0) and under the
  plain log-softmax of the logits. `sorted_filter` uses the sort-based filter (tests)."""
  logits = logits.astype(jnp.float32)
  if temperature == 0:
    tokens = jnp.argmax(logits, axis=-1)
    sampler = jnp.zeros(tokens.shape, jnp.float32)
  else:
    filter_fn = filter_logits_sorted if sorted_filter else filter_logits
    processed = filter_fn(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    # `jax.random.categorical` per row (same Gumbel noise, same tokens) with a faster argmax.
    noise = jax.vmap(lambda k: jax.random.gumbel(k, processed.shape[-1:]))(keys)
    tokens = argmax(processed + noise)
    sampler = log_softmax_at(processed, tokens)
  return tokens.astype(jnp.int32), sampler, log_softmax_at(logits, tokens)


def log_softmax_at(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """`jax.nn.log_softmax(logits)` `[B, V]` at one token per row `[B]`, with the same arithmetic
  (x − max − log Σ exp(x − max): the same bits under jit) without writing out the `[B, V]` result."""
  top = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  log_sum = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
  return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - top[:, 0] - log_sum
