"""The transformer: parity with transformers, KV-cache decoding, causality, padding, value model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import FIXTURES, PARITY_MODELS, reference
from vapo_jax.models import config as model_config, huggingface
from vapo_jax.models.transformer import CausalLM, KVCache, positions_from_mask
from vapo_jax.paths import DATA_DIR


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
  np.testing.assert_array_equal(critic.model.layers[1].mlp.up_proj[...], policy.model.layers[1].mlp.up_proj[...])
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
