"""Chunked log-probs and entropy equal the dense ones (values and gradients), the model-level helper
equals the model's own logits, packed rows give the padded batch's log-probs, and no `[B, Tr, V]`
logits tensor is compiled on the chunked path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hlo_buffers import array_shapes, vocab_arrays
from model_utils import MESHES, SHARDED_CFG, place_module
from vapo_jax.models import logprobs as lp
from vapo_jax.models.config import preset
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import CausalLM, positions_from_mask
from vapo_jax.rl import losses
from vapo_jax.train import packing

B, T, D, V = 3, 37, 24, 101  # T = 37 is not a multiple of any chunk below.


def _inputs(transposed: bool, seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 5)
  hidden = jax.random.normal(k[0], (B, T, D))
  kernel = jax.random.normal(k[1], (V, D) if transposed else (D, V)) * D**-0.5 * 2.0
  tokens = jax.random.randint(k[2], (B, T), 0, V)
  return hidden, kernel, tokens, jax.random.normal(k[3], (B, T)), jax.random.normal(k[4], (B, T))


def _numpy_oracle(hidden, kernel, tokens, transposed):
  """log π and H from the definition, in float64 numpy."""
  logits = np.asarray(hidden, np.float64) @ (np.asarray(kernel, np.float64).T if transposed
                                             else np.asarray(kernel, np.float64))
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
  return picked, -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("transposed", [False, True], ids=["untied", "tied"])
def test_dense_oracle_matches_the_definition(transposed):
  hidden, kernel, tokens, _, _ = _inputs(transposed)
  logprobs, entropy = lp.dense_token_logprobs_entropy(hidden, kernel, tokens, entropy=True, transposed=transposed)
  want_lp, want_h = _numpy_oracle(hidden, kernel, tokens, transposed)
  np.testing.assert_allclose(logprobs, want_lp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(entropy, want_h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transposed", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [1, 8, 37])  # Vocabulary blocks of 3 (the last overlapping), 22, all 101.
def test_chunked_equals_dense_values_and_gradients(transposed, chunk, maybe_jit):
  hidden, kernel, tokens, g_lp, g_h = _inputs(transposed, seed=chunk)

  def objective(fn):  # A weighted sum of both outputs: its gradient checks every cotangent path.
    def f(h, w):
      logprobs, entropy = fn(h, w)
      return jnp.sum(g_lp * logprobs) + jnp.sum(g_h * entropy), (logprobs, entropy)
    return maybe_jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  chunked = objective(lambda h, w: lp.token_logprobs_entropy(h, w, tokens, chunk=chunk, entropy=True,
                                                            transposed=transposed))
  dense = objective(lambda h, w: lp.dense_token_logprobs_entropy(h, w, tokens, entropy=True, transposed=transposed))
  (_, got), got_grads = chunked(hidden, kernel)
  (_, want), want_grads = dense(hidden, kernel)
  for a, b in zip(got, want):
    assert a.shape == (B, T) and a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for a, b, x in zip(got_grads, want_grads, (hidden, kernel)):
    assert a.shape == x.shape and a.dtype == x.dtype
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
  assert float(jnp.max(jnp.abs(want_grads[1]))) > 0.1  # Not vacuous.


def test_without_entropy_the_logprob_gradient_alone():
  hidden, kernel, tokens, g_lp, _ = _inputs(False, seed=3)
  f = lambda fn: jax.grad(lambda h, w: jnp.sum(g_lp * fn(h, w)[0]), argnums=(0, 1))(hidden, kernel)
  chunked = lp.token_logprobs_entropy(hidden, kernel, tokens, chunk=10)
  assert chunked[1] is None
  got = f(lambda h, w: lp.token_logprobs_entropy(h, w, tokens, chunk=10))
  want = f(lambda h, w: lp.dense_token_logprobs_entropy(h, w, tokens))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
  with pytest.raises(ValueError, match="chunk"):
    lp.token_logprobs_entropy(hidden, kernel, tokens, chunk=0)


def test_bfloat16_hidden_with_a_float32_kernel():
  hidden, kernel, tokens, g_lp, g_h = _inputs(False, seed=4)
  loss = lambda h, w: (lambda a, e: jnp.sum(g_lp * a) + jnp.sum(g_h * e))(
      *lp.token_logprobs_entropy(h, w, tokens, chunk=8, entropy=True))
  g_hidden, g_kernel = jax.grad(loss, argnums=(0, 1))(hidden.astype(jnp.bfloat16), kernel)
  assert g_hidden.dtype == jnp.bfloat16 and g_kernel.dtype == jnp.float32  # Each in its input's dtype.
  want_hidden, want_kernel = jax.grad(loss, argnums=(0, 1))(hidden, kernel)
  # bfloat16 has an 8-bit mantissa: agreement to a few parts in a hundred of the largest entry.
  for got, want in ((g_hidden, want_hidden), (g_kernel, want_kernel)):
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.03 * float(jnp.max(jnp.abs(want))))


def _model(tied: bool, seed: int = 0) -> CausalLM:
  cfg = dataclasses.replace(preset("micro"), tie_word_embeddings=tied)
  return CausalLM(cfg, rngs=nnx.Rngs(seed))


def _batch(s: int = 14, tr: int = 9, b: int = 4):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 259, (b, s)), jnp.int32)
  mask = np.arange(s)[None] >= rng.integers(0, s - tr, (b, 1))  # Left-padded prompts.
  mask[0, -2:] = False  # A response shorter than Tr (padding on the right).
  return tokens, jnp.asarray(mask)


def _dense_response(model, tokens, mask, tr):
  """What `train_step` computed before: full logits, sliced to the response, log-softmax, entropy."""
  logits, _ = model(tokens, positions_from_mask(mask), mask)
  start = tokens.shape[1] - tr
  logits = logits[:, start - 1:start - 1 + tr]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, tokens[:, start:, None], -1)[..., 0], losses.reference_entropy_from_logits(logits)


@pytest.mark.slow  # make test-slow, for time (the chunked-vs-dense tests above run in make test).
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_response_logprobs_equal_the_model_logits(tied):
  graphdef, params = nnx.split(_model(tied))
  tokens, mask = _batch()
  tr = 9
  k1, k2 = jax.random.split(jax.random.key(5))
  g_lp, g_h = jax.random.normal(k1, (4, tr)), jax.random.normal(k2, (4, tr))

  def objective(fn):
    def f(p):
      logprobs, entropy = fn(nnx.merge(graphdef, p))
      return jnp.sum(g_lp * logprobs) + jnp.sum(g_h * entropy), (logprobs, entropy)
    return jax.jit(jax.value_and_grad(f, has_aux=True))

  (_, got), got_grads = objective(lambda m: lp.response_logprobs(m, tokens, mask, tr, chunk=4, entropy=True))(params)
  (_, want), want_grads = objective(lambda m: _dense_response(m, tokens, mask, tr))(params)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  flat_got, flat_want = nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)
  for (path, a), (_, b) in zip(flat_got, flat_want):
    a, b = a.get_value(), b.get_value()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9, err_msg=str(path))
  head = ("model", "embed_tokens") if tied else ("lm_head",)
  assert float(jnp.max(jnp.abs(dict(flat_want)[head].get_value()))) > 0  # The output kernel gets a gradient.


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True], ids=["untied", "tied"])
def test_last_logits_are_the_last_position_of_the_full_logits(tied):
  model = _model(tied, seed=1)
  tokens, mask = _batch(s=11, tr=4, b=3)
  positions = positions_from_mask(mask)
  full, _ = model(tokens, positions, mask)
  last, _ = model.last_logits(tokens, positions, mask)
  assert last.shape == (3, 259) and last.dtype == jnp.float32
  np.testing.assert_allclose(last, full[:, -1], rtol=1e-5, atol=1e-6)
  # As a prefill: the same cache as the full call's.
  cache = KVCache.zeros(model.cfg, 3, 16, dtype=jnp.float32)
  _, want_cache = model(tokens, positions, mask, cache)
  last, got_cache = model.last_logits(tokens, positions, mask, cache)
  np.testing.assert_allclose(last, full[:, -1], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_array_equal(a, b)


def test_no_full_vocabulary_logits_on_the_chunked_path():
  """The compiled forward and backward hold logits in blocks of B·chunk·V elements, never `[B, Tr, V]`."""
  b, s, tr, chunk = 2, 80, 64, 16
  graphdef, params = nnx.split(_model(False))
  tokens = jnp.zeros((b, s), jnp.int32)
  mask = jnp.ones((b, s), bool)

  def compiled(fn):
    loss = lambda p: jnp.sum(sum(x for x in fn(nnx.merge(graphdef, p)) if x is not None))
    return jax.jit(jax.value_and_grad(loss)).lower(params).compile()

  chunked = compiled(lambda m: lp.response_logprobs(m, tokens, mask, tr, chunk=chunk, entropy=True))
  dense = compiled(lambda m: _dense_response(m, tokens, mask, tr))
  full = b * tr * 259
  assert vocab_arrays(chunked, 259, min_elements=full) == []
  block = -(-259 * chunk // tr)  # Vocabulary columns per block: B·Tr·Vb ≈ B·chunk·V.
  assert ("f32", (b, tr, block)) in array_shapes(chunked)
  assert ("f32", (b, tr, 259)) in vocab_arrays(dense, 259, min_elements=full)  # The check can fail.
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  assert temp(chunked) < temp(dense) - 2 * full * 4


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_no_full_vocabulary_logits_in_the_training_and_scoring_steps():
  """The trainer's compiled programs (scoring, the actor update with an entropy term, the supervised
  update) hold no `[micro, Tr, V]` array; with a chunk of Tr positions they do."""
  from vapo_jax.config import AlgoConfig, OptimizerConfig
  from vapo_jax.train import optim, updates

  b, micro, s, tr = 4, 2, 80, 64
  graphdef, params = nnx.split(nnx.eval_shape(lambda: _model(False)))
  tx = optim.make_optimizer(OptimizerConfig(), 1e-3)
  opt = jax.eval_shape(tx.init, params)
  shape = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, dtype)
  batch = updates.TrainBatch(shape(b, s, dtype=jnp.int32), shape(b, s, dtype=bool), shape(b, tr, dtype=bool),
                                shape(b, tr), None, shape(b, dtype=bool), shape(b, tr), shape(b, tr), None)

  def programs(chunk):
    algo = lambda coef: AlgoConfig(mini_batch_responses=b, micro_batch_responses=micro, entropy_coef=coef)
    return {
        "scoring": jax.jit(lambda p, t, m: updates.logprobs_and_entropy(
            graphdef, p, t, m, response_len=tr, chunk=chunk, micro=micro)).lower(params, batch.tokens,
                                                                                 batch.attention_mask),
        "actor": jax.jit(lambda p, o, mb: updates.actor_update(  # With an entropy term; sft has none.
            graphdef, tx, p, o, mb, algo=algo(0.01), micro=micro, chunk=chunk)).lower(params, opt, batch),
        "sft": jax.jit(lambda p, o, mb: updates.sft_update(graphdef, tx, p, o, mb, micro=micro, chunk=chunk)).lower(
            params, opt, batch),
    }

  fast = {"xla_backend_optimization_level": 0}  # The same buffers; compiles in less time.
  full = micro * tr * 259
  for name, lowered in programs(16).items():
    assert vocab_arrays(lowered.compile(fast), 259, min_elements=full) == [], name
  assert vocab_arrays(programs(tr)["scoring"].compile(fast), 259, min_elements=full)  # The check can fail.


@pytest.mark.slow  # make test-slow, for time (test_sharding checks every preset's model on 8 devices in make test).
@pytest.mark.parametrize("name,tied", [("fsdp", False), ("fsdp_tp", True)])
def test_sharded_log_probs_and_gradients_equal_single_device(name, tied):
  """Under each preset's rules on 8 devices (the gathered kernel, the FSDP-split kernel gradient)."""
  from vapo_jax.models import sharding

  model = CausalLM(dataclasses.replace(SHARDED_CFG, tie_word_embeddings=tied), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, SHARDED_CFG.vocab_size, (8, 13)), jnp.int32)
  mask = jnp.asarray(np.arange(13)[None] >= rng.integers(0, 4, (8, 1)))
  g_lp, g_h = (jnp.asarray(rng.normal(size=(8, 9)), jnp.float32) for _ in range(2))

  def loss(m, tokens, mask):
    logprobs, entropy = lp.response_logprobs(m, tokens, mask, 9, chunk=3, entropy=True)
    return jnp.sum(g_lp * logprobs) + jnp.sum(g_h * entropy)

  step = lambda m, *args: nnx.value_and_grad(loss)(m, *args)
  want_loss, want_grads = jax.jit(step)(model, tokens, mask)
  mesh, rules = sharding.make_mesh(**MESHES[name]), sharding.PRESETS[name]
  rows = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  got_loss, got_grads = sharding.jit(step, mesh, rules)(place_module(model, mesh, rules),
                                                         *(jax.device_put(x, rows) for x in (tokens, mask)))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for (path, a), (_, b) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)):
    b = b.get_value()
    np.testing.assert_allclose(a.get_value(), b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9,
                               err_msg=str(path))



