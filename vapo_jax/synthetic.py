"""A synthetic rollout batch for exercising the algorithm's math without a model.

Used by `make train` until the trainer exists. Responses get random lengths; the verifier's
outcome is random with longer responses less often correct; the critic's values are a noisy
estimate of the outcome; the new policy's log-probs are the old ones plus noise, so the PPO ratio
spreads around 1 and both clip sides are exercised.
"""

import jax
import jax.numpy as jnp

from vapo_jax import algorithm, losses
from vapo_jax.config import ExperimentConfig

MAX_SYNTHETIC_RESPONSES = 256
MAX_SYNTHETIC_TOKENS = 1024


def make_batch(config: ExperimentConfig, key: jax.Array) -> dict[str, jax.Array]:
  """A `[B, T]` batch; B and T follow the config, capped at 256 responses × 1024 tokens."""
  group = config.rollout.samples_per_prompt
  prompts = max(1, min(config.rollout.prompts_per_step, MAX_SYNTHETIC_RESPONSES // group))
  batch, steps = prompts * group, min(config.rollout.max_response_tokens, MAX_SYNTHETIC_TOKENS)
  k_len, k_correct, k_value, k_old, k_new, k_ref = jax.random.split(key, 6)
  lengths = jax.random.randint(k_len, (batch,), 1, steps + 1)
  response_mask = jnp.arange(steps)[None] < lengths[:, None]
  p_correct = 0.8 - 0.6 * lengths / steps
  is_positive = jax.random.uniform(k_correct, (batch,)) < p_correct
  scores = jnp.where(is_positive, config.reward.correct, config.reward.incorrect)
  rewards = jnp.where(jnp.arange(steps)[None] == lengths[:, None] - 1, scores[:, None], 0.0)
  values = jnp.where(response_mask, 0.5 * scores[:, None]
                     + 0.5 * jax.random.normal(k_value, (batch, steps)), 0.0)
  old_logprobs = -jax.random.exponential(k_old, (batch, steps))
  logprobs = old_logprobs + 0.2 * jax.random.normal(k_new, (batch, steps))
  ref_logprobs = old_logprobs + 0.1 * jax.random.normal(k_ref, (batch, steps))
  return dict(rewards=rewards, values=values, response_mask=response_mask, scores=scores,
              is_positive=is_positive, old_logprobs=old_logprobs, logprobs=logprobs,
              ref_logprobs=ref_logprobs)


def run_math_on_synthetic_batch(config: ExperimentConfig) -> dict[str, float]:
  """Advantages, actor loss and value loss of the config's algorithm on a synthetic batch."""
  b = make_batch(config, jax.random.key(config.seed))
  algo = config.algo

  @jax.jit
  def step(b):
    est = algorithm.compute_advantages(algo, b["rewards"], b["values"], b["response_mask"],
                                       b["scores"], group_size=config.rollout.samples_per_prompt)
    _, metrics = algorithm.actor_loss(algo, b["logprobs"], b["old_logprobs"], est.advantages,
                                      b["response_mask"], b["is_positive"],
                                      ref_logprobs=b["ref_logprobs"])
    if algo.uses_critic:
      vloss, vmetrics = losses.value_loss(b["values"], b["values"], est.returns, b["response_mask"],
                                          clip_range=algo.value_clip)
      metrics |= {"critic/value_loss": vloss} | {f"critic/{k}": v for k, v in vmetrics.items()}
    lengths = jnp.sum(b["response_mask"], axis=-1)
    metrics |= {
        "rollout/responses": jnp.float32(lengths.shape[0]),
        "rollout/response_len_mean": jnp.mean(lengths),
        "rollout/accuracy": jnp.mean(b["is_positive"]),
        "adv/lam_actor_mean": jnp.mean(est.lam_actor),
        "adv/lam_actor_min": jnp.min(est.lam_actor),
        "adv/lam_actor_max": jnp.max(est.lam_actor),
    }
    return metrics

  return {k: float(v) for k, v in sorted(step(b).items())}
