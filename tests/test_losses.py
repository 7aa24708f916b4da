"""PPO, value, NLL, entropy and KL losses against loops written from their definitions."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.rl import losses, masked

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def reference_aggregate(token_losses, mask, mode, norm_length=None):
  rows = [[token_losses[b, t] for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
  rows = [r for r in rows if r]
  if not rows:
    return 0.0
  if mode == "token-mean":
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
  if mode == "seq-mean-token-mean":
    return np.mean([sum(r) / len(r) for r in rows])
  if mode == "seq-mean-token-sum":
    return np.mean([sum(r) for r in rows])
  return np.mean([sum(r) / (norm_length or mask.shape[1]) for r in rows])


def reference_ppo_token(logp, old, a, eps_low, eps_high, dual_clip=None):
  ratio = np.exp(logp - old)
  loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
  if dual_clip is not None and a < 0:
    loss = min(loss, -a * dual_clip)
  return loss


def batch(seed, b=4, t=7, all_masked_row=True):
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(size=(b, t)).astype(np.float32)
  old = (logp + rng.normal(scale=0.4, size=(b, t))).astype(np.float32)
  a = rng.normal(size=(b, t)).astype(np.float32)
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  if all_masked_row:
    mask[-1] = False
  return logp, old, a, mask


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(maybe_jit, mode):
  x = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
  mask = np.random.default_rng(1).uniform(size=(5, 6)) < 0.6
  mask[2] = False
  got = maybe_jit(losses.aggregate_loss, mode=mode)(x, mask)
  np.testing.assert_allclose(got, reference_aggregate(x, mask, mode), atol=1e-6)


def test_token_mean_is_sum_over_total_length():
  x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], bool)
  # Σ_i Σ_t ℓ / Σ_i |o_i| = (1+2+3+4+10) / (4+1) = 4; the sequence mean would be (2.5 + 10) / 2.
  assert float(losses.aggregate_loss(x, mask, mode="token-mean")) == pytest.approx(4.0)
  assert float(losses.aggregate_loss(x, mask, mode="seq-mean-token-mean")) == pytest.approx(6.25)
  assert float(losses.aggregate_loss(x, mask, mode="seq-mean-token-sum-norm", norm_length=2)) == pytest.approx(5.0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_matches_reference(maybe_jit, mode, dual_clip):
  logp, old, a, mask = batch(2)
  a[0, 0] = -2.0
  old[0, 0] = logp[0, 0] - 2.0  # ratio e² ≈ 7.4 on a negative advantage: dual clip bites.
  fn = maybe_jit(losses.ppo_policy_loss, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, mode=mode)
  loss, metrics = fn(logp, old, a, mask)
  tokens = np.vectorize(reference_ppo_token)(logp, old, a, 0.2, 0.28, dual_clip)
  np.testing.assert_allclose(loss, reference_aggregate(tokens, mask, mode), atol=1e-5)
  ratio = np.exp(logp - old)
  low = np.sum(mask & (ratio < 0.8) & (a < 0)) / mask.sum()
  high = np.sum(mask & (ratio > 1.28) & (a > 0)) / mask.sum()
  np.testing.assert_allclose(metrics["clip_frac_low"], low, atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_high"], high, atol=1e-6)
  k3 = np.sum(np.where(mask, ratio - 1 - np.log(ratio), 0)) / mask.sum()
  np.testing.assert_allclose(metrics["approx_kl"], k3, rtol=1e-4)


def test_symmetric_clip_is_standard_ppo():
  logp, old, a, mask = batch(3)
  loss, _ = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.2, mode="token-mean")
  ratio = np.exp(logp - old)
  standard = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
  np.testing.assert_allclose(loss, np.sum(standard * mask) / mask.sum(), atol=1e-6)


def test_clip_higher_differs_from_symmetric_only_above():
  logp, old, a, mask = batch(4)
  sym = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.2)[0]
  higher = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28)[0]
  ratio = np.exp(logp - old)
  affected = mask & (ratio > 1.2) & (a > 0)
  assert affected.any()
  # Raising the upper clip lets positive-advantage tokens push their ratio further: lower loss.
  assert float(higher) < float(sym)


def test_gradient_vanishes_where_clip_is_active():
  # Token 0: Â > 0, ratio 1.5 > 1 + ε_high: clipped, no gradient. Token 1: Â < 0, ratio 0.5 < 1 − ε_low:
  # clipped, no gradient. Token 2: Â > 0, ratio 0.5: the clip is on the other side, gradient flows.
  # Token 3: Â < 0, ratio 1.5: gradient flows (PPO's pessimistic bound keeps the unclipped term).
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 0.5, 0.5, 1.5]]))
  a = jnp.array([[1.0, -1.0, 1.0, -1.0]])
  mask = jnp.ones((1, 4), bool)
  grad = jax.grad(lambda lp: losses.ppo_policy_loss(lp, old, a, mask, eps_low=0.2, eps_high=0.28)[0])(logp)
  np.testing.assert_allclose(grad[0, :2], 0.0)
  np.testing.assert_allclose(grad[0, 2:], [-0.5 / 4, 1.5 / 4], rtol=1e-6)  # −Â·ρ / N


def test_dual_clip_bounds_negative_advantage_loss():
  old = jnp.zeros((1, 2))
  logp = jnp.log(jnp.array([[10.0, 10.0]]))
  a = jnp.array([[-1.0, 1.0]])
  mask = jnp.ones((1, 2), bool)
  loss, metrics = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
  # Token 0: min(max(10, 0.8·... ), 3) = 3; token 1: −min(10, 1.28) = −1.28.
  np.testing.assert_allclose(loss, (3.0 - 1.28) / 2, rtol=1e-6)
  np.testing.assert_allclose(metrics["dual_clip_frac"], 0.5)


def test_value_loss():
  rng = np.random.default_rng(5)
  v, old, ret = (rng.normal(size=(3, 5)).astype(np.float32) for _ in range(3))
  mask = rng.uniform(size=(3, 5)) < 0.7
  loss, m = losses.value_loss(v, old, ret, mask)
  np.testing.assert_allclose(loss, 0.5 * np.sum(mask * (v - ret) ** 2) / mask.sum(), rtol=1e-6)
  loss_c, mc = losses.value_loss(v, old, ret, mask, clip_range=0.2)
  clipped = old + np.clip(v - old, -0.2, 0.2)
  expected = 0.5 * np.sum(mask * np.maximum((v - ret) ** 2, (clipped - ret) ** 2)) / mask.sum()
  np.testing.assert_allclose(loss_c, expected, rtol=1e-6)
  np.testing.assert_allclose(mc["clip_frac"], np.sum(mask * ((clipped - ret) ** 2 > (v - ret) ** 2)) / mask.sum())


def test_explained_variance():
  rng = np.random.default_rng(6)
  ret = rng.normal(size=(4, 6)).astype(np.float32)
  mask = rng.uniform(size=(4, 6)) < 0.8
  np.testing.assert_allclose(losses.explained_variance(ret, ret, mask), 1.0)
  v = ret + rng.normal(size=ret.shape).astype(np.float32)
  r, res = ret[mask], (ret - v)[mask]
  np.testing.assert_allclose(losses.explained_variance(v, ret, mask), 1 - res.var() / r.var(), rtol=1e-5)
  assert float(losses.explained_variance(v, np.ones_like(ret), mask)) == 0.0


def test_positive_nll_only_touches_positive_rows():
  logp, _, _, mask = batch(7, all_masked_row=False)
  positive = np.array([True, False, True, False])
  loss, metrics = losses.positive_example_nll_loss(logp, mask, positive)
  rows = mask & positive[:, None]
  np.testing.assert_allclose(loss, -np.sum(logp * rows) / rows.sum(), rtol=1e-6)
  grad = jax.grad(lambda lp: losses.positive_example_nll_loss(lp, mask, positive)[0])(logp)
  assert not np.any(np.asarray(grad)[~positive]) and np.all(np.asarray(grad)[rows] < 0)
  np.testing.assert_allclose(metrics["positive_frac"], 0.5)


def test_positive_nll_is_zero_without_positives():
  logp, _, _, mask = batch(8)
  loss, _ = losses.positive_example_nll_loss(logp, mask, np.zeros(4, bool))
  assert float(loss) == 0.0
  grad = jax.grad(lambda lp: losses.positive_example_nll_loss(lp, mask, np.zeros(4, bool))[0])(logp)
  assert np.all(np.isfinite(grad)) and not np.any(grad)


def test_entropy_from_logits():
  logits = np.random.default_rng(9).normal(size=(2, 3, 11)).astype(np.float32) * 3
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(losses.reference_entropy_from_logits(logits), -np.sum(p * np.log(p), -1), rtol=1e-5)
  bf16 = losses.reference_entropy_from_logits(jnp.asarray(logits, jnp.bfloat16))
  assert bf16.dtype == jnp.float32
  np.testing.assert_allclose(losses.reference_entropy_from_logits(np.zeros((1, 8))), [np.log(8)], rtol=1e-6)


def test_kl_estimators():
  logp = np.log(np.array([0.2, 0.5, 0.9], np.float32))
  ref = np.log(np.array([0.4, 0.5, 0.3], np.float32))
  r = ref - logp
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, estimator="k1"), -r, rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, estimator="k2"), 0.5 * r**2, rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, estimator="k3"), np.exp(r) - 1 - r, rtol=1e-5)
  assert np.all(np.asarray(losses.kl_penalty(logp, ref, estimator="k3")) >= 0)


def test_all_masked_batch_is_finite():
  logp, old, a, mask = batch(10)
  mask = np.zeros_like(mask)
  for mode in MODES:
    loss, metrics = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28, mode=mode)
    assert float(loss) == 0.0 and all(np.isfinite(v) for v in metrics.values())
  vloss, vm = losses.value_loss(a, old, logp, mask, clip_range=0.5)
  assert float(vloss) == 0.0 and all(np.isfinite(v) for v in vm.values())
  grad = jax.grad(lambda lp: losses.ppo_policy_loss(lp, old, a, mask, eps_low=0.2, eps_high=0.28)[0])(logp)
  assert np.all(np.isfinite(grad))


def test_bfloat16_inputs_are_computed_in_float32():
  logp, old, a, mask = batch(11)
  as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  loss, _ = losses.ppo_policy_loss(as_bf16(logp), as_bf16(old), as_bf16(a), mask, eps_low=0.2, eps_high=0.28)
  assert loss.dtype == jnp.float32
  ref, _ = losses.ppo_policy_loss(*(np.asarray(as_bf16(x), np.float32) for x in (logp, old, a)), mask,
                                  eps_low=0.2, eps_high=0.28)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  assert masked.masked_mean(as_bf16(a), mask).dtype == jnp.float32


# Random cases at one padded shape [5, 8] under one `jit` per mode: a drawn [b, t] case sits in the
# top-left corner, the padding is masked, and t is the Dr. GRPO norm length (traced, not a shape).
PAD_B, PAD_T = 5, 8
_ppo_loss = jax.jit(lambda logp, old, a, mask, t, mode: losses.ppo_policy_loss(
    logp, old, a, mask, eps_low=0.2, eps_high=0.28, mode=mode, norm_length=t), static_argnames="mode")


def _padded(x, fill):
  out = np.full((PAD_B, PAD_T), fill, x.dtype)
  out[:x.shape[0], :x.shape[1]] = x
  return out


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(
    st.integers(1, PAD_B).flatmap(lambda b: st.integers(1, PAD_T).flatmap(lambda t: st.tuples(
        hnp.arrays(np.float32, (b, t), elements=st.floats(-4, 0, width=32)),
        hnp.arrays(np.float32, (b, t), elements=st.floats(-4, 0, width=32)),
        hnp.arrays(np.float32, (b, t), elements=st.floats(-3, 3, width=32)),
        hnp.arrays(np.bool_, (b, t))))),
    st.sampled_from(MODES))
def test_ppo_property(inputs, mode):
  logp, old, a, mask = inputs
  t = mask.shape[1]
  loss, metrics = _ppo_loss(_padded(logp, -1.0), _padded(old, -2.0), _padded(a, 5.0), _padded(mask, False), t,
                            mode=mode)
  tokens = np.vectorize(reference_ppo_token)(logp, old, a, 0.2, 0.28)
  np.testing.assert_allclose(loss, reference_aggregate(tokens, mask, mode), atol=1e-4, rtol=1e-4)
  assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_denominator_add_up(mode):
  logp, old, a, mask = batch(12, b=6, all_masked_row=False)
  full, _ = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28, mode=mode)
  denominator = mask.sum() if mode == "token-mean" else mask.any(-1).sum()
  parts = [losses.ppo_policy_loss(logp[i:i + 2], old[i:i + 2], a[i:i + 2], mask[i:i + 2], eps_low=0.2,
                                  eps_high=0.28, mode=mode, denominator=denominator)[0] for i in (0, 2, 4)]
  np.testing.assert_allclose(sum(parts), full, rtol=1e-5)
  positive = np.array([True, False, True, True, False, True])
  nll, _ = losses.positive_example_nll_loss(logp, mask, positive)
  count = (mask & positive[:, None]).sum()
  nll_parts = [losses.positive_example_nll_loss(logp[i:i + 3], mask[i:i + 3], positive[i:i + 3], denominator=count)[0]
               for i in (0, 3)]
  np.testing.assert_allclose(sum(nll_parts), nll, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_on_packed_rows_averages_per_segment(maybe_jit, mode):
  # Five sequences (valid lengths 3, 0, 2, 4, 1 of T = 4) laid end to end in two rows of 6, with
  # padding tokens (masked, any value) around them: row 0 = [s0 s0 s0 | s2 s2 | pad],
  # row 1 = [s3 s3 s3 s3 | s4 | pad]; s1 is empty (masked in the padded batch, absent when packed).
  x = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)
  mask = np.arange(4)[None] < np.array([3, 0, 2, 4, 1])[:, None]
  packed = np.full((2, 6), 99.0, np.float32)
  packed[0, :3], packed[0, 3:5], packed[1, :4], packed[1, 4] = x[0, :3], x[2, :2], x[3], x[4, 0]
  segment_ids = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 2, 0]])
  packed_mask = segment_ids > 0
  want = reference_aggregate(x, mask, mode, norm_length=4)
  got = maybe_jit(losses.aggregate_loss, mode=mode, norm_length=4, segment_ids=segment_ids)(packed, packed_mask)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # Row-wise (no segment ids) the sequence modes would average two "sequences" per row: a different loss.
  if mode != "token-mean":
    assert abs(float(losses.aggregate_loss(packed, packed_mask, mode=mode, norm_length=4)) - want) > 1e-3


def test_sum_norm_on_packed_rows_needs_norm_length():
  with pytest.raises(ValueError, match="needs norm_length"):
    losses.aggregate_loss(np.ones((1, 4)), np.ones((1, 4), bool), mode="seq-mean-token-sum-norm",
                          segment_ids=np.ones((1, 4), int))


@pytest.mark.parametrize("jitted", [False, True])
def test_truncated_importance_sampling_weights_each_token_by_the_capped_sampler_ratio(jitted):
  """An injected sampler–trainer mismatch: each token's term times min(π_old / π_sampler, C), by hand."""
  logp, old, a, mask = batch(7)
  sampler = (old + np.random.default_rng(8).normal(scale=0.6, size=old.shape)).astype(np.float32)
  cap = 1.5
  fn = lambda *arrays: losses.ppo_policy_loss(*arrays[:4], eps_low=0.2, eps_high=0.28, mode="token-mean",
                                              sampler_logprobs=arrays[4], tis_cap=cap)
  loss, metrics = (jax.jit(fn) if jitted else fn)(logp, old, a, mask, sampler)
  weights = np.minimum(np.exp(old.astype(np.float64) - sampler), cap)
  tokens = np.vectorize(reference_ppo_token)(logp, old, a, 0.2, 0.28) * weights
  np.testing.assert_allclose(loss, reference_aggregate(tokens, mask, "token-mean"), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["tis_weight_mean"], weights[mask].mean(), rtol=1e-5)
  clipped = np.exp(old.astype(np.float64) - sampler) > cap
  np.testing.assert_allclose(metrics["tis_clip_frac"], clipped[mask].mean(), atol=1e-6)
  assert 0 < clipped[mask].mean() < 1  # Some capped, some not.


def test_without_a_mismatch_or_a_cap_the_loss_is_bitwise_untouched():
  logp, old, a, mask = batch(9)
  plain, _ = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28)
  off, metrics = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28, sampler_logprobs=old - 1.0)
  same, _ = losses.ppo_policy_loss(logp, old, a, mask, eps_low=0.2, eps_high=0.28, sampler_logprobs=old, tis_cap=2.0)
  assert "tis_weight_mean" not in metrics
  np.testing.assert_array_equal(off, plain)
  np.testing.assert_array_equal(same, plain)  # Weights of exactly 1.
