"""The transformer: parity with transformers, KV-cache decoding, causality, padding, value model,
packed rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import FIXTURES, PARITY_MODELS, reference
from vapo_jax.models import config as model_config
from vapo_jax.models import huggingface
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import CausalLM, ValueModel, _rotate, positions_from_mask
from vapo_jax.paths import DATA_DIR
from vapo_jax.train import packing


@pytest.fixture(scope="module", params=PARITY_MODELS)
def parity_model(request):
  return request.param, huggingface.load_causal_lm(str(FIXTURES / request.param))


def test_logits_match_transformers(parity_model):
  name, model = parity_model
  ref = reference(name)
  logits, _ = jax.jit(lambda m, *a: m(*a))(model, ref["input_ids"], ref["position_ids"], ref["attention_mask"])
  valid = ref["attention_mask"] == 1
  assert valid.sum(-1).min() < valid.shape[1], "the reference batch must contain left padding"
  np.testing.assert_allclose(np.asarray(logits)[valid], ref["logits"][valid], atol=1e-4, rtol=1e-4)


def test_positions_from_mask():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
  np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])


def test_cached_decoding_equals_full_forward(parity_model):
  name, model = parity_model
  ref = reference(name)
  tokens, mask, positions = (jnp.asarray(ref[k]) for k in ("input_ids", "attention_mask", "position_ids"))
  full, _ = model(tokens, positions, mask)
  prompt = 6
  cache = KVCache.zeros(model.cfg, tokens.shape[0], tokens.shape[1] + 3, jnp.float32)
  step = jax.jit(lambda m, t, p, a, c: m(t, p, a, c))
  logits, cache = step(model, tokens[:, :prompt], positions[:, :prompt], mask[:, :prompt], cache)
  pieces = [logits]
  for t in range(prompt, tokens.shape[1]):
    logits, cache = step(model, tokens[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
    pieces.append(logits)
  assert int(cache.length) == tokens.shape[1]
  valid = np.asarray(mask) == 1
  np.testing.assert_allclose(np.concatenate(pieces, 1)[valid], np.asarray(full)[valid], atol=1e-4, rtol=1e-4)


def test_causality(parity_model):
  _, model = parity_model
  tokens = jnp.arange(3, 13)[None]
  mask = jnp.ones_like(tokens)
  positions = positions_from_mask(mask)
  before, _ = model(tokens, positions, mask)
  after, _ = model(tokens.at[0, 6].set(50), positions, mask)
  np.testing.assert_array_equal(before[:, :6], after[:, :6])
  assert not np.allclose(before[:, 6:], after[:, 6:])


def test_left_padding_changes_nothing(parity_model):
  _, model = parity_model
  tokens = jnp.array([[5, 9, 17, 33, 2, 8]])
  alone, _ = model(tokens, positions_from_mask(jnp.ones_like(tokens)), jnp.ones_like(tokens))
  padded = jnp.concatenate([jnp.zeros((1, 4), tokens.dtype), tokens], 1)
  mask = jnp.concatenate([jnp.zeros((1, 4), tokens.dtype), jnp.ones_like(tokens)], 1)
  logits, _ = model(padded, positions_from_mask(mask), mask)
  np.testing.assert_allclose(logits[:, 4:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_remat_gives_same_values_and_gradients():
  cfg = model_config.preset("tiny")
  tokens = jnp.arange(1, 9)[None] * 7 % cfg.vocab_size
  mask = jnp.ones_like(tokens)
  positions = positions_from_mask(mask)

  def loss_and_grad(remat):
    model = CausalLM(cfg, remat=remat, rngs=nnx.Rngs(3))
    loss = lambda m: jnp.mean(jax.nn.logsumexp(m(tokens, positions, mask)[0], -1))
    return nnx.value_and_grad(loss)(model)

  (l0, g0), (l1, g1) = loss_and_grad(False), loss_and_grad(True)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_bfloat16_compute_with_float32_params():
  model = huggingface.load_causal_lm(str(FIXTURES / "qwen2_untied"), dtype="bfloat16", param_dtype="float32")
  ref = reference("qwen2_untied")
  logits, _ = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"])
  assert logits.dtype == jnp.float32
  assert jax.tree.leaves(nnx.state(model))[0].dtype == jnp.float32
  valid = ref["attention_mask"] == 1
  # bf16 keeps about 3 significant digits; logits have std ≈ 1.
  assert np.max(np.abs(np.asarray(logits)[valid] - ref["logits"][valid])) < 0.25


def test_value_model_from_policy_checkpoint():
  directory = str(FIXTURES / "qwen2_untied")
  policy = huggingface.load_causal_lm(directory)
  critic = huggingface.load_value_model(directory, from_policy=True)
  np.testing.assert_array_equal(critic.model.layers.mlp.up_proj[1], policy.model.layers.mlp.up_proj[1])
  assert not np.any(critic.value_head[...]) and critic.value_head[...].shape == (policy.cfg.hidden_size, 1)
  ref = reference("qwen2_untied")
  values, _ = critic(ref["input_ids"], ref["position_ids"], ref["attention_mask"])
  assert values.shape == ref["input_ids"].shape and not np.any(values)


def test_value_model_needs_its_head_from_its_own_checkpoint():
  with pytest.raises(huggingface.CheckpointError, match="missing tensors.*value_head.weight"):
    huggingface.load_value_model(str(FIXTURES / "qwen2_untied"), from_policy=False)


def test_hf_config_forms():
  # Top-level rope_theta (the shipped Qwen2.5 configs) and rope_parameters (transformers 5 export).
  for directory, preset in (("Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"), ("Qwen2.5-32B", "qwen2.5-32b")):
    path = DATA_DIR / "qwen2.5_configs" / directory
    assert model_config.TransformerConfig.from_pretrained(str(path)) == model_config.preset(preset)
  llama = model_config.TransformerConfig.from_pretrained(str(FIXTURES / "llama3"))
  assert llama.rope["rope_type"] == "llama3" and llama.rope_theta == 500000.0 and llama.head_dim == 12
  legacy = model_config.TransformerConfig.from_hf(dict(llama.to_hf(), rope_parameters=None))
  assert legacy == llama
  np.testing.assert_array_equal(legacy.inv_frequencies(), llama.inv_frequencies())
  assert not np.allclose(llama.inv_frequencies(), dataclasses.replace(llama, rope_scaling=()).inv_frequencies())


def test_parameter_count_matches_module():
  for name in ("tiny", "qwen2.5-0.5b"):
    cfg = model_config.preset(name)
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(state)) == cfg.num_parameters()
  assert abs(model_config.preset("qwen2.5-32b").num_parameters() - 32.76e9) < 0.01e9


def test_bad_architecture_config():
  with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
    dataclasses.replace(model_config.preset("tiny"), num_kv_heads=4)
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    model_config.TransformerConfig.from_hf({"model_type": "gpt2"})
  with pytest.raises(ValueError, match="unknown model preset"):
    model_config.preset("qwen9")


def _random_model(cls, cfg, seed: int):
  """A model with weights of scale 0.2 (numpy draws): attention and the heads matter at 1e-5."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), state))