def _packed_case(tied: bool):
  """A micro model, a batch (prompt lengths 6, 2, 1, 4; responses 5, 3, 0, 5 of Tr = 5) in the padded
  layout and packed into rows of 12 (lengths 11, 5, 1, 9: rows (11, 1), (9), (5)), and loss weights."""
  b, tp, tr = 4, 6, 5
  rng = np.random.default_rng(1)
  prompt_mask = np.arange(tp)[None] >= tp - np.array([6, 2, 1, 4])[:, None]
  response_mask = np.arange(tr)[None] < np.array([5, 3, 0, 5])[:, None]
  mask = np.concatenate([prompt_mask, response_mask], 1)
  tokens = rng.integers(3, 259, (b, tp + tr)) * mask
  packed = packing.pack(tokens[:, :tp], prompt_mask, tokens[:, tp:], response_mask, row_tokens=12)
  assert packed.tokens.shape == (3, 12)
  weights = tuple(jnp.asarray(rng.normal(size=(b, tr)) * response_mask, jnp.float32) for _ in range(2))
  padded = lambda m: lp.response_logprobs(m, tokens, mask, tr, chunk=4, entropy=True)

  def packed_fn(m):  # Every column of the rows scored, then each response token's read from the column before it.
    logprobs, entropy = lp.packed_token_logprobs(m, packed.tokens, packed.segment_ids, packed.positions, chunk=4,
                                                 entropy=True)
    return packing.reference_unpack_predictions(logprobs, packed), packing.reference_unpack_predictions(entropy, packed)

  return _model(tied, seed=2), padded, packed_fn, response_mask, weights


