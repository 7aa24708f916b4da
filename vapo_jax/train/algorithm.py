"""The algorithm's glue: which advantage estimator and losses a config selects.

This module reads `AlgoConfig` and calls the pure functions in `advantages`, `losses` and
`masked`; it is what the train step calls, and the one place where VAPO, PPO, GRPO and DAPO differ.

The VAPO techniques it switches (Yue et al. 2025, arXiv 2504.05118): decoupled GAE (§4.1;
value pretraining, also §4.1, is a trainer stage: its targets, prefix labels and early stopping are here),
length-adaptive λ_actor and the token-level
loss (§4.2), clip-higher and the positive-example NLL (§4.3; group sampling, also §4.3, is the
rollout's `samples_per_prompt`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from vapo_jax.config import AlgoConfig
from vapo_jax.rl import advantages as adv
from vapo_jax.rl import losses, masked, positions


class Denominators(NamedTuple):
  """Normalisers of a whole mini-batch, so micro-batch losses add up to the mini-batch loss."""

  policy: jax.Array  # Valid tokens (token-mean) or non-empty sequences (sequence modes).
  positive_tokens: jax.Array  # Valid tokens of positive (correct) responses.
  value: jax.Array  # Valid tokens (the value loss is a token mean).

  @classmethod
  def of(cls, algo: AlgoConfig, response_mask: jax.Array, is_positive: jax.Array) -> "Denominators":
    return cls.from_lengths(algo, jnp.sum(jnp.asarray(response_mask).astype(jnp.int32), axis=-1), is_positive)

  @classmethod
  def from_lengths(cls, algo: AlgoConfig, response_lengths: jax.Array,
                   is_positive: jax.Array) -> "Denominators":
    """From the mini-batch's response lengths `[B]` and verdicts `[B]` (the same padded or packed)."""
    lengths = jnp.asarray(response_lengths).astype(jnp.float32)
    tokens, sequences = jnp.sum(lengths), jnp.sum(lengths > 0).astype(jnp.float32)
    positive = jnp.sum(jnp.where(jnp.asarray(is_positive).astype(bool), lengths, 0.0))
    return cls(tokens if algo.loss_agg == "token-mean" else sequences, positive, tokens)


class Advantages(NamedTuple):
  advantages: jax.Array  # [B, T] actor advantages (whitened if configured).
  returns: jax.Array  # [B, T] critic targets (zeros for the "group" estimator).
  lam_actor: jax.Array  # [B] λ used for the actor.
  unwhitened: jax.Array  # [B, T] the advantages before whitening (in reward units).


def compute_advantages(
    algo: AlgoConfig,
    rewards: jax.Array,
    values: jax.Array,
    response_mask: jax.Array,
    scores: jax.Array,
    *,
    group_size: int,
) -> Advantages:
  """Advantages and value targets for a rollout batch.

  Args:
    algo: the algorithm config.
    rewards: `[B, T]` token rewards (outcome reward on the last valid token).
    values: `[B, T]` critic values V(s_t) (ignored by the "group" estimator).
    response_mask: `[B, T]`.
    scores: `[B]` outcome scores (the "group" estimator's input).
    group_size: G, samples per prompt (contiguous in the batch).
  """
  lengths = masked.masked_count(response_mask, axis=-1)
  batch = lengths.shape[0]
  if algo.length_adaptive_alpha is not None:
    lam_actor = adv.length_adaptive_lambda(lengths, alpha=algo.length_adaptive_alpha)
  else:
    lam_actor = jnp.full((batch,), algo.lam_actor, jnp.float32)
  match algo.estimator:
    case "gae":
      lam_critic = algo.lam_critic if algo.decoupled_gae else lam_actor
      result = adv.decoupled_gae(rewards, values, response_mask, gamma=algo.gamma,
                                 lam_actor=lam_actor, lam_critic=lam_critic)
      unwhitened, returns = result.advantages, result.returns
      advantages = masked.masked_whiten(unwhitened, response_mask) if algo.whiten_advantages else unwhitened
    case "group":
      advantages = unwhitened = adv.group_normalized_advantages(
          scores, response_mask, group_size=group_size, normalize_std=algo.group_std_normalize)
      returns = jnp.zeros_like(advantages)
    case _:
      raise ValueError(f"unknown estimator {algo.estimator!r}")
  return Advantages(advantages, returns, lam_actor, unwhitened)


