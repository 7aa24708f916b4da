"""Int8 rollout weights (models/int8_weights.py, `rollout.weight_dtype="int8"`): the quantisation against a loop
written from its definition, the matmul against the dequantised kernel, the reshard's int8 copy (values and scales
split over the tensor groups like the kernel's output axes), and the refill engine in the rollout layout sampling
with the int8 copy what it samples with the dequantised weights (the oracle), on 8 CPU devices."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import EOS, PROMPTS, TP_CFG, training_layout_model
from vapo_jax import rollout
from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import topologies, xla_report
from vapo_jax.models import int8_weights, sharding
from vapo_jax.rollout import common
from vapo_jax.rollout.layout import layout_for

IS_VARIABLE = lambda x: isinstance(x, nnx.Variable)


def _by_channel(w: np.ndarray, contracted: int, outputs: int):
  """(scale, values) by a loop over the output channels: s = max |w| / 127 over the contracted axes (1 for a
  zero channel), q = round(w / s)."""
  lead = w.ndim - contracted - outputs
  moved = np.moveaxis(w.astype(np.float64), list(range(lead, lead + contracted)),
                      list(range(w.ndim - contracted, w.ndim)))
  channels = moved.reshape(-1, int(np.prod(moved.shape[w.ndim - contracted:])))
  scale, values = np.empty(len(channels)), np.empty(channels.shape)
  for c, row in enumerate(channels):
    peak = np.abs(row).max()
    scale[c] = peak / 127 if peak > 0 else 1.0
    values[c] = np.round(row / scale[c])
  values = np.moveaxis(values.reshape(moved.shape), list(range(w.ndim - contracted, w.ndim)),
                       list(range(lead, lead + contracted)))
  return scale.reshape(moved.shape[:w.ndim - contracted]), values


@pytest.mark.parametrize("name", sorted(int8_weights.LAYER_KERNELS))
def test_quantize_is_the_per_channel_definition(name):
  axes = int8_weights.LAYER_KERNELS[name]
  shape = {2: (3, 6, 4, 5), 1: (3, 6, 7)}[axes.outputs] if axes.contracted == 1 else (3, 4, 5, 6)
  w = np.asarray(jax.random.normal(jax.random.key(0), shape, jnp.float32)) * np.linspace(0.01, 3, shape[-1])
  w[1, ..., 2] = 0.0  # A channel of zeros: scale 1, values 0.
  kernel = int8_weights.quantize(jnp.asarray(w), axes)
  scale, values = _by_channel(w, *axes)
  assert kernel.values.dtype == jnp.int8 and kernel.scale.dtype == jnp.float32
  assert kernel.scale.shape == int8_weights.per_scale(shape, axes) == scale.shape
  np.testing.assert_allclose(kernel.scale, scale, rtol=1e-7)
  np.testing.assert_array_equal(kernel.values, values)
  assert np.abs(values).max() == 127
  back = np.asarray(int8_weights.dequantize(kernel, axes))
  step = np.expand_dims(scale, list(range(shape.__len__() - sum(axes), len(shape) - axes.outputs)))
  assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-6))  # Round to nearest: within half a step.
  assert np.all(back[1, ..., 2] == 0)


@pytest.mark.parametrize("spec,name", [("BTD,DNH->BTNH", "q_proj"), ("BTNH,NHD->BTD", "o_proj"),
                                       ("BTD,DF->BTF", "gate_proj"), ("BTF,FD->BTD", "down_proj")])
def test_int8_matmul_equals_the_dequantised_kernel(spec, name):
  axes = int8_weights.LAYER_KERNELS[name]
  shapes = {"q_proj": ((2, 3, 8), (8, 4, 5)), "o_proj": ((2, 3, 4, 5), (4, 5, 8)),
            "gate_proj": ((2, 3, 8), (8, 6)), "down_proj": ((2, 3, 6), (6, 8))}[name]
  k1, k2 = jax.random.split(jax.random.key(1))
  x, w = jax.random.normal(k1, shapes[0]), jax.random.normal(k2, shapes[1])
  kernel = int8_weights.quantize(w, axes)
  expected = jnp.einsum(spec, x, int8_weights.dequantize(kernel, axes), precision="highest")
  got = int8_weights.einsum(spec, x, kernel)
  assert got.dtype == x.dtype
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(int8_weights.einsum(spec, x, w), jnp.einsum(spec, x, w))  # Arrays: as before.


def _layout(mesh, rules, *, weight_dtype="int8", tensor_parallel=4):
  config = RolloutConfig(tensor_parallel=tensor_parallel, weight_dtype=weight_dtype, slots=8,
                         decode_steps_per_call=4, max_response_tokens=8, samples_per_prompt=2, prompts_per_step=8)
  return config, layout_for(config, mesh, compute_dtype="float32", training_rules=rules)


def _named(state):
  return {"/".join(str(getattr(k, "key", k)) for k in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=IS_VARIABLE)}


@pytest.fixture(scope="module")
def trained():
  return training_layout_model()


@pytest.mark.slow  # For time (11 s, the trained model's 6): make test runs aime's rehearsal, which reshards to int8.
def test_reshard_quantises_the_layer_kernels_split_like_their_outputs(trained):
  _, model, mesh, rules = trained
  state = nnx.state(model)
  _, layout = _layout(mesh, rules)
  copy, abstract = layout.reshard(state), layout.abstract_copy(state)
  quantised = 0
  for (name, v), w, a in zip(_named(state).items(), _named(copy).values(), _named(abstract).values()):
    x, y, axes = v.get_value(), w.get_value(), v.get_metadata()["logical_axes"]
    assert jax.tree.structure(y) == jax.tree.structure(a.get_value())
    for got, shape in zip(jax.tree.leaves(y), jax.tree.leaves(a.get_value())):  # The compile report's input.
      assert (got.shape, got.dtype, got.sharding) == (shape.shape, shape.dtype, shape.sharding), name
    kind = int8_weights.LAYER_KERNELS.get(name.split("/")[-1]) if "/layers/" in name else None
    if kind is None:  # Embedding, norms, output projection: cast, as with the model's dtype.
      assert y.dtype == jnp.float32
      np.testing.assert_array_equal(y, x)
      continue
    quantised += 1
    assert isinstance(y, int8_weights.Int8Kernel)
    expected = int8_weights.quantize(np.asarray(x), kind)
    np.testing.assert_array_equal(y.values, expected.values)
    np.testing.assert_array_equal(y.scale, expected.scale)
    spec = lambda a, s: jax.sharding.NamedSharding(layout.mesh, sharding.partition_spec(
        a, sharding.PRESETS["tp"], layout.mesh.shape, s))
    assert y.values.sharding == spec(axes, x.shape)
    assert y.scale.sharding == spec(int8_weights.per_scale(axes, kind), y.scale.shape)
    if name.endswith(("q_proj", "gate_proj")):  # Output axes split over the group of 4: the scales too.
      assert y.scale.addressable_shards[0].data.shape[1] == y.scale.shape[1] // 4
  assert quantised == 7
  programs = layout.reshard_programs(state)
  assert len(programs) < len(jax.tree.leaves(state)) and all(
      p.lower(x).compile() is not None for p, x in programs)
  # The model's dtype: no int8 anywhere; tensor_parallel 1 with int8 copies in the training layout.
  _, plain = _layout(mesh, rules, weight_dtype="model")
  assert not any(isinstance(v.get_value(), int8_weights.Int8Kernel)
                 for v in jax.tree.leaves(plain.reshard(state), is_leaf=IS_VARIABLE))
  _, local = _layout(mesh, rules, tensor_parallel=1)
  assert local.copies and local.mesh is mesh
  gate = local.reshard(state)["model"]["layers"]["mlp"]["gate_proj"].get_value()
  assert gate.values.sharding.spec == state["model"]["layers"]["mlp"]["gate_proj"].get_value().sharding.spec


@pytest.mark.slow  # For time (20 s): make test runs aime's rehearsal, whose refill engine samples from int8 weights.
def test_refill_engine_with_int8_weights_samples_what_the_dequantised_weights_sample(trained):
  """The shipped path in miniature: the training layout resharded into the rollout layout (data 2 x tensor 4)
  with int8 kernels, the refill engine's queues; the oracle is the unsharded model whose kernels are the
  dequantised int8 values. Greedy tokens equal, log-probs to float tolerance; the model's own weights sample
  other tokens (the quantisation is visible at this scale)."""
  model, trained_model, mesh, rules = trained
  config, layout = _layout(mesh, rules)
  plan = rollout.plan_rollout(config, TP_CFG, prompts=8, samples_per_prompt=2, prompt_tokens=16,
                              dtype=jnp.float32, devices=layout.data_devices)
  assert plan.engine == "refill"
  graphdef, state = nnx.split(trained_model)
  copy = layout.reshard(state)

  def oracle(path, v):
    value = v.get_value()
    return v.replace(int8_weights.dequantize(value, int8_weights.LAYER_KERNELS[str(path[-1].key)])
                     if isinstance(value, int8_weights.Int8Kernel) else np.asarray(value))
  dequantised = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(oracle, copy, is_leaf=IS_VARIABLE))
  prompts = PROMPTS + [[7, 7, 7], [1], [50, 51], [60, 61, 62, 63, 64]]
  tokens, mask = common.pad_prompts(prompts, pad_id=0)
  spec = common.Sampling(max_response_tokens=8, stop_token_ids=(EOS,), temperature=0.0)
  static_plan = rollout.plan_rollout(RolloutConfig(engine="static", max_response_tokens=8), TP_CFG, prompts=8,
                                     samples_per_prompt=2, prompt_tokens=tokens.shape[1], dtype=jnp.float32,
                                     devices=1)
  sample = lambda m, **kw: rollout.sample(m, tokens, mask, jax.random.key(5), sampling=spec, pad_id=0, **kw)[0]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = sample(nnx.merge(graphdef, copy), plan=plan, jit=layout.jit, place=layout.place)
    expected = sample(dequantised, plan=static_plan)
    full = sample(model, plan=static_plan)
  np.testing.assert_array_equal(out.response_tokens, expected.response_tokens)
  np.testing.assert_array_equal(out.response_lengths, expected.response_lengths)
  for field in ("policy_logprobs", "sampler_logprobs"):
    np.testing.assert_allclose(getattr(out, field), getattr(expected, field), rtol=1e-5, atol=1e-5,
                               err_msg=field)
  assert not np.allclose(np.asarray(full.policy_logprobs), np.asarray(out.policy_logprobs), atol=1e-3)


def test_weight_dtype_is_checked():
  with pytest.raises(ConfigError, match=r"RolloutConfig.weight_dtype must be 'model' or 'int8'"):
    RolloutConfig(weight_dtype="fp8")


def test_the_report_prices_the_decode_with_the_int8_copy(smoke_config):
  """`make memory`'s report counts the rollout copy's bytes (the roofline's weights a decode step reads): int8
  kernels at a byte, a float32 scale per output channel, the rest in the compute dtype; its reshard phase
  compiles the quantisation (here in the training layout: tensor_parallel 1 with int8 weights is a copy)."""
  config = smoke_config({"sft.steps": 0, "eval.path": None, "rollout.weight_dtype": "int8"})
  report = xla_report.compile_run(config, topologies.named("cpu:8"), phases=("reshard",))
  assert [p.name for p in report.phases] == ["reshard"] and report.phases[0].programs
  cfg, width = report.architecture, np.dtype(config.model.dtype).itemsize
  d, n, k, h, f, layers = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                           cfg.num_layers)
  kernels = layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f)
  scales = layers * (n * h + 2 * k * h + 2 * d + 2 * f)
  assert report.rollout_weights == kernels + 4 * scales + (report.parameters[0] - kernels) * width
  assert report.decode_weight_bytes == report.rollout_weights < report.weight_bytes
  plain = xla_report.compile_run(smoke_config({"sft.steps": 0, "eval.path": None}), topologies.named("cpu:8"),
                                 phases=("reshard",))
  assert plain.phases == () and plain.rollout_weights is None and plain.decode_weight_bytes == plain.weight_bytes