def _packed_batch(seed: int = 0):
  """Five sequences of 13, 9, 3, 5 and 6 tokens (one without a response) in rows of 16: first-fit
  decreasing gives rows (13, 3), (9, 6), (5)."""
  b, tp, tr = 5, 8, 6
  prompt_mask = np.arange(tp)[None] >= tp - np.array([8, 3, 1, 5, 2])[:, None]
  response_mask = np.arange(tr)[None] < np.array([5, 6, 2, 0, 4])[:, None]
  tokens = np.random.default_rng(seed).integers(3, 259, (b, tp + tr))
  prompt, response = tokens[:, :tp] * prompt_mask, tokens[:, tp:] * response_mask
  return (prompt, prompt_mask, response, response_mask), packing.pack(prompt, prompt_mask, response, response_mask,
                                                                      row_tokens=16)


def test_packed_rows_equal_each_sequence_padded_alone():
  cfg = model_config.preset("micro")
  (prompt, prompt_mask, response, response_mask), packed = _packed_batch()
  assert packed.tokens.shape == (3, 16) and packed.segment_ids.max() == 2
  tokens, mask = np.concatenate([prompt, response], 1), np.concatenate([prompt_mask, response_mask], 1)
  real = np.asarray(packed.segment_ids) > 0
  for cls in (CausalLM, ValueModel):
    model = _random_model(cls, cfg, seed=1)
    both = lambda m, t, a, p: (packing.to_rows(m(t, positions_from_mask(a), a)[0], p.source, p.segment_ids),
                               m(p.tokens, p.positions, None, segment_ids=p.segment_ids)[0])
    want, rows = (np.asarray(x)[real] for x in jax.jit(both)(model, tokens, mask, packed))
    np.testing.assert_allclose(rows, want, atol=1e-5, rtol=1e-5, err_msg=cls.__name__)
    assert np.std(want) > 0.05  # Not vacuous.
  with pytest.raises(ValueError, match="packed rows \\(segment_ids\\) take no attention_mask"):
    model(packed.tokens, packed.positions, real, segment_ids=packed.segment_ids)


def test_a_packed_sequence_sees_no_other():
  model = _random_model(CausalLM, model_config.preset("micro"), seed=2)
  _, packed = _packed_batch()
  run = jax.jit(lambda m, t, p: m(t, p.positions, None, segment_ids=p.segment_ids)[0])
  before = np.asarray(run(model, packed.tokens, packed))
  segments = np.asarray(packed.segment_ids)
  changed = (segments == 1) & (np.arange(3) == 0)[:, None]  # The 13-token sequence, sharing its row.
  after = np.asarray(run(model, jnp.where(changed, (packed.tokens + 1) % 259, packed.tokens), packed))
  np.testing.assert_array_equal(after[~changed & (segments > 0)], before[~changed & (segments > 0)])
  assert np.all(np.abs(after[changed] - before[changed]).max(-1) > 1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotary_by_matmul_equals_the_slices(dtype):
  """The calls without a cache rotate q and k by a product with a signed permutation (`_rotate(by_matmul=True)`),
  the rollout's by slices and a concatenation: the same values, bit for bit, jitted."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 7, 3, 16), dtype)
  cos, sin = (jax.random.normal(k, (2, 7, 16), dtype) for k in keys[1:])
  rotate = jax.jit(_rotate, static_argnames="by_matmul")
  np.testing.assert_array_equal(np.asarray(rotate(x, cos, sin, by_matmul=True).astype(jnp.float32)),
                                np.asarray(rotate(x, cos, sin, by_matmul=False).astype(jnp.float32)))