def value_pretraining_converged(steps_done: int, best_ev: float | None, steps_since_best: int,
                                algo: AlgoConfig) -> bool:
  """Early stopping of value pretraining, only when `algo.value_pretrain_patience` is set: ≥
  `value_pretrain_min_steps` done, best explained variance ≥ `value_pretrain_min_ev`, no 0.01 rise over it for
  `value_pretrain_patience` steps."""
  return (algo.value_pretrain_patience is not None and steps_done >= algo.value_pretrain_min_steps
          and best_ev is not None and best_ev >= algo.value_pretrain_min_ev
          and steps_since_best >= algo.value_pretrain_patience)


class PrefixLabels(NamedTuple):
  """Value pretraining's prefix labels (`value_pretrain_target="prefix"`), `[B, K]` each: K prefix lengths k
  of each response (uniform over 1 ≤ k < l; k = l for a one-token response) and the reward of response[:k]
  read as a finished response. A prefix's value is fitted where a whole response's outcome is: at response
  index k − 1, V(s_{k−1}), the state before its last token (k = l is the whole response)."""

  lengths: jax.Array  # [B, K] int32 prefix lengths k.
  rewards: jax.Array  # [B, K] float32 the verifier's reward of response[:k].


def value_targets(algo: AlgoConfig, rewards: jax.Array, response_mask: jax.Array,
                  prefixes: PrefixLabels | None = None) -> tuple[jax.Array, jax.Array]:
  """Value pretraining's targets and the tokens its loss counts, `[B, T]` each, by
  `algo.value_pretrain_target`: "returns", the Monte-Carlo returns on every response token (VAPO
  §4.1); "outcome", the outcome reward on the last token alone, as a reward model learns it (the
  critic the paper's PPO starts from); "prefix", "outcome" plus each of `prefixes` at index k − 1 with
  its own verdict, so the reward model learns that an unfinished response is not a correct one (a
  reward model scores only `<eos>`-ended text: earlier, incomplete tokens score low, VAPO §4.1).
  `rewards`: `[B, T]` token rewards (the outcome on the last valid token)."""
  returns = adv.monte_carlo_returns(rewards, response_mask, gamma=algo.gamma)
  match algo.value_pretrain_target:
    case "returns":
      return returns, jnp.asarray(response_mask).astype(bool)
    case "outcome":
      return returns, adv.last_token_mask(response_mask)  # At the last token the return is the outcome.
    case "prefix":
      if prefixes is None:
        raise ValueError('value_pretrain_target="prefix" needs the prefixes\' labels '
                         '(Experience.prefix_labels)')
      rows, index = jnp.arange(returns.shape[0])[:, None], jnp.asarray(prefixes.lengths) - 1
      targets = returns.at[rows, index].set(jnp.asarray(prefixes.rewards, returns.dtype))
      return targets, adv.last_token_mask(response_mask).at[rows, index].set(True)
    case _:
      raise ValueError(f"unknown value pretraining target {algo.value_pretrain_target!r}")


def batch_metrics(rewards: jax.Array, correct: jax.Array, response_mask: jax.Array, prompt_mask: jax.Array, *,
                  max_response_tokens: int) -> dict[str, jax.Array]:
  """The scored rollout `[B]`: `rollout/reward_mean`, `rollout/accuracy` (the fraction of responses the
  verifier judged correct), `rollout/response_len_mean` / `_min`, `rollout/prompt_len_mean` and
  `rollout/truncated_frac` (responses that reached `max_response_tokens`)."""
  lengths = jnp.sum(response_mask, axis=-1)
  return {"rollout/reward_mean": jnp.mean(rewards), "rollout/accuracy": jnp.mean(correct.astype(jnp.float32)),
          "rollout/response_len_mean": jnp.mean(lengths), "rollout/response_len_min": jnp.min(lengths),
          "rollout/prompt_len_mean": jnp.mean(jnp.sum(prompt_mask, axis=-1)),
          "rollout/truncated_frac": jnp.mean((lengths >= max_response_tokens).astype(jnp.float32))}


