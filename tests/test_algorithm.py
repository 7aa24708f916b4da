"""`algorithm.py`, the glue between an `AlgoConfig` and the pure math: one table row per switch.

Each case runs `compute_advantages` or `actor_loss` on a small literal batch and compares it with
a slow loop written here from the definition (GAE, whitening, the PPO clip, the NLL on positive
responses, the k3 KL, the mini-batch denominators), eagerly and under `jax.jit`.
"""

import dataclasses

import numpy as np
import pytest

from vapo_jax.config import AlgoConfig
from vapo_jax.train import algorithm

# Two prompts × G = 3 samples; right-padded responses of 6, 3, 1, 4, 5 and 2 tokens in T = 6.
G = 3
LENGTHS = np.array([6, 3, 1, 4, 5, 2])
MASK = np.arange(6)[None] < LENGTHS[:, None]
SCORES = np.array([1.0, -1.0, 1.0, -1.0, -1.0, -1.0], np.float32)  # The second group has no signal.
REWARDS = np.where(np.arange(6)[None] == LENGTHS[:, None] - 1, SCORES[:, None], 0.0).astype(np.float32)
# Critic values; the 7s and 9s sit on padding and must not matter.
VALUES = np.array([[0.1, -0.2, 0.3, 0.5, -0.4, 0.2],
                   [0.6, 0.0, -0.3, 7.0, 7.0, 7.0],
                   [-0.5, 9.0, 9.0, 9.0, 9.0, 9.0],
                   [0.2, 0.2, -0.1, 0.4, 7.0, 7.0],
                   [0.0, 0.3, -0.6, 0.1, 0.8, 9.0],
                   [-0.7, 0.4, 7.0, 7.0, 7.0, 7.0]], np.float32)
OTHER_VALUES = np.flip(VALUES, axis=1).copy() * 2.0 - 0.3  # A different critic, same batch.

# Plain settings the cases switch from: fixed λ, no whitening, no length adaptation.
PLAIN = dict(estimator="gae", gamma=1.0, lam_actor=0.8, lam_critic=1.0, decoupled_gae=True,
             length_adaptive_alpha=None, whiten_advantages=False, value_pretrain_steps=0)


# ------------------------------------------------------------------------------- references
def reference_gae(rewards, values, mask, gamma, lams):
  """Â_t = Σ_k (γλ)^k δ_{t+k} over each row's valid steps, δ_t = r_t + γ·V(s_next) − V(s_t)."""
  out = np.zeros(rewards.shape, np.float64)
  for b in range(rewards.shape[0]):
    steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
    deltas = []
    for i, t in enumerate(steps):
      next_value = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
      deltas.append(float(rewards[b, t]) + gamma * next_value - float(values[b, t]))
    for i, t in enumerate(steps):
      out[b, t] = sum((gamma * lams[b]) ** k * deltas[i + k] for k in range(len(steps) - i))
  return out


def reference_whiten(x, mask):
  """(x − μ) / √(σ² + 1e-8) with μ, σ² (population) over the valid tokens only; 0 elsewhere."""
  valid = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
  mean = sum(valid) / len(valid)
  var = sum((v - mean) ** 2 for v in valid) / len(valid)
  return np.where(mask, (x - mean) / np.sqrt(var + 1e-8), 0.0)


def reference_group(scores, mask, group_size, normalize_std=True, eps=1e-6):
  """(s − mean of the group) / (unbiased std of the group + eps) on each valid token; 0 if no spread."""
  out = np.zeros(mask.shape, np.float64)
  for b in range(len(scores)):
    g = list(scores[b - b % group_size: b - b % group_size + group_size])
    mean = sum(g) / len(g)
    std = (sum((s - mean) ** 2 for s in g) / (len(g) - 1)) ** 0.5
    value = 0.0 if max(g) == min(g) else (scores[b] - mean) / ((std + eps) if normalize_std else 1.0)
    out[b] = np.where(mask[b], value, 0.0)
  return out


def advantages_of(maybe_jit, algo, values=VALUES, mask=MASK):
  run = lambda rewards, values, mask, scores, *, algo, group_size: algorithm.compute_advantages(
      algo, rewards, values, mask, scores, group_size=group_size)
  return maybe_jit(run, algo=algo, group_size=G)(REWARDS, values, mask, SCORES)


