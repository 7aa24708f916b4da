"""Scanned decoder layers against the unrolled loop over the same stacked parameters (the oracle), on 8
CPU devices in float32: the training layout (fsdp) for forward passes and gradients, the rollout's
tensor-parallel layout for the prefill, decoding and both engines; the Hugging Face round trip of the
stacks; a checkpoint of the per-layer code refused; compiled programs independent of depth."""

import dataclasses
import pathlib
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from model_utils import FIXTURES, TP_CFG, refill_plan, training_layout_model
from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import hlo
from vapo_jax.models import hf_export, huggingface, safetensors_io, sharding
from vapo_jax.models.config import preset
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import CausalLM, ValueModel, positions_from_mask
from vapo_jax.rollout import common, static
from vapo_jax.rollout.layout import layout_for
from vapo_jax.rollout.refill import engine as refill

PER_LAYER_RUN = pathlib.Path(__file__).parent / "fixtures" / "per_layer_run"


def unrolled(module):
  """The same module, the same parameter arrays, with the layers run as a Python loop."""
  graphdef, state = nnx.split(module)
  copy = nnx.merge(graphdef, state)
  copy.model.scan_layers = False
  return copy


def with_remat(module, remat: bool):
  graphdef, state = nnx.split(module)
  copy = nnx.merge(graphdef, state)
  copy.model.remat = remat
  return copy


@pytest.fixture(scope="module")
def trained():
  """(unsharded policy, the policy in the training layout fsdp on 8 devices, mesh, rules): TP_CFG, 2 layers."""
  return training_layout_model()


def batch(cfg, rows=8, length=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (rows, length))
  mask = np.ones_like(tokens, bool)
  mask[::2, :3] = False  # Left padding on half the rows.
  return jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask)


def test_a_scanned_program_holds_one_layer_and_its_parameters_are_stacked():
  cfg = preset("tiny")
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  q = model.model.layers.self_attn.q_proj
  assert q[...].shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)
  assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
  assert not np.allclose(q[...][0], q[...][1])  # Each layer drew its own initial weights.
  one = CausalLM(dataclasses.replace(cfg, num_layers=1), rngs=nnx.Rngs(0))
  matmuls = lambda m: jax.jit(lambda m, *a: m(*a)[0]).lower(m,
                                                            *batch(cfg)).as_text().count("stablehlo.dot_general")
  assert matmuls(model) == matmuls(one)  # The program traces one layer, whatever the depth.


@pytest.mark.parametrize("cls", [CausalLM, ValueModel])
def test_scanned_equals_unrolled_forward_under_fsdp(trained, cls):
  _, policy, mesh, rules = trained
  model = policy if cls is CausalLM else ValueModel(TP_CFG, rngs=nnx.Rngs(2))
  if cls is ValueModel:  # The policy's backbone, a random head: every layer's output reaches the values.
    nnx.update(model.model, nnx.state(policy.model))
    model.value_head[...] = jax.random.normal(jax.random.key(3), model.value_head[...].shape)
  forward = sharding.jit(lambda m, *a: m(*a)[0], mesh, rules)
  inputs = batch(TP_CFG)
  scanned, loop = forward(model, *inputs), forward(unrolled(model), *inputs)
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(loop), atol=1e-6, rtol=1e-6)


def _losses(actor, critic, tokens, positions, mask, targets):
  """The actor's token NLL of `tokens` (its update's log-probs) and the critic's squared error."""
  logits = actor(tokens, positions, mask)[0][:, :-1]
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
  values = critic(tokens, positions, mask)[0]
  return -jnp.sum(logprobs * mask[:, 1:]) / jnp.sum(mask[:,
                                                         1:]), jnp.sum(mask * (values - targets) ** 2) / mask.sum()


# make test runs remat=True (aime's setting: the scan's backward pass recomputing its body); remat=False, the
# same scan without the checkpoint, runs in make test-slow.
@pytest.mark.parametrize("remat", [pytest.param(False, marks=pytest.mark.slow), True])
def test_scanned_equals_unrolled_gradients_under_fsdp(trained, remat):
  """The actor's and the critic's gradients of the scanned layers equal the unrolled loop's under fsdp. make
  test covers the property with the remat=True case; the remat=False case runs in make test-slow."""
  _, policy, mesh, rules = trained
  critic = ValueModel(TP_CFG, rngs=nnx.Rngs(4))
  nnx.update(critic.model, nnx.state(policy.model))
  tokens, positions, mask = batch(TP_CFG, seed=1)
  targets = jnp.asarray(np.random.default_rng(2).normal(size=mask.shape), jnp.float32)

  def grads(actor, critic):
    actor_grad = nnx.grad(lambda a: _losses(a, critic, tokens, positions, mask, targets)[0])(actor)
    critic_grad = nnx.grad(lambda c: _losses(actor, c, tokens, positions, mask, targets)[1])(critic)
    return actor_grad, critic_grad

  run = sharding.jit(grads, mesh, rules)
  scanned = run(with_remat(policy, remat), with_remat(critic, remat))
  loop = run(unrolled(with_remat(policy, remat)), unrolled(with_remat(critic, remat)))
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(loop)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def _rollout_layout(trained):
  model, _, mesh, rules = trained
  layout = layout_for(RolloutConfig(tensor_parallel=4), mesh, compute_dtype="float32", training_rules=rules)
  graphdef, state = nnx.split(training_layout_model()[1])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # The vocabulary split.
    return nnx.merge(graphdef, layout.reshard(state)), layout


