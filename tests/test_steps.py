"""Micro-batching in the jitted steps: the layout-preserving split, and that computing in
micro-batches gives the whole-batch results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.train import micro_batches, steps, updates


@pytest.mark.parametrize("b,micro,shards", [(32, 8, 4), (32, 8, 1), (16, 16, 8), (24, 6, 3), (8, 4, 8)])
def test_micro_split_round_trips_and_takes_a_part_of_every_block(b, micro, shards):
  x = np.arange(b * 3).reshape(b, 3)
  chunks = np.asarray(micro_batches.split_micro(jnp.asarray(x), micro, shards))
  assert chunks.shape == (b // micro, micro, 3)
  np.testing.assert_array_equal(np.asarray(micro_batches.unsplit(jnp.asarray(chunks), shards)), x)
  rows = chunks[..., 0] // 3  # Row indices in each micro-batch.
  assert sorted(rows.reshape(-1)) == list(range(b))
  block = b // shards
  if shards > 1 and (block % (b // micro)) == 0:
    for m in range(b // micro):  # An equal part of every device's contiguous block of rows.
      np.testing.assert_array_equal(np.bincount(rows[m] // block, minlength=shards), [micro // shards] * shards)


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_scoring_in_micro_batches_equals_the_whole_batch():
  cfg = preset("micro")
  actor_def, actor = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
  critic = ValueModel(cfg, rngs=nnx.Rngs(1))
  critic.value_head[...] = jax.random.normal(jax.random.key(2), critic.value_head[...].shape)  # Zero at init.
  critic_def, critic = nnx.split(critic)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 259, (16, 12)), jnp.int32)
  attention = jnp.asarray(np.arange(12)[None] >= rng.integers(0, 4, (16, 1)))  # Left padding.
  whole = updates.logprobs_and_entropy(actor_def, actor, tokens, attention, response_len=5, chunk=3)
  parts = updates.logprobs_and_entropy(actor_def, actor, tokens, attention, response_len=5, chunk=3,
                                          micro=4, shards=2)
  for a, b in zip(whole, parts):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  v_whole = updates.values(critic_def, critic, tokens, attention, response_len=5)
  v_parts = updates.values(critic_def, critic, tokens, attention, response_len=5, micro=8, shards=4)
  np.testing.assert_allclose(v_parts, v_whole, rtol=1e-5, atol=1e-6)
  assert not np.allclose(v_whole[:8], v_whole[8:])  # The rows differ, so a mix-up would show.


@pytest.mark.slow  # For time (8 s): make test adds micro-batches up (test_losses) and packs 4 (test_packed_training)
def test_an_update_in_micro_batches_equals_the_whole_mini_batch():
  import optax

  from vapo_jax.config import AlgoConfig
  cfg = preset("micro")
  graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  b, s, tr = 16, 12, 6
  tokens = jnp.asarray(rng.integers(3, 259, (b, s)), jnp.int32)
  attention = jnp.ones((b, s), bool)
  mask = jnp.asarray(np.arange(tr)[None] < rng.integers(1, tr + 1, (b, 1)))  # Ragged lengths.
  logprobs = jax.jit(lambda p: updates.logprobs_and_entropy(graphdef, p, tokens, attention, response_len=tr, chunk=4))
  old = logprobs(params)[0]
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  batch = updates.TrainBatch(tokens, attention, mask, returns=f32(rng.normal(size=(b, tr))),
                                old_values=f32(rng.normal(size=(b, tr))), is_positive=jnp.asarray(rng.random(b) < 0.5),
                                old_logprobs=old + f32(rng.normal(0, 0.3, (b, tr))),
                                advantages=f32(rng.normal(size=(b, tr))), ref_logprobs=old)
  algo = AlgoConfig(mini_batch_responses=b, kl_coef=0.01)
  # Plain SGD with step 1, so the parameters move by exactly the accumulated gradient (AdamW
  # would divide near-zero gradients by their own size and magnify rounding).
  # As make_optimizer.
  tx = optax.apply_if_finite(optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)), 1)
  opt = tx.init(params)
  update = lambda **split: jax.jit(lambda p, o, mb: updates.actor_update(graphdef, tx, p, o, mb, algo=algo, chunk=4,
                                                                         **split))(params, opt, batch)
  whole, parts = update(micro=b), update(micro=4, shards=2)
  for key in whole[2]:
    np.testing.assert_allclose(parts[2][key], whole[2][key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b_ in zip(jax.tree.leaves(whole[0]), jax.tree.leaves(parts[0])):
    np.testing.assert_allclose(b_, a, rtol=1e-5, atol=1e-6)
  assert {"actor/clip_frac_high", "actor/pg_loss", "actor/ref_kl", "actor/positive_tokens"} <= whole[2].keys()


def test_scoring_in_micro_batches_runs_with_remat():
  # `nnx.remat` refuses to update variables whose values were closed over from an outer trace: the
  # micro-batch loops carry the parameters (before, `model.remat=true` failed on the first scoring).
  from vapo_jax.train import packed_batch, packing
  critic = ValueModel(preset("micro"), remat=True, rngs=nnx.Rngs(1))
  critic.value_head[...] = jax.random.normal(jax.random.key(2), critic.value_head[...].shape)
  critic_def, params = nnx.split(critic)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 259, (8, 12)), jnp.int32)
  attention = jnp.ones((8, 12), bool)
  whole = jax.jit(lambda p: updates.values(critic_def, p, tokens, attention, response_len=5))(params)
  parts = jax.jit(lambda p: updates.values(critic_def, p, tokens, attention, response_len=5, micro=2))(params)
  np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
  packed = packing.pack(tokens[:, :7], np.ones((8, 7), bool), tokens[:, 7:], np.ones((8, 5), bool), row_tokens=24,
                        rows=4)
  rows = packed_batch.split_rows(packed_batch.RowBatch(packed.tokens, packed.segment_ids, packed.positions,
                                                       packed.segment_ids > 0), 2)
  values = jax.jit(lambda p: steps.packed_values(critic_def, p, rows))(params)
  np.testing.assert_allclose(packing.reference_unpack_predictions(values.reshape(4, 24), packed), whole,
                             rtol=1e-5, atol=1e-5)
