"""GAE, decoupled GAE, length-adaptive λ, group-normalised advantages and Monte-Carlo returns.

References are slow loops written from the definitions; identities check the conventions.
"""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.rl import advantages as adv


def reference_gae(rewards, values, mask, gamma, lam):
  """Textbook per-trajectory GAE: Â_t = Σ_k (γλ)^k δ_{t+k} over the valid steps of each row."""
  rewards, values, mask = (np.asarray(x, np.float64) for x in (rewards, values, mask))
  lam = np.broadcast_to(np.asarray(lam, np.float64), (rewards.shape[0],))
  out = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
    deltas = []
    for i, t in enumerate(steps):
      next_value = values[b, steps[i + 1]] if i + 1 < len(steps) else 0.0
      deltas.append(rewards[b, t] + gamma * next_value - values[b, t])
    for i, t in enumerate(steps):
      out[b, t] = sum((gamma * lam[b]) ** k * deltas[i + k] for k in range(len(steps) - i))
  return out


def random_batch(seed, batch=5, steps=9, holes=False):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, steps + 1, batch)
  mask = np.arange(steps)[None] < lengths[:, None]
  if holes:
    mask &= rng.uniform(size=mask.shape) < 0.7
  rewards = rng.normal(size=(batch, steps)).astype(np.float32)
  values = rng.normal(size=(batch, steps)).astype(np.float32)
  return rewards, values, mask


def test_hand_worked_example():
  # One sequence of 3 valid tokens then padding; γ = 0.5, λ = 0.5, reward 1 at the last token.
  rewards = jnp.array([[0.0, 0.0, 1.0, 7.0]])  # The 7 sits on padding and must be ignored.
  values = jnp.array([[0.5, 0.25, 0.5, 9.0]])
  mask = jnp.array([[1, 1, 1, 0]], bool)
  # δ2 = 1 − 0.5 = 0.5; δ1 = 0 + 0.5·0.5 − 0.25 = 0; δ0 = 0 + 0.5·0.25 − 0.5 = −0.375.
  # Â2 = 0.5; Â1 = 0 + 0.25·0.5 = 0.125; Â0 = −0.375 + 0.25·0.125 = −0.34375.
  a, r = adv.gae(rewards, values, mask, gamma=0.5, lam=0.5)
  np.testing.assert_allclose(a, [[-0.34375, 0.125, 0.5, 0.0]], atol=1e-6)
  np.testing.assert_allclose(r, [[0.15625, 0.375, 1.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.3), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_reference(maybe_jit, holes, gamma, lam):
  rewards, values, mask = random_batch(0, holes=holes)
  a, r = maybe_jit(adv.gae, gamma=gamma, lam=lam)(rewards, values, mask)
  expected = reference_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(a, expected, atol=1e-5)
  np.testing.assert_allclose(r, np.where(mask, expected + values, 0.0), atol=1e-5)


def test_lambda_one_is_reward_to_go_minus_value(maybe_jit):
  rewards, values, mask = random_batch(1)
  a, r = maybe_jit(adv.gae, gamma=1.0, lam=1.0)(rewards, values, mask)
  reward_to_go = np.flip(np.cumsum(np.flip(np.where(mask, rewards, 0.0), 1), 1), 1)
  np.testing.assert_allclose(a, np.where(mask, reward_to_go - values, 0.0), atol=1e-5)
  np.testing.assert_allclose(r, np.where(mask, reward_to_go, 0.0), atol=1e-5)


def test_lambda_zero_is_td_error(maybe_jit):
  rewards, values, mask = random_batch(2, steps=6)
  a, _ = maybe_jit(adv.gae, gamma=0.9, lam=0.0)(rewards, values, mask)
  next_values = np.concatenate([values[:, 1:], np.zeros_like(values[:, :1])], 1)
  next_values = np.where(np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], 1), next_values, 0.0)
  np.testing.assert_allclose(a, np.where(mask, rewards + 0.9 * next_values - values, 0.0), atol=1e-5)


