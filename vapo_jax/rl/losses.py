"""Policy, value, language-model and regularisation losses for VAPO and its baselines.

Pure functions of arrays: no flax, no config. Inputs are `[B, T]` response-aligned token arrays
(`B` sequences, `T` response tokens, `V` vocabulary); every computation is done in float32
whatever the input dtype, and an all-masked batch gives finite values (0 losses).

Each loss returns `(loss, metrics)` where `metrics` is a dict of scalar diagnostics.
"""

import jax
import jax.numpy as jnp

from vapo_jax.kinds import KLEstimator, LossAggregation
from vapo_jax.rl import masked


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _per_sequence(token_losses: jax.Array, response_mask: jax.Array,
                  segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Σ_t ℓ and |o| per sequence: per row `[B]`, or per (row, segment id) pair of packed rows (flat
  `[R·(L + 1)]`, pairs without a valid token counting 0)."""
  if segment_ids is None:
    return jnp.sum(token_losses, axis=-1), masked.masked_count(response_mask, axis=-1)
  rows, width = segment_ids.shape
  ids = (jnp.arange(rows)[:, None] * (width + 1) + segment_ids).reshape(-1)
  total = lambda x: jax.ops.segment_sum(x.reshape(-1), ids, num_segments=rows * (width + 1))
  return total(token_losses), total(_f32(response_mask != 0))


def aggregate_loss(
    token_losses: jax.Array,
    response_mask: jax.Array,
    *,
    mode: LossAggregation,
    norm_length: int | None = None,
    denominator: jax.Array | float | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Reduces `[B, T]` per-token losses to a scalar.

  Modes (ℓ_{b,t} the token loss, m the mask, |o_b| = Σ_t m_{b,t}, B' the sequences with at least
  one valid token):
    token-mean:              Σ_{b,t} m·ℓ / Σ_{b,t} m           (token-level loss: VAPO §4.2, DAPO)
    seq-mean-token-mean:     (1/B') Σ_b (Σ_t m·ℓ / |o_b|)      (vanilla PPO, GRPO)
    seq-mean-token-sum:      (1/B') Σ_b Σ_t m·ℓ
    seq-mean-token-sum-norm: (1/B') Σ_b Σ_t m·ℓ / norm_length  (Dr. GRPO; norm_length defaults to T)

  Sequences without a valid token are left out of the sequence means; an all-masked batch
  gives 0. `denominator` replaces Σ m (token-mean) or B' (the sequence modes): with the count of
  a whole mini-batch, the losses of its micro-batches add up to the mini-batch's loss (gradient
  accumulation). `segment_ids` (packed rows `[R, L]`: 1, 2, ... per sequence of a row, 0 on
  padding): a sequence is a (row, segment) pair, so the sequence modes count and average per
  segment; `norm_length` must then be given (a row's length is not the responses').
  """
  token_losses = jnp.where(response_mask, _f32(token_losses), 0.0)
  sums, lengths = _per_sequence(token_losses, response_mask, segment_ids)
  num_sequences = jnp.maximum(jnp.sum(lengths > 0), 1) if denominator is None else denominator
  match mode:
    case "token-mean":
      tokens = jnp.sum(lengths) if denominator is None else denominator
      return jnp.sum(token_losses) / jnp.maximum(tokens, 1.0)
    case "seq-mean-token-mean":
      return jnp.sum(sums / jnp.maximum(lengths, 1.0)) / num_sequences
    case "seq-mean-token-sum":
      return jnp.sum(token_losses) / num_sequences
    case "seq-mean-token-sum-norm":
      if norm_length is None and segment_ids is not None:
        raise ValueError("seq-mean-token-sum-norm on packed rows (segment_ids) needs norm_length")
      length = token_losses.shape[-1] if norm_length is None else norm_length
      return jnp.sum(token_losses) / length / num_sequences
    case _:
      raise ValueError(f"unknown loss aggregation mode {mode!r}")


def ppo_policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    mode: LossAggregation = "token-mean",
    denominator: jax.Array | float | None = None,
    norm_length: int | None = None,
    segment_ids: jax.Array | None = None,
    sampler_logprobs: jax.Array | None = None,
    tis_cap: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped PPO surrogate with decoupled clip range ("clip-higher", DAPO / VAPO §4.3).

  With ρ = exp(log π − log π_old):

    ℓ_t = −min(ρ·Â, clip(ρ, 1 − ε_low, 1 + ε_high)·Â)

  and, with dual clip c > 1 (Ye et al. 2020), for Â < 0: ℓ_t = min(ℓ_t, −c·Â), which bounds the
  loss when ρ is very large on a negative-advantage token. ε_low = ε_high is standard PPO.

  Metrics: `clip_frac_low` (tokens whose ratio is below 1 − ε_low with Â < 0, where the clip
  zeroes the gradient), `clip_frac_high` (ratio above 1 + ε_high with Â > 0), `dual_clip_frac`,
  `approx_kl` (the k3 estimate of KL(π_old ‖ π)) and `ratio_mean`, all over valid tokens.
  `denominator`, `norm_length`, `segment_ids`: as in `aggregate_loss`.

  Truncated importance sampling (`tis_cap` C with `sampler_logprobs`, the log-probs the tokens were sampled
  with): ℓ_t is weighted by w_t = min(exp(log π_old − log π_sampler), C), a constant; metrics
  `tis_weight_mean` and `tis_clip_frac` (tokens whose ratio exceeds C). Without them ℓ_t is untouched.
  """
  logprobs, old_logprobs, advantages = _f32(logprobs), _f32(old_logprobs), _f32(advantages)
  log_ratio = jnp.where(response_mask, logprobs - old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  token_losses = jnp.maximum(unclipped, clipped)
  metrics = {}
  if dual_clip is not None:
    dual = -advantages * dual_clip
    dual_active = (advantages < 0) & (token_losses > dual)
    token_losses = jnp.where(advantages < 0, jnp.minimum(token_losses, dual), token_losses)
    metrics["dual_clip_frac"] = masked.masked_mean(dual_active, response_mask)
  if tis_cap is not None and sampler_logprobs is not None:
    weights, tis_metrics = truncated_importance_weights(old_logprobs, sampler_logprobs, response_mask,
                                                        cap=tis_cap)
    token_losses, metrics = token_losses * weights, metrics | tis_metrics
  loss = aggregate_loss(token_losses, response_mask, mode=mode, denominator=denominator,
                        norm_length=norm_length, segment_ids=segment_ids)
  metrics |= {
      "clip_frac_low": masked.masked_mean((ratio < 1.0 - eps_low) & (advantages < 0), response_mask),
      "clip_frac_high": masked.masked_mean((ratio > 1.0 + eps_high) & (advantages > 0), response_mask),
      "approx_kl": masked.masked_mean(ratio - 1.0 - log_ratio, response_mask),
      "ratio_mean": masked.masked_mean(ratio, response_mask),
  }
  return loss, metrics


def truncated_importance_weights(old_logprobs: jax.Array, sampler_logprobs: jax.Array,
                                 response_mask: jax.Array, *,
                                 cap: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """TIS weights w_t = min(exp(log π_old − log π_sampler), cap) `[B, T]` and their metrics: `tis_weight_mean`,
  `tis_clip_frac` (tokens whose ratio exceeds the cap), over valid tokens."""
  ratio = jnp.exp(jnp.where(response_mask, _f32(old_logprobs) - _f32(sampler_logprobs), 0.0))
  weights = jnp.minimum(ratio, cap)
  return weights, {"tis_weight_mean": masked.masked_mean(weights, response_mask),
                   "tis_clip_frac": masked.masked_mean(ratio > cap, response_mask)}


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    response_mask: jax.Array,
    *,
    clip_range: float | None = None,
    mode: LossAggregation = "token-mean",
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Squared-error value loss ½·(V − R)², optionally clipped around the rollout's values.

  With clip c: ½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²) as in PPO2. Metrics:
  `clip_frac` (tokens where the clipped term is the larger) and `explained_variance`.
  """
  values, old_values, returns = _f32(values), _f32(old_values), _f32(returns)
  squared_error = (values - returns) ** 2
  metrics = {}
  if clip_range is not None:
    clipped_values = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    clipped_error = (clipped_values - returns) ** 2
    metrics["clip_frac"] = masked.masked_mean(clipped_error > squared_error, response_mask)
    squared_error = jnp.maximum(squared_error, clipped_error)
  loss = 0.5 * aggregate_loss(squared_error, response_mask, mode=mode, denominator=denominator)
  metrics["explained_variance"] = explained_variance(values, returns, response_mask)
  return loss, metrics


def positive_example_nll_loss(
    logprobs: jax.Array, response_mask: jax.Array, is_positive: jax.Array, *,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Negative log-likelihood on correct responses (VAPO §4.3), averaged over their tokens.

    L_NLL = −Σ_{b∈correct} Σ_t m·log π(o_{b,t}) / Σ_{b∈correct} |o_b|

  `is_positive` is `[B]` (true where the verifier judged the response equivalent to the
  reference), or per token like `response_mask` (packed rows). Zero, not NaN, when the batch has no
  positive response. `denominator` replaces the positive-token count (see `aggregate_loss`).
  Metrics: `positive_frac` (the fraction of the sequences that are positive; with per-token
  verdicts, of the valid tokens) and `positive_tokens`.
  """
  is_positive = jnp.asarray(is_positive).astype(bool)
  response_mask = jnp.asarray(response_mask).astype(bool)
  positive = is_positive if is_positive.ndim == response_mask.ndim else is_positive[:, None]
  positive_mask = response_mask & positive
  loss = aggregate_loss(-_f32(logprobs), positive_mask, mode="token-mean", denominator=denominator)
  metrics = {
      "positive_frac": (jnp.mean(_f32(is_positive)) if is_positive.ndim < response_mask.ndim
                        else masked.masked_mean(is_positive, response_mask)),
      "positive_tokens": masked.masked_count(positive_mask),
  }
  return loss, metrics


def reference_entropy_from_logits(logits: jax.Array) -> jax.Array:
  """Entropy H = logsumexp(z) − Σ_v softmax(z)_v·z_v of the categorical over the last axis.

  `[..., V]` logits to `[...]` entropies, in float32.
  """
  logits = _f32(logits)
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)
  return log_normalizer - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


def kl_penalty(
    logprobs: jax.Array, ref_logprobs: jax.Array, *, estimator: KLEstimator = "k3"
) -> jax.Array:
  """Per-token estimates of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL").

  With r = log π_ref − log π:  k1 = −r,  k2 = ½·r²,  k3 = exp(r) − 1 − r (unbiased, ≥ 0).
  """
  log_ratio = _f32(ref_logprobs) - _f32(logprobs)
  match estimator:
    case "k1":
      return -log_ratio
    case "k2":
      return 0.5 * log_ratio**2
    case "k3":
      # Clamp the exponent so a wildly off-policy token cannot overflow to inf.
      return jnp.exp(jnp.minimum(log_ratio, 20.0)) - 1.0 - log_ratio
    case _:
      raise ValueError(f"unknown KL estimator {estimator!r}")


def explained_variance(values: jax.Array, returns: jax.Array, response_mask: jax.Array) -> jax.Array:
  """1 − Var(R − V) / Var(R) over valid tokens; 0 when the returns have no variance."""
  returns = _f32(returns)
  residual_var = masked.masked_var(returns - _f32(values), response_mask)
  returns_var = masked.masked_var(returns, response_mask)
  ok = returns_var > 1e-8  # Constant returns (every response scored the same): no variance to explain.
  return jnp.where(ok, 1.0 - residual_var / jnp.where(ok, returns_var, 1.0), 0.0)