@pytest.mark.slow  # For time (11 s): make test decodes scanned layers in aime's rehearsal.
def test_scanned_equals_unrolled_prefill_and_eight_decode_steps_in_the_rollout_layout(trained):
  model, layout = _rollout_layout(trained)
  tokens, mask = common.pad_prompts([[5, 6, 7], [9, 10], [40], [3, 3, 8, 21]] * 2, pad_id=0)
  tokens, mask = layout.place((tokens, mask))

  def run(m, tokens, mask):
    logits, cache = common.prefill(m, tokens, mask, cache_dtype=jnp.float32, decode_block=None)
    prefilled = cache
    big = KVCache.zeros(m.cfg, tokens.shape[0], tokens.shape[1] + 8, jnp.float32)
    cache = KVCache(big.keys.at[:, :, :, :tokens.shape[1]].set(cache.keys),
                    big.values.at[:, :, :, :tokens.shape[1]].set(cache.values),
                    big.mask.at[:, :tokens.shape[1]].set(cache.mask),
                    jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))  # One length per row.
    steps, position = [logits], jnp.sum(mask, -1).astype(jnp.int32)
    for t in range(8):
      token = jnp.argmax(steps[-1], -1).astype(jnp.int32)
      logits, cache = m(token[:, None], (position + t)[:, None], jnp.ones((tokens.shape[0], 1), bool), cache)
      steps.append(logits[:, -1])
    return prefilled, jnp.stack(steps), cache

  program = layout.jit(run)
  (p1, l1, c1), (p2, l2, c2) = program(model, tokens, mask), program(unrolled(model), tokens, mask)
  # The two programs are the same arithmetic fused differently by XLA (how differently depends on its flags:
  # make test's and the defaults' differ), so their float32 sums run in other orders. A value is the end of a chain
  # of at most layers × (prefill + 8 steps) = 18 reductions, each over at most F = 88 terms; rounding in another
  # order moves each by about √F float32 ulps of its scale (a random walk), so the two agree within
  # rtol = 18 · √88 · 2⁻²³ ≈ 2.0e-5 of each array's largest value. A wrong layer, a dropped term or another
  # token moves them by ~0.1.
  chain, terms = model.cfg.num_layers * (1 + 8), max(model.cfg.hidden_size, model.cfg.intermediate_size)
  rtol = chain * terms ** 0.5 * np.finfo(np.float32).eps
  for a, b in zip(jax.tree.leaves((p1, c1, l1)),
                  jax.tree.leaves((p2, c2, l2))):  # Caches (every layer's keys,
    b = np.asarray(b)                                                               # values), then logits.
    np.testing.assert_allclose(np.asarray(a), b, atol=rtol * np.max(np.abs(b)), rtol=rtol)


@pytest.mark.slow  # make test covers it: the scanned and unrolled decoding's logits, see the docstring.
def test_greedy_tokens_identical_scanned_and_unrolled_in_both_engines(trained):
  """Whole greedy generations in both engines. In make test the same property is checked at the level of
  logits by `test_scanned_equals_unrolled_prefill_and_eight_decode_steps_in_the_rollout_layout`, and the
  engines against each other by tests/test_refill.py's `test_refill_equals_static`."""
  model, layout = _rollout_layout(trained)
  tokens, mask = common.pad_prompts([[5, 6, 7], [9, 10], [40], [3, 3, 8, 21]] * 2, pad_id=0)
  tokens, mask = layout.place((tokens, mask))
  sampling = common.Sampling(max_response_tokens=6, stop_token_ids=(2,), temperature=0.0)
  key = jax.random.key(0)
  outputs = []
  for m in (model, unrolled(model)):
    fn = static.make_generate(sampling=sampling, samples_per_prompt=2, pad_id=0, jit=layout.jit)
    chosen = refill_plan(prompts=8, samples_per_prompt=2, prompt_tokens=tokens.shape[1],
                         max_response_tokens=6, slots=8, queues=2,
                         steps_per_call=3, min_slots=2, queue_pages=12, page_tokens=16)
    refilled, _, _, _ = refill.generate_refill(m, tokens, mask, key, plan=chosen, sampling=sampling,
                                               jit=layout.jit)
    outputs.append((fn(m, tokens, mask, key), refilled))
  for a, b in zip(outputs[0], outputs[1]):
    np.testing.assert_array_equal(np.asarray(a.response_tokens), np.asarray(b.response_tokens))
  np.testing.assert_array_equal(np.asarray(outputs[0][0].response_tokens),
                                np.asarray(outputs[0][1].response_tokens))