def test_per_sequence_lambda_equals_rowwise_scalar_calls():
  rewards, values, mask = random_batch(3, holes=True)
  lams = np.array([0.0, 0.3, 0.9, 1.0, 0.5], np.float32)
  a, r = adv.gae(rewards, values, mask, gamma=0.97, lam=jnp.asarray(lams))
  for b, lam in enumerate(lams):
    a_b, r_b = adv.gae(rewards[b:b + 1], values[b:b + 1], mask[b:b + 1], gamma=0.97, lam=float(lam))
    np.testing.assert_allclose(a[b], a_b[0], atol=1e-6)
    np.testing.assert_allclose(r[b], r_b[0], atol=1e-6)


def test_per_sequence_lambda_under_jit():
  rewards, values, mask = random_batch(3)
  lams = jnp.array([0.0, 0.3, 0.9, 1.0, 0.5])
  a, _ = jax.jit(lambda *x: adv.gae(*x[:3], gamma=1.0, lam=x[3]))(rewards, values, mask, lams)
  np.testing.assert_allclose(a, reference_gae(rewards, values, mask, 1.0, np.asarray(lams)), atol=1e-5)


def test_appending_padding_changes_nothing():
  rewards, values, mask = random_batch(4)
  pad = lambda x, fill: np.concatenate([x, np.full((x.shape[0], 5), fill, x.dtype)], 1)
  a, r = adv.gae(rewards, values, mask, gamma=1.0, lam=0.9)
  a_pad, r_pad = adv.gae(pad(rewards, 3.0), pad(values, -2.0), pad(mask, False), gamma=1.0, lam=0.9)
  np.testing.assert_array_equal(a_pad[:, :-5], a)
  np.testing.assert_array_equal(r_pad[:, :-5], r)
  assert not np.any(a_pad[:, -5:]) and not np.any(r_pad[:, -5:])


def test_holes_are_skipped():
  # A masked position in the middle neither contributes nor breaks the recurrence.
  rewards, values, mask = random_batch(5, holes=True)
  a, _ = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
  for b in range(rewards.shape[0]):
    keep = mask[b]
    compact = [x[b][keep][None] for x in (rewards, values, mask)]
    a_b, _ = adv.gae(*compact, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(a[b][keep], a_b[0], atol=1e-6)
    assert not np.any(np.asarray(a[b])[~keep])


def test_rejects_lambda_of_wrong_shape():
  rewards, values, mask = random_batch(0)
  with pytest.raises(ValueError, match="λ must be a scalar or a"):
    adv.gae(rewards, values, mask, gamma=1.0, lam=jnp.ones(3))


def test_decoupled_equals_two_separate_gae_calls():
  rewards, values, mask = random_batch(6, holes=True)
  lam_actor = jnp.asarray(np.random.default_rng(0).uniform(size=5), jnp.float32)
  out = adv.decoupled_gae(rewards, values, mask, gamma=1.0, lam_actor=lam_actor, lam_critic=1.0)
  a_actor, _ = adv.gae(rewards, values, mask, gamma=1.0, lam=lam_actor)
  _, r_critic = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(out.advantages, a_actor, atol=1e-6)
  np.testing.assert_allclose(out.returns, r_critic, atol=1e-6)


def test_decoupled_under_jit_matches_reference():
  rewards, values, mask = random_batch(7)
  lam_actor = jnp.array([0.1, 0.5, 0.0, 0.95, 1.0])
  fn = jax.jit(lambda r, v, m, l: adv.decoupled_gae(r, v, m, gamma=0.99, lam_actor=l, lam_critic=0.7))
  out = fn(rewards, values, mask, lam_actor)
  np.testing.assert_allclose(out.advantages, reference_gae(rewards, values, mask, 0.99, np.asarray(lam_actor)),
                             atol=1e-5)
  np.testing.assert_allclose(out.returns, np.where(mask, reference_gae(rewards, values, mask, 0.99, 0.7) + values, 0),
                             atol=1e-5)


def test_decoupled_gae_is_one_scan():
  rewards, values, mask = random_batch(0)
  jaxpr = jax.make_jaxpr(lambda r, v, m: adv.decoupled_gae(r, v, m, gamma=1.0, lam_actor=0.9, lam_critic=1.0))(
      rewards, values, mask)
  assert str(jaxpr).count("scan[") == 1


def test_length_adaptive_lambda():
  lengths = jnp.array([0, 10, 20, 40, 100, 1000, 20480])
  lam = adv.length_adaptive_lambda(lengths, alpha=0.05)
  expected = [0.0, 0.0, 0.0, 0.5, 0.8, 0.98, 1 - 1 / 1024]
  np.testing.assert_allclose(lam, expected, atol=1e-6)
  assert np.all(np.isfinite(jax.grad(lambda l: adv.length_adaptive_lambda(l, alpha=0.05).sum())(lengths * 1.0)))


def reference_group_advantages(scores, group_size, eps):
  out = []
  for g in range(0, len(scores), group_size):
    group = np.asarray(scores[g:g + group_size], np.float64)
    if np.all(group == group[0]):
      out += [0.0] * group_size
    else:
      out += list((group - group.mean()) / (group.std(ddof=1) + eps))
  return np.array(out)


def test_group_normalized_advantages(maybe_jit):
  scores = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, -1, 1, 0.1, 0.1, 0.1, 0.1], np.float32)
  mask = np.ones((16, 3), bool)
  mask[2, 1:] = False
  a = maybe_jit(adv.group_normalized_advantages, group_size=4)(scores, mask)
  expected = reference_group_advantages(scores, 4, 1e-6)
  np.testing.assert_allclose(a, np.where(mask, expected[:, None], 0.0), atol=1e-5)
  assert not np.any(np.asarray(a)[4:8]) and not np.any(np.asarray(a)[12:16])  # zero-variance groups