def _assert_equal_at_real_tokens(got, want, response_mask):
  for a, w in zip(got, want):
    assert a.shape == response_mask.shape and not np.any(np.asarray(a)[~response_mask])
    np.testing.assert_allclose(np.asarray(a)[response_mask], np.asarray(w)[response_mask], rtol=1e-5, atol=1e-5)


def test_packed_response_logprobs_equal_the_padded_ones():
  model, padded, packed_fn, response_mask, _ = _packed_case(tied=False)
  want, got = jax.jit(lambda m: (padded(m), packed_fn(m)))(model)
  _assert_equal_at_real_tokens(got, want, response_mask)


@pytest.mark.slow  # make test-slow, for time (the values alone run in make test).
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_packed_response_logprobs_gradients_equal_the_padded_ones(tied):
  model, padded, packed_fn, response_mask, (g_lp, g_h) = _packed_case(tied)
  graphdef, params = nnx.split(model)

  def objective(fn):
    def f(p):
      logprobs, entropy = fn(nnx.merge(graphdef, p))
      return jnp.sum(g_lp * logprobs) + jnp.sum(g_h * entropy), (logprobs, entropy)
    return jax.value_and_grad(f, has_aux=True)

  ((_, want), want_grads), ((_, got), got_grads) = jax.jit(lambda p: (objective(padded)(p),
                                                                      objective(packed_fn)(p)))(params)
  _assert_equal_at_real_tokens(got, want, response_mask)
  for (path, a), (_, w) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)):
    w = w.get_value()
    np.testing.assert_allclose(a.get_value(), w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))) + 1e-9,
                               err_msg=str(path))