def test_hugging_face_load_export_load_is_byte_equal(tmp_path):
  source = FIXTURES / "qwen2_untied"
  model = huggingface.load_causal_lm(str(source))
  hf_export.export(model, str(tmp_path))
  original, written = (safetensors_io.SafetensorsFile(str(d / "model.safetensors")) for d in (source,
                                                                                              tmp_path))
  assert set(written.keys()) == set(original.keys())  # Per-layer names, as transformers writes them.
  for name in original.keys():
    a, b = np.asarray(original.get(name)), np.asarray(written.get(name))
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
  again = huggingface.load_causal_lm(str(tmp_path))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
    assert np.asarray(a.get_value()).tobytes() == np.asarray(b.get_value()).tobytes(), path


def test_a_checkpoint_of_the_per_layer_code_is_refused_in_one_line(tmp_path):
  """tests/fixtures/per_layer_run: a smoke run's last checkpoint written by the per-layer code (README there)."""
  from conftest import build_smoke_config
  from vapo_jax.train.trainer import Trainer

  shutil.copytree(PER_LAYER_RUN, tmp_path / "perlayer")
  config = build_smoke_config(str(tmp_path), name="perlayer")
  with pytest.raises(ConfigError, match=r"per-layer decoder-layer parameters .* refusing to resume") as error:
    Trainer(config)
  assert "\n" not in str(error.value)


def _update_hlo(layers: int) -> str:
  """The optimized HLO of one AdamW update of a `layers`-layer policy (grad of its token NLL), fsdp on 8 devices."""
  cfg = dataclasses.replace(preset("micro"), num_layers=layers)
  mesh, rules = sharding.make_mesh(data=2, fsdp=4), sharding.PRESETS["fsdp"]
  graphdef, state = sharding.abstract_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)
  tx = optax.adamw(1e-3)
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)

  def update(state, opt, tokens):
    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens, jnp.broadcast_to(jnp.arange(16), (8, 16)),
                                          jnp.ones((8, 16), bool))[0]
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
    grads = jax.grad(loss)(state)
    updates, opt = tx.update(grads, opt, state)
    return optax.apply_updates(state, updates), opt

  opt = jax.eval_shape(tx.init, state)
  return sharding.jit(update, mesh, rules).lower(state, opt, tokens).compile().as_text()


@pytest.mark.slow  # For time (5 s): make test checks a scanned program holds one layer.
def test_the_compiled_update_is_the_same_size_at_four_and_eight_layers():
  count = lambda text: sum(1 for line in text.splitlines() if " = " in line)
  four, eight = _update_hlo(4), _update_hlo(8)
  assert count(four) == count(eight)


@pytest.mark.slow  # For time (5 s): a property of the compiled decode's speed, not of its results.
def test_no_cache_sized_copy_in_the_decode_loop(trained):
  model, layout = _rollout_layout(trained)
  tokens, mask = common.pad_prompts([[5, 6, 7], [9, 10], [40], [3, 3, 8, 21]] * 2, pad_id=0)
  chosen = refill_plan(prompts=8, samples_per_prompt=2, prompt_tokens=tokens.shape[1], max_response_tokens=4,
                       slots=8, queues=2, steps_per_call=4, min_slots=2, queue_pages=12, page_tokens=16)
  fns = refill.programs(chosen, sampling=common.Sampling(max_response_tokens=4, stop_token_ids=(2,)),
                        pad_id=0, cache_dtype=jnp.float32, jit=layout.jit)
  state = fns.start(model, *layout.place((tokens, mask)))
  text = fns.decode.lower(model, state, layout.place(jax.random.key(0)), None).compile().as_text()
  pool = state.cache.keys.addressable_shards[0].data.shape  # [K, L, Q, Pq, Tg, H] on one device.
  layer = pool[:1] + pool[2:]
  cache_like = {tuple(sorted(pool)), tuple(sorted(layer))}  # The pool, or one layer of it, in any layout.
  copies = _large_copies(text,
                         int(np.prod(layer)) * 4 // 8)  # An eighth of a layer's pool: weights' copies too.
  assert copies  # The check finds copies (of the scan's weight slices, laid out for the CPU's dots) ...
  dims = lambda copy: tuple(sorted(int(d) for d in copy.split("[")[1].split("]")[0].split(",")))
  assert not [c for c in copies if dims(c) in cache_like], copies  # ... and none of a layer's cache.


def _large_copies(text: str, min_bytes: int) -> list[str]:
  """`name: type` of every copy (`copy`, `copy-start`) of a compiled module whose result holds at least
  `min_bytes` per device: a buffer XLA could not update in place (a KV cache copied per decode step)."""
  _, computations, _ = hlo.parse(text)
  return [f"{name}: {type_text}" for instructions in computations.values()
          for name, type_text, opcode, _ in instructions
          if opcode in ("copy", "copy-start") and max((b for *_, b in hlo.arrays(type_text)),
                                                      default=0) >= min_bytes]