def advantage_metrics(est: Advantages, values: jax.Array | None, entropy: jax.Array, logprob_gap: jax.Array,
                      response_mask: jax.Array) -> dict[str, jax.Array]:
  """A scored batch's estimates, token means over `response_mask`: the critic's explained variance and mean
  value (0 without a critic), the sampling policy's entropy (`actor/entropy`), `rollout/logprob_gap` (|rollout
  − scoring log-probs|, given per token), the mean return, λ_actor's mean / min / max and |advantage|."""
  mask = response_mask
  critic = {"critic/explained_variance": losses.explained_variance(values, est.returns, mask),
            "critic/value_mean": masked.masked_mean(values, mask)} if values is not None else {
                "critic/explained_variance": 0.0, "critic/value_mean": 0.0}
  return critic | {
      "actor/entropy": masked.masked_mean(entropy, mask),  # The sampling policy's, on this batch.
      "rollout/logprob_gap": masked.masked_mean(logprob_gap, mask),
      "critic/return_mean": masked.masked_mean(est.returns, mask),
      "adv/lam_actor_mean": jnp.mean(est.lam_actor), "adv/lam_actor_min": jnp.min(est.lam_actor),
      "adv/lam_actor_max": jnp.max(est.lam_actor),
      "adv/mean_abs": masked.masked_mean(jnp.abs(est.advantages), mask)}


# Relative-position bins of the per-step statistics below: deciles of each response.
DECILES = 10


def position_metrics(advantages: Advantages | None, values: jax.Array | None, returns: jax.Array,
                     response_mask: jax.Array) -> dict[str, jax.Array]:
  """What the critic's bias does, every step (issue 24; VAPO §4.1): the mean advantage over the first
  10 % of each response's tokens, as the actor sees it (`adv/early_mean`, after whitening) and in
  reward units (`adv/early_mean_unwhitened`: 0 in expectation under an unbiased critic), and the
  critic's bias V − G by decile of the response (`critic/value_bias_decile_K`, G the Monte-Carlo
  `returns`). Token means over the batch (`rl/positions.py`); either part is left out when its input
  is None (no actor update, no critic)."""
  metrics = {}
  if advantages is not None:
    metrics["adv/early_mean"] = positions.binned_means(advantages.advantages, response_mask, bins=DECILES)[0]
    metrics["adv/early_mean_unwhitened"] = positions.binned_means(advantages.unwhitened, response_mask,
                                                                  bins=DECILES)[0]
  if values is not None:
    bias = positions.binned_means(values - returns, response_mask, bins=DECILES)
    metrics |= {f"critic/value_bias_decile_{k}": bias[k] for k in range(DECILES)}
  return metrics


def actor_loss(
    algo: AlgoConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    is_positive: jax.Array,
    *,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    denominators: Denominators | None = None,
    segment_ids: jax.Array | None = None,
    norm_length: int | None = None,
    sampler_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clip-higher loss + μ·positive-example NLL (+ KL and entropy terms when configured; the policy term
  weighted by truncated importance sampling with `algo.tis_cap` and `sampler_logprobs`).

  `denominators` (of the whole mini-batch) make this a micro-batch's share of the mini-batch
  loss; None normalises by this batch alone. Packed rows: per-token arrays `[R, L]` (verdicts too)
  with their `segment_ids`, and `norm_length` the response-length cap Tr (`losses.aggregate_loss`).
  """
  d = denominators or Denominators(None, None, None)
  agg = dict(mode=algo.loss_agg, denominator=d.policy, norm_length=norm_length, segment_ids=segment_ids)
  policy, metrics = losses.ppo_policy_loss(
      logprobs, old_logprobs, advantages, response_mask, eps_low=algo.eps_low,
      eps_high=algo.eps_high, dual_clip=algo.dual_clip, sampler_logprobs=sampler_logprobs,
      tis_cap=algo.tis_cap, **agg)
  metrics = {f"actor/{k}": v for k, v in metrics.items()} | {"actor/pg_loss": policy}
  total = policy
  if algo.positive_nll_coef > 0:
    nll, nll_metrics = losses.positive_example_nll_loss(logprobs, response_mask, is_positive,
                                                        denominator=d.positive_tokens)
    total = total + algo.positive_nll_coef * nll
    # The positive fraction is the rollout's accuracy (`rollout/accuracy`, from scoring): not repeated here.
    metrics |= {"actor/nll_loss": nll, "actor/positive_tokens": nll_metrics["positive_tokens"]}
  if algo.kl_coef > 0:
    if ref_logprobs is None:
      raise ValueError("algo.kl_coef > 0 needs ref_logprobs")
    kl = losses.aggregate_loss(losses.kl_penalty(logprobs, ref_logprobs, estimator=algo.kl_estimator),
                               response_mask, **agg)
    total = total + algo.kl_coef * kl
    metrics["actor/ref_kl"] = kl
  if entropy is not None:
    mean_entropy = losses.aggregate_loss(entropy, response_mask, **agg)
    total = total - algo.entropy_coef * mean_entropy
    metrics["actor/entropy_term"] = mean_entropy
  metrics["actor/loss"] = total
  return total, metrics