# ----------------------------------------------------------------- compute_advantages, one row per switch
def expect_decoupled(result, algo, maybe_jit):
  # Critic targets: λ_critic = 1, γ = 1 → the terminal reward on every valid token, whatever V is.
  np.testing.assert_allclose(result.returns, np.where(MASK, SCORES[:, None], 0.0), rtol=1e-5, atol=1e-6)
  other = advantages_of(maybe_jit, algo, values=OTHER_VALUES)
  np.testing.assert_allclose(other.returns, result.returns, rtol=1e-5, atol=1e-6)
  # The actor still uses λ_actor = 0.8 with the critic's values.
  np.testing.assert_allclose(result.advantages, reference_gae(REWARDS, VALUES, MASK, 1.0, [0.8] * 6),
                             rtol=1e-5, atol=1e-6)


def expect_coupled(result, algo, maybe_jit):
  # Without decoupling the critic's targets are the actor's: λ_actor-GAE + V (γ = 0.9 here).
  gae = reference_gae(REWARDS, VALUES, MASK, 0.9, [0.8] * 6)
  np.testing.assert_allclose(result.advantages, gae, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.returns, np.where(MASK, gae + VALUES, 0.0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(result.returns, np.where(MASK, SCORES[:, None], 0.0))  # Depends on V.


def expect_coupled_length_adaptive(result, algo, maybe_jit):
  # Coupled and length-adaptive: the critic's targets use each row's own λ_actor = 1 − 1/(α·l).
  lams = [max(0.0, 1.0 - 1.0 / (0.5 * n)) for n in LENGTHS]
  gae = reference_gae(REWARDS, VALUES, MASK, 1.0, lams)
  np.testing.assert_allclose(result.returns, np.where(MASK, gae + VALUES, 0.0), rtol=1e-5, atol=1e-6)


def expect_length_adaptive(result, algo, maybe_jit):
  # λ_actor from the valid-token count l (6, 3, 1, 4, 5, 2), not the padded length T = 6:
  # 1 − 1/(0.5·l) = 2/3, 1/3, clip(−1) = 0, 1/2, 3/5, 0.
  lams = [2 / 3, 1 / 3, 0.0, 0.5, 0.6, 0.0]
  np.testing.assert_allclose(result.lam_actor, lams, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.advantages, reference_gae(REWARDS, VALUES, MASK, 1.0, lams),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.returns, np.where(MASK, SCORES[:, None], 0.0), rtol=1e-5, atol=1e-6)


def expect_whitened(result, algo, maybe_jit):
  raw = reference_gae(REWARDS, VALUES, MASK, 1.0, [0.8] * 6)
  np.testing.assert_allclose(result.advantages, reference_whiten(raw, MASK), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(result.unwhitened, raw, rtol=1e-5, atol=1e-6)
  valid = np.asarray(result.advantages)[MASK]
  np.testing.assert_allclose([valid.mean(), valid.var()], [0.0, 1.0], atol=1e-5)
  # Whitening over every position (padding's zeros included) would give a different answer.
  everywhere = (raw - raw.mean()) / np.sqrt(raw.var() + 1e-8)
  assert not np.allclose(np.asarray(result.advantages)[MASK], everywhere[MASK], atol=1e-3)


def expect_group(result, algo, maybe_jit):
  np.testing.assert_array_equal(result.returns, np.zeros(MASK.shape))  # No critic, no targets.
  np.testing.assert_allclose(result.advantages, reference_group(SCORES, MASK, G), rtol=1e-5, atol=1e-6)
  other = advantages_of(maybe_jit, algo, values=OTHER_VALUES)  # Values are ignored.
  np.testing.assert_array_equal(other.advantages, result.advantages)
  np.testing.assert_array_equal(result.unwhitened, result.advantages)  # Group advantages are not whitened.


def expect_group_no_std(result, algo, maybe_jit):
  np.testing.assert_allclose(result.advantages, reference_group(SCORES, MASK, G, normalize_std=False),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(result.returns, np.zeros(MASK.shape))


ADVANTAGE_CASES = {
    "decoupled_gae": (dict(), expect_decoupled),
    "coupled_gae": (dict(decoupled_gae=False, gamma=0.9), expect_coupled),
    "coupled_length_adaptive": (dict(decoupled_gae=False, length_adaptive_alpha=0.5),
                                expect_coupled_length_adaptive),
    "length_adaptive_lambda": (dict(length_adaptive_alpha=0.5), expect_length_adaptive),
    "whitened": (dict(whiten_advantages=True), expect_whitened),
    "group": (dict(estimator="group", whiten_advantages=True), expect_group),
    "group_without_std": (dict(estimator="group", group_std_normalize=False), expect_group_no_std),
}


@pytest.mark.parametrize("case", list(ADVANTAGE_CASES))
def test_compute_advantages(maybe_jit, case):
  overrides, expect = ADVANTAGE_CASES[case]
  algo = AlgoConfig(**(PLAIN | overrides))
  expect(advantages_of(maybe_jit, algo), algo, maybe_jit)


# ---------------------------------------------------------------- value pretraining targets, position metrics
@pytest.mark.parametrize("target", ["returns", "outcome"])
def test_value_targets(maybe_jit, target):
  algo = AlgoConfig(**(PLAIN | dict(value_pretrain_target=target, value_pretrain_steps=5)))
  returns, fitted = maybe_jit(lambda r, m, *, algo: algorithm.value_targets(algo, r, m), algo=algo)(REWARDS, MASK)
  np.testing.assert_allclose(returns, np.where(MASK, SCORES[:, None], 0.0))  # γ = 1: the outcome on every token.
  last = np.arange(6)[None] == LENGTHS[:, None] - 1
  np.testing.assert_array_equal(fitted, MASK if target == "returns" else last)  # A reward model: the last token.


def test_prefix_value_targets(maybe_jit):
  """"prefix": the outcome on each response's last token, and each prefix of length k its own label at index
  k − 1 (where its outcome would sit had the response ended there), every other token outside the loss; a
  prefix drawn twice is fitted once, and k = l is the whole response (its label is the outcome)."""
  algo = AlgoConfig(**(PLAIN | dict(value_pretrain_target="prefix", value_pretrain_steps=5)))
  lengths = np.array([[2, 5], [1, 1], [1, 1], [3, 3], [4, 1], [1, 2]], np.int32)  # k ≤ l; row 5's k = 2 = l.
  labels = np.array([[-1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [-1.0, -1.0]], np.float32)
  prefixes = algorithm.PrefixLabels(lengths, labels)
  targets, fitted = maybe_jit(lambda r, m, p, *, algo: algorithm.value_targets(algo, r, m, p), algo=algo)(
      REWARDS, MASK, prefixes)
  expect_targets, expect_fitted = np.where(MASK, SCORES[:, None], 0.0), np.zeros(MASK.shape, bool)
  for b in range(6):  # From the definition: the last token's outcome, then each prefix's own label.
    expect_fitted[b, LENGTHS[b] - 1] = True
    for k, label in zip(lengths[b], labels[b]):
      expect_targets[b, k - 1], expect_fitted[b, k - 1] = label, True
  np.testing.assert_array_equal(fitted, expect_fitted)
  np.testing.assert_allclose(targets, expect_targets)
  assert np.asarray(fitted).sum() == 13  # 6 last tokens, 7 other positions (rows 1, 3 drew one k twice; 2, 5: k = l).
  with pytest.raises(ValueError, match="prefix"):
    algorithm.value_targets(algo, REWARDS, MASK)


def test_position_metrics(maybe_jit):
  """The first decile's mean advantage and V − G by decile, against a loop over the tokens' deciles
  ⌊10·i/l⌋ (here l ≤ 6, so the first decile is each response's first token, and deciles 1, 4 and 9
  are empty: 0)."""
  algo = AlgoConfig(**(PLAIN | dict(whiten_advantages=True)))
  est = advantages_of(maybe_jit, algo)
  returns = np.where(MASK, SCORES[:, None], 0.0).astype(np.float32)
  metrics = maybe_jit(algorithm.position_metrics)(est, VALUES, returns, MASK)
  decile = np.where(MASK, (10 * np.arange(6)[None]) // LENGTHS[:, None], -1)
  np.testing.assert_array_equal(decile[0], [0, 1, 3, 5, 6, 8])
  np.testing.assert_allclose(metrics["adv/early_mean"], np.mean(np.asarray(est.advantages)[:, 0]), rtol=1e-5)
  raw = reference_gae(REWARDS, VALUES, MASK, 1.0, [0.8] * 6)
  np.testing.assert_allclose(metrics["adv/early_mean_unwhitened"], raw[:, 0].mean(), rtol=1e-5)
  for k in range(10):
    bias = (VALUES - returns)[decile == k]
    np.testing.assert_allclose(metrics[f"critic/value_bias_decile_{k}"], bias.mean() if bias.size else 0.0,
                               rtol=1e-5, atol=1e-6, err_msg=k)
  assert not {"critic/value_bias_decile_1", "critic/value_bias_decile_4"} - metrics.keys()
  assert set(algorithm.position_metrics(None, VALUES, returns, MASK)) == {f"critic/value_bias_decile_{k}"
                                                                          for k in range(10)}
  assert set(algorithm.position_metrics(est, None, returns, MASK)) == {"adv/early_mean", "adv/early_mean_unwhitened"}


# ------------------------------------------------------------------------------ actor_loss
RNG = np.random.default_rng(1)
LOGPROBS = -RNG.exponential(size=MASK.shape).astype(np.float32)
OLD_LOGPROBS = (LOGPROBS + RNG.normal(scale=0.3, size=MASK.shape)).astype(np.float32)  # Ratios beyond both clips.
REF_LOGPROBS = (LOGPROBS + RNG.normal(scale=0.2, size=MASK.shape)).astype(np.float32)
ADVANTAGES = np.where(MASK, RNG.normal(size=MASK.shape), 0.0).astype(np.float32)
ENTROPY = RNG.uniform(0.5, 2.0, size=MASK.shape).astype(np.float32)
IS_POSITIVE = SCORES > 0


def reference_actor_loss(algo, rows, *, use_kl, use_entropy):
  """The micro-batch `rows`' share of the mini-batch loss (all six rows), from the definitions:
  PPO clip-higher (and dual clip) aggregated with the mini-batch's token or sequence count, + μ·NLL
  over the mini-batch's positive tokens, + β·k3 KL, − c_H·entropy (aggregated like the PG loss)."""
  tokens = int(MASK.sum())
  sequences = int(MASK.any(axis=1).sum())
  positive_tokens = int(MASK[IS_POSITIVE].sum())

  def ppo(b, t):
    ratio = np.exp(float(LOGPROBS[b, t]) - float(OLD_LOGPROBS[b, t]))
    a = float(ADVANTAGES[b, t])
    loss = max(-a * ratio, -a * min(max(ratio, 1 - algo.eps_low), 1 + algo.eps_high))
    if algo.dual_clip is not None and a < 0:
      loss = min(loss, -a * algo.dual_clip)
    return loss

  def k3(b, t):
    r = float(REF_LOGPROBS[b, t]) - float(LOGPROBS[b, t])
    return np.exp(r) - 1 - r

  def aggregate(token_loss):
    if algo.loss_agg == "token-mean":
      return sum(token_loss(b, t) for b in rows for t in range(6) if MASK[b, t]) / tokens
    assert algo.loss_agg == "seq-mean-token-mean"
    per_row = [sum(token_loss(b, t) for t in range(6) if MASK[b, t]) / LENGTHS[b] for b in rows]
    return sum(per_row) / sequences

  total = aggregate(ppo)
  nll = -sum(float(LOGPROBS[b, t]) for b in rows if IS_POSITIVE[b] for t in range(6) if MASK[b, t])
  total += algo.positive_nll_coef * nll / positive_tokens
  if use_kl:
    total += algo.kl_coef * aggregate(k3)
  if use_entropy:
    total -= algo.entropy_coef * aggregate(lambda b, t: float(ENTROPY[b, t]))
  return total


LOSS_CASES = {
    "pg_token_mean": dict(positive_nll_coef=0.0),
    "pg_seq_mean": dict(positive_nll_coef=0.0, loss_agg="seq-mean-token-mean"),
    "symmetric_clip": dict(positive_nll_coef=0.0, eps_high=0.2),
    "dual_clip": dict(positive_nll_coef=0.0, dual_clip=1.5),
    "positive_nll": dict(positive_nll_coef=0.3),
    "kl": dict(positive_nll_coef=0.0, kl_coef=0.05),
    "entropy": dict(positive_nll_coef=0.0, entropy_coef=0.01),
    "everything_seq_mean": dict(positive_nll_coef=0.3, kl_coef=0.05, entropy_coef=0.01,
                                loss_agg="seq-mean-token-mean", dual_clip=3.0),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_actor_loss_micro_batches_add_up_to_the_reference(maybe_jit, case):
  algo = AlgoConfig(**(PLAIN | LOSS_CASES[case]))
  use_kl, use_entropy = algo.kl_coef > 0, algo.entropy_coef > 0
  denominators = algorithm.Denominators.of(algo, MASK, IS_POSITIVE)

  def loss(logprobs, old, advantages, mask, positive, ref, entropy, denominators, *, algo):
    return algorithm.actor_loss(algo, logprobs, old, advantages, mask, positive, ref_logprobs=ref,
                                entropy=entropy, denominators=denominators)

  run = maybe_jit(loss, algo=algo)
  arrays = (LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, IS_POSITIVE, REF_LOGPROBS if use_kl else None,
            ENTROPY if use_entropy else None)
  shares = []
  for rows in ([0, 1], [2, 3], [4, 5]):  # Micro-batches of two responses.
    share, metrics = run(*(a[rows] if a is not None else None for a in arrays), denominators)
    expected = reference_actor_loss(algo, rows, use_kl=use_kl, use_entropy=use_entropy)
    np.testing.assert_allclose(share, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["actor/loss"], share, rtol=1e-6)
    shares.append(float(share))
  # The whole mini-batch normalised by itself (denominators=None) is the sum of the shares.
  whole, metrics = run(*arrays, None)
  np.testing.assert_allclose(whole, sum(shares), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(whole, reference_actor_loss(algo, range(6), use_kl=use_kl, use_entropy=use_entropy),
                             rtol=1e-5, atol=1e-6)
  # The policy-gradient term alone, and which terms are reported.
  pg_only = dataclasses.replace(algo, positive_nll_coef=0.0, kl_coef=0.0, entropy_coef=0.0)
  np.testing.assert_allclose(metrics["actor/pg_loss"],
                             reference_actor_loss(pg_only, range(6), use_kl=False, use_entropy=False),
                             rtol=1e-5, atol=1e-6)
  assert ("actor/nll_loss" in metrics) == (algo.positive_nll_coef > 0)
  assert ("actor/ref_kl" in metrics) == use_kl
  assert ("actor/entropy_term" in metrics) == use_entropy
  assert ("actor/dual_clip_frac" in metrics) == (algo.dual_clip is not None)


def test_denominators_count_the_mini_batch():
  algo = AlgoConfig(**PLAIN)
  mask = MASK.copy()
  mask[2] = False  # An empty response: counts for neither tokens nor sequences.
  d = algorithm.Denominators.of(algo, mask, IS_POSITIVE)
  assert (float(d.policy), float(d.value), float(d.positive_tokens)) == (20.0, 20.0, 6.0)
  d = algorithm.Denominators.of(dataclasses.replace(algo, loss_agg="seq-mean-token-mean"), mask, IS_POSITIVE)
  assert (float(d.policy), float(d.value)) == (5.0, 20.0)


def test_kl_needs_a_reference_policy():
  algo = AlgoConfig(**(PLAIN | dict(kl_coef=0.01)))
  with pytest.raises(ValueError, match="ref_logprobs"):
    algorithm.actor_loss(algo, LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, IS_POSITIVE)
  # Without a KL term no reference is needed.
  loss, _ = algorithm.actor_loss(AlgoConfig(**PLAIN), LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, IS_POSITIVE)
  assert np.isfinite(float(loss))


def test_unknown_estimator_is_refused():
  algo = AlgoConfig(**PLAIN)
  object.__setattr__(algo, "estimator", "mystery")  # Past validation, as a config from elsewhere might be.
  with pytest.raises(ValueError, match="estimator"):
    algorithm.compute_advantages(algo, REWARDS, VALUES, MASK, SCORES, group_size=G)


def test_reference_loss_is_sensitive_to_the_clip():
  # Guard on the literal batch: some ratios fall outside [1 − ε_low, 1 + ε_high] for both signs of Â,
  # so the clip-higher, dual-clip and symmetric cases really differ.
  ratio = np.exp(LOGPROBS - OLD_LOGPROBS)[MASK]
  advantages = ADVANTAGES[MASK]
  assert np.any((ratio > 1.28) & (advantages > 0)) and np.any((ratio < 0.8) & (advantages < 0))
  assert np.any((ratio > 1.5) & (advantages < 0))  # Dual clip 1.5 binds somewhere.
  assert np.any((ratio > 1.2) & (ratio < 1.28) & (advantages > 0))