def test_group_normalized_rejects_ragged_groups():
  with pytest.raises(ValueError, match="whole number of groups"):
    adv.group_normalized_advantages(jnp.zeros(6), jnp.ones((6, 2), bool), group_size=4)


def test_monte_carlo_returns():
  rewards, _, mask = random_batch(8, holes=True)
  g = adv.monte_carlo_returns(rewards, mask, gamma=0.9)
  expected = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
    for i, t in enumerate(steps):
      expected[b, t] = sum(0.9**k * rewards[b, steps[i + k]] for k in range(len(steps) - i))
  np.testing.assert_allclose(g, expected, atol=1e-5)


def test_last_token_rewards_and_mask(maybe_jit):
  """The score (and the mask) sits on each row's last valid token (holes included); a row with none gets nothing."""
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], bool)
  scores = np.array([1.0, -1.0, 5.0, 2.0, 3.0], np.float32)
  expected, last = np.zeros(mask.shape, np.float32), np.zeros(mask.shape, bool)
  for b, row in enumerate(mask):  # The definition, as a loop.
    valid = [t for t in range(mask.shape[1]) if row[t]]
    if valid:
      expected[b, valid[-1]], last[b, valid[-1]] = scores[b], True
  np.testing.assert_array_equal(maybe_jit(adv.last_token_rewards)(scores, mask), expected)
  np.testing.assert_array_equal(maybe_jit(adv.last_token_mask)(mask), last)


# Random cases at one padded shape [6, 12] under one `jit`: a drawn [batch, steps] case sits in the
# top-left corner, the padding is masked (rewards and values there are noise the GAE must skip), and γ
# and the per-row λ are traced arguments.
PAD_B, PAD_T = 6, 12
_gae = jax.jit(lambda rewards, values, mask, lams, gamma: adv.gae(rewards, values, mask, gamma=gamma, lam=lams))


@st.composite
def gae_inputs(draw):
  batch, steps = draw(st.integers(1, PAD_B)), draw(st.integers(1, PAD_T))
  floats = st.floats(-3, 3, width=32)
  rewards = draw(hnp.arrays(np.float32, (PAD_B, PAD_T), elements=floats))
  values = draw(hnp.arrays(np.float32, (PAD_B, PAD_T), elements=floats))
  mask = np.zeros((PAD_B, PAD_T), bool)
  mask[:batch, :steps] = draw(hnp.arrays(np.bool_, (batch, steps)))
  lams = draw(hnp.arrays(np.float32, (PAD_B,), elements=st.floats(0, 1, width=32)))
  gamma = draw(st.floats(0, 1, width=32))
  return rewards, values, mask, lams, gamma


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(gae_inputs())
def test_gae_property_random_masks(inputs):
  rewards, values, mask, lams, gamma = inputs
  a, r = _gae(rewards, values, mask, lams, np.float32(gamma))
  expected = reference_gae(rewards, values, mask, gamma, lams)
  np.testing.assert_allclose(a, expected, atol=1e-4, rtol=1e-4)
  assert np.all(np.isfinite(r)) and not np.any(np.asarray(a)[~mask])
