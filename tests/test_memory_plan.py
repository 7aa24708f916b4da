"""The memory plan, checked against what JAX and XLA actually allocate."""

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from experiments import get_experiment
from vapo_jax.cli import memory as memory_cli
from vapo_jax.config import AlgoConfig, ExperimentConfig, MeshConfig, ModelConfig, PackingConfig, RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import advice, footprint, hand_plan
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.kv_cache import PagedKVCache
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout import common
from vapo_jax.train import optim, updates

GIB = 2**30
# XLA:CPU's default scheduler orders for concurrency and loses what remat saves (measured: the same
# temp bytes with and without it); its memory-optimising scheduler keeps the saving, so the comparison
# uses that. LLVM optimisation is off: the buffers are the same and compiling takes 40% less time.
XLA_CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED", "xla_backend_optimization_level": 0}


def _config(*, model="tiny", dtype="float32", remat=False, prompts=4, samples=2, prompt_tokens=32,
            response_tokens=64, mini=8, micro=None, mesh_preset="fsdp", kl_coef=0.0, estimator="gae",
            packing: PackingConfig = PackingConfig(enabled=False)):
  return ExperimentConfig(
      name="plan_test", packing=packing,
      model=ModelConfig(preset=model, dtype=dtype, remat=remat, random_init=True),
      algo=AlgoConfig(estimator=estimator, value_pretrain_steps=0, kl_coef=kl_coef, mini_batch_responses=mini,
                      micro_batch_responses=micro),
      rollout=RolloutConfig(prompts_per_step=prompts, samples_per_prompt=samples, max_prompt_tokens=prompt_tokens,
                            max_response_tokens=response_tokens),
      mesh=MeshConfig(preset=mesh_preset))


def _item(plan, phase, key):
  return next(p for p in plan.phases if p.name == phase).get(key)


def _resident(plan, key):
  return sum(i.bytes for i in plan.resident if i.key == key)


def _device0_bytes(tree) -> int:
  """Bytes device 0 holds of every array in `tree` (its own shards, from the arrays themselves)."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def _placed_parameters(cls, cfg, mesh, rules):
  """Real arrays of `cls(cfg)`'s parameter shapes, each placed by its logical axes on `mesh`."""
  def place(variable):
    value = variable.get_value()
    spec = sharding.partition_spec(variable.get_metadata()["logical_axes"], rules, mesh.shape, value.shape)
    return jax.device_put(np.zeros(value.shape, value.dtype), NamedSharding(mesh, spec))
  abstract = nnx.state(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Indivisible axes are replicated, with a warning.
    return jax.tree.map(place, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("mesh_preset,shape", [("fsdp", {"data": 2, "fsdp": 4, "tensor": 1}),
                                               ("fsdp_tp", {"data": 1, "fsdp": 2, "tensor": 4})])
def test_parameter_and_optimizer_bytes_equal_the_real_shards(mesh_preset, shape):
  config = _config(mesh_preset=mesh_preset, kl_coef=0.1)
  plan = hand_plan.plan_memory(config, shape)
  mesh, rules, cfg = sharding.make_mesh(**shape), sharding.PRESETS[mesh_preset], preset("tiny")
  actor = _placed_parameters(CausalLM, cfg, mesh, rules)
  critic = _placed_parameters(ValueModel, cfg, mesh, rules)
  assert _resident(plan, "actor_params") == _device0_bytes(actor)
  assert _resident(plan, "critic_params") == _device0_bytes(critic)
  assert _resident(plan, "reference") == _device0_bytes(actor)  # kl_coef > 0 holds a copy.
  assert _device0_bytes(actor) < 4 * cfg.num_parameters() / 2  # Sharded, not replicated.
  # optax's own AdamW state, each moment sharded like its parameter.
  tx = optim.make_optimizer(config.optim, 1e-3)
  replicated = NamedSharding(mesh, PartitionSpec())
  out = optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, critic), critic,
                              transform_non_params=lambda _: replicated)
  state = jax.jit(tx.init, out_shardings=out)(critic)
  moments = [x for x in jax.tree.leaves(state) if x.ndim]  # Less optax's scalars (counts, hyperparameters).
  assert _resident(plan, "critic_optimizer") == _device0_bytes(moments)


def test_layer_extrapolation_equals_a_full_trace():
  cfg = dataclasses.replace(preset("tiny"), num_layers=5)
  for rules, shape in ((sharding.PRESETS["fsdp"], {"data": 1, "fsdp": 8, "tensor": 1}),
                       (sharding.PRESETS["fsdp_tp"], {"data": 1, "fsdp": 4, "tensor": 2})):
    full = footprint.parameter_memory(lambda: ValueModel(cfg, rngs=nnx.Rngs(0)), rules=rules, mesh_shape=shape)
    layered = footprint.layered_parameter_memory(lambda c: ValueModel(c, rngs=nnx.Rngs(0)), cfg, rules=rules,
                                              mesh_shape=shape)
    assert layered == full


def _xla_actor_update_temp_bytes(config) -> int:
  """XLA's temporary bytes for one actor update of `config` on one device (the trainer's program)."""
  cfg = preset(config.model.preset)
  m = config.model
  graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(
      cfg, dtype=m.dtype, remat=m.remat, scan_layers=m.scan_layers, attention=m.attention, rngs=nnx.Rngs(0))))
  tx = optim.make_optimizer(config.optim, 1e-3)
  r = config.rollout
  b, tr = config.algo.mini_batch_responses, r.max_response_tokens
  s = common.prompt_bucket(r.max_prompt_tokens) + tr
  shape = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, dtype)
  batch = updates.TrainBatch(shape(b, s, dtype=jnp.int32), shape(b, s, dtype=bool), shape(b, tr, dtype=bool),
                                shape(b, tr), shape(b, tr), shape(b, dtype=bool), shape(b, tr), shape(b, tr), None)
  update = jax.jit(lambda p, o, mb: updates.actor_update(
      graphdef, tx, p, o, mb, algo=config.algo, micro=config.algo.micro_batch_responses, chunk=m.logits_chunk),
      donate_argnums=(0, 1))
  lowered = update.lower(params, jax.eval_shape(tx.init, params), batch)
  return lowered.compile(XLA_CPU_OPTIONS).memory_analysis().temp_size_in_bytes


def _planned_update_temp_bytes(plan) -> int:
  """What the plan expects XLA to allocate inside the actor update (all but its arguments)."""
  return sum(_item(plan, "actor update", k) for k in ("grads", "update", "gathered", "activations"))


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_actor_update_estimate_is_within_50_percent_of_xla():
  """At 96 and 4,096 tokens (flash attention, log-probs from logit blocks). In float32: XLA:CPU
  computes bfloat16 matmuls through float32 copies (measured: the same temp bytes in both dtypes),
  which a TPU does not, so float32 is where the CPU can check the plan's coefficients. The programs are
  the scanned ones the model builds by default (`model.scan_layers`)."""
  one_device = {"data": 1, "fsdp": 1, "tensor": 1}
  measured, planned = {}, {}
  for micro, remat, response in ((2, False, 64), (8, False, 64), (2, False, 4064), (2, True, 4064)):
    config = _config(micro=micro, remat=remat, response_tokens=response)
    key = micro, remat, response
    measured[key] = _xla_actor_update_temp_bytes(config)
    planned[key] = _planned_update_temp_bytes(hand_plan.plan_memory(config, one_device))
    assert 1 / 1.5 < planned[key] / measured[key] < 1.5, (key, planned, measured)
  # Four times the micro-batch: activations grow about four-fold in both (the fixed part is small).
  growth = lambda d: (d[8, False, 64] - d[2, False, 64]) / d[2, False, 64]
  assert 1 / 1.5 < growth(planned) / growth(measured) < 1.5, (planned, measured)
  # 42 times the tokens: both grow about linearly (no [T, S] scores, no [Tr, V] logits).
  longer = lambda d: d[2, False, 4064] / d[2, False, 64]
  assert 1 / 1.5 < longer(planned) / longer(measured) < 1.5 and longer(measured) < 42, (planned, measured)
  # Rematerialisation lowers both, by a similar factor.
  saving = lambda d: d[2, True, 4064] / d[2, False, 4064]
  assert saving(measured) < 0.75 and saving(planned) < 0.75
  plan = hand_plan.plan_memory(_config(micro=2, remat=True, response_tokens=4064), one_device)
  assert _item(plan, "actor update", "activations") < next(
      i.bytes for i in plan.phases[2].items if i.key == "activations_other")


def test_the_reference_attention_is_planned_with_its_scores():
  """`model.attention=reference` materialises float32 [N, T, T] scores per layer; the others do not."""
  one_device = {"data": 1, "fsdp": 1, "tensor": 1}
  config = _config(micro=2, response_tokens=4064)
  flash = hand_plan.plan_memory(config, one_device)
  dense = hand_plan.plan_memory(
      dataclasses.replace(config, model=dataclasses.replace(config.model, attention="reference")), one_device)
  scores = 3 * 2 * 8 * 6 * 4096**2  # L · rows · 8 bytes (scores and softmax, float32) · N · T².
  extra = _item(dense, "actor update", "activations") - _item(flash, "actor update", "activations")
  assert scores < extra < 1.5 * scores


def test_kv_cache_is_rollout_cache_bytes():
  cfg = preset("tiny")
  plan = hand_plan.plan_memory(_config(prompts=8, samples=4, mini=32), {"data": 2, "fsdp": 4, "tensor": 1})
  expected = common.cache_bytes(cfg, batch=32, prompt_tokens=32, max_new_tokens=64, dtype=jnp.float32, devices=8)
  assert _item(plan, "rollout", "kv_cache") == expected
  # 3 · 2 = 6 sequences do not split over 8 devices: each holds all of them (the batch is replicated).
  plan = hand_plan.plan_memory(_config(prompts=3, samples=2, mini=6), {"data": 2, "fsdp": 4, "tensor": 1})
  assert _item(plan, "rollout", "kv_cache") == common.cache_bytes(cfg, batch=6, prompt_tokens=32, max_new_tokens=64)
  assert "6 sequences per device" in plan.format()


def test_the_refill_engines_pool_is_planned_beside_the_prompt_caches():
  """The refill engine's pool is what `kv_cache_budget_gib` holds per device in pages of 16 tokens, up to what
  its slots need: as many slots as the pool holds with every response at the cap beside the device's prompts
  (`rollout.engine_for`); the prompts' prefilled cache besides."""
  from vapo_jax import rollout
  from vapo_jax.models.kv_cache import KVCache
  cfg, mesh = preset("tiny"), {"data": 2, "fsdp": 4, "tensor": 1}
  config = _config(prompts=16, samples=8, mini=128, response_tokens=992)
  page = 16 * KVCache.bytes_per_token(cfg, jnp.float32)
  config = dataclasses.replace(config, rollout=dataclasses.replace(
      config.rollout, engine="refill", page_tokens=16, kv_cache_budget_gib=330 * page / GIB))
  engine = rollout.engine_for(config.rollout, cfg, sequences=128, prompt_tokens=32, dtype=jnp.float32, devices=8)
  # 2 prompts per device hold 2 pages each; a sequence at most 992 / 16 + 1 = 63: (330 - 4) // 63 = 5 per device.
  assert engine.kind == "refill" and engine.slots == 40 and engine.pages == 4 + 5 * 63
  plan = hand_plan.plan_memory(config, mesh)
  assert _item(plan, "rollout", "kv_cache") == 319 * page
  assert _item(plan, "rollout", "prompt_cache") == KVCache.bytes(cfg, 2, 32, jnp.float32)  # 16 prompts, 8 devices.
  assert "through 40 refill slots, 5 per device, over 319 pages of 16 tokens" in plan.format()
  # Over a device's memory, the refusal names a smaller pool, which fits.
  budget = plan.phase_bytes()["rollout"] - 100 * page
  message = _refusal(plan, budget)
  pages = int(re.search(r"a smaller pool of KV-cache pages: rollout\.pages=(\d+)", message).group(1))
  smaller = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, pages=pages))
  assert pages <= 219 and hand_plan.plan_memory(smaller, mesh).phase_bytes()["rollout"] <= budget


def test_a_tensor_parallel_rollout_layout_is_planned_from_its_real_arrays():
  """`rollout.tensor_parallel=2` on data 2 x fsdp 4 (tiny: 2 KV heads): the rollout decodes on 4 groups of 2
  chips. The plan's rollout copy of the actor and its KV cache are what device 0 holds of the real arrays (the
  layout's reshard; a cache built under its rules); slots are per group, from a budget per chip."""
  from vapo_jax import rollout
  from vapo_jax.models.kv_cache import KVCache, PagedKVCache
  from vapo_jax.rollout.layout import layout_for
  cfg, shape = preset("tiny"), {"data": 2, "fsdp": 4, "tensor": 1}
  config = _config(prompts=16, samples=8, mini=128, response_tokens=992, dtype="bfloat16")
  page = 16 * KVCache.bytes_per_token(cfg, jnp.bfloat16) // 2  # Per chip: a group of 2 splits the KV heads.
  config = dataclasses.replace(config, rollout=dataclasses.replace(
      config.rollout, engine="refill", tensor_parallel=2, page_tokens=16, kv_cache_budget_gib=330 * page / GIB))
  plan = hand_plan.plan_memory(config, shape)
  mesh, rules = sharding.make_mesh(**shape), sharding.PRESETS["fsdp"]
  layout = layout_for(config.rollout, mesh, compute_dtype="bfloat16", training_rules=rules)
  assert hand_plan.rollout_groups(config, shape) == layout.data_devices == 4
  copy = layout.reshard(nnx.state(sharding.create_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)))
  assert _item(plan, "rollout", "rollout_weights") == _device0_bytes(copy) < 2 * cfg.num_parameters()  # bf16, split.
  # 4 prompts of 2 pages per group; (330 - 8) // 63 = 5 slots per group, 20 in all, over 8 + 5 * 63 pages.
  engine = rollout.engine_for(config.rollout, cfg, sequences=128, prompt_tokens=32, dtype=jnp.bfloat16, devices=4)
  assert (engine.slots == 20 and engine.queues == 4 and engine.pages == 323
          and "through 20 refill slots, 5 per group of 2 chips, over 323 pages" in plan.format())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pool = layout.jit(lambda: PagedKVCache.zeros(cfg, rows=20, queues=4, pages=323, page_tokens=16, table_pages=64,
                                                 dtype=jnp.bfloat16))()
  assert _item(plan, "rollout", "kv_cache") == _device0_bytes((pool.keys, pool.values)) == 323 * page
  assert _item(plan, "rollout", "prompt_cache") == common.cache_bytes(
      cfg, batch=4, prompt_tokens=32, max_new_tokens=0, dtype=jnp.bfloat16, tensor=2)  # 16 prompts, 4 groups.
  largest = cfg.vocab_size * cfg.hidden_size  # The embedding and the output projection: 259 rows, not split by 2.
  assert _item(plan, "rollout", "reshard") == 2 * largest
  # Tensor parallelism 1: the plan of the training layout, as before.
  flat = hand_plan.plan_memory(
      dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, tensor_parallel=1)), shape)
  assert _item(flat, "rollout", "rollout_weights") == _item(flat, "rollout", "reshard") == 0
  with pytest.raises(ConfigError, match="rollout.tensor_parallel=4 must divide the model's 2 KV heads"):
    hand_plan.plan_memory(
        dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, tensor_parallel=4)), shape)


def test_check_accepts_a_fitting_plan_and_skips_an_unknown_device():
  plan = hand_plan.plan_memory(_config(), {"data": 8})
  group = hand_plan.plan_memory(_config(estimator="group"), {"data": 8})  # GRPO: no critic update, critic still held.
  assert "critic update" not in group.phase_bytes() and _resident(group, "critic_params") > 0
  advice.refuse(plan, plan.peak_bytes)
  advice.refuse(plan, None)
  with pytest.raises(ConfigError):
    advice.refuse(plan, plan.peak_bytes - 1)


def _refusal(plan, budget) -> str:
  with pytest.raises(ConfigError) as error:
    advice.refuse(plan, budget)
  return str(error.value)


def test_packed_phases_count_rows_of_row_tokens_and_check_names_the_rows():
  packing = PackingConfig(micro_batch_rows=16)
  config = _config(model="small", prompts=8, samples=8, response_tokens=992, mini=64, packing=packing)
  mesh = {"data": 8}
  plan = hand_plan.plan_memory(config, mesh)  # Rows of 32 + 992 tokens (the padded sequence's length), 2 per device.
  assert "micro-batch 16 rows of 1024 tokens, 2 per device" in plan.format()
  assert "micro-batches of 16 rows of 1024 tokens" in plan.format()
  m = config.model
  cfg = preset("small")
  want = footprint.activation_memory(cfg, rows=2, tokens=1024, scored_tokens=1024, dtype_bytes=4, remat=m.remat,
                                     backward=True, head="logprobs", dense_attention=False,
                                     attention_block=(256, 256), logits_chunk=m.logits_chunk, heads=cfg.num_heads,
                                     kv_heads=cfg.num_kv_heads, mlp=cfg.intermediate_size, embed=cfg.hidden_size)
  assert _item(plan, "actor update", "activations") == want.total
  # Over budget: the refusal names the rows per micro-batch, a multiple of the 8 batch devices.
  smaller = lambda rows: hand_plan.plan_memory(
      dataclasses.replace(config, packing=PackingConfig(micro_batch_rows=rows)), mesh)
  budget = smaller(8).phase_bytes()["actor update"]
  message = _refusal(plan, budget)
  assert "set packing.micro_batch_rows=8 " in message, message


def test_check_names_remat_and_the_micro_batch_that_fit():
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  config = _config(model="small", prompts=8, samples=8, response_tokens=992, mini=64, remat=False)
  plan = hand_plan.plan_memory(config, mesh)
  with_remat = hand_plan.plan_memory(
      dataclasses.replace(config, model=dataclasses.replace(config.model, remat=True)), mesh)
  budget = max(with_remat.phase_bytes()["actor update"], with_remat.phase_bytes()["critic update"],
               plan.phase_bytes()["rollout"], plan.phase_bytes()["scoring"])
  message = _refusal(plan, budget)
  assert "actor update needs" in message and "set model.remat=true (activations" in message
  micro = int(re.search(r"algo\.micro_batch_responses=(\d+)", message).group(1))
  assert micro < 64 and 64 % micro == 0
  # The named micro-batch fits and is the largest that does.
  smaller = lambda m: dataclasses.replace(config, algo=dataclasses.replace(config.algo, micro_batch_responses=m))
  assert hand_plan.plan_memory(smaller(micro), mesh).phase_bytes()["actor update"] <= budget
  larger = min(d for d in range(micro + 1, 65) if 64 % d == 0)
  assert hand_plan.plan_memory(smaller(larger), mesh).phase_bytes()["actor update"] > budget


def test_check_names_the_mesh_when_one_sequence_per_device_is_too_much():
  config = _config(model="small", prompts=8, samples=8, response_tokens=4064, mini=64, micro=8, remat=True)
  plan = hand_plan.plan_memory(config, {"data": 1, "fsdp": 8, "tensor": 1})  # 1 sequence per device already
  budget = plan.phase_bytes()["actor update"] * 3 // 4
  message = _refusal(plan, budget)
  assert "algo.micro_batch_responses=" not in message.split("raise mesh.tensor")[0]  # Not enough alone.
  layout = re.search(r"mesh\.preset=fsdp_tp mesh\.data=1 mesh\.fsdp=(\d+) mesh\.tensor=(\d+) with "
                     r"algo\.micro_batch_responses=(\d+)", message)
  assert layout, message
  fsdp, tensor, micro = map(int, layout.groups())
  tp = dataclasses.replace(config, mesh=MeshConfig(preset="fsdp_tp"),
                           algo=dataclasses.replace(config.algo, micro_batch_responses=micro))
  fitted = hand_plan.plan_memory(tp, {"data": 1, "fsdp": fsdp, "tensor": tensor})
  assert fsdp * tensor == 8 and fitted.phase_bytes()["actor update"] <= budget


def test_check_names_prompts_and_response_length_for_the_kv_cache():
  config = _config(prompts=64, samples=8, response_tokens=8160, mini=64)
  plan = hand_plan.plan_memory(config, {"data": 8})
  rollout_bytes = plan.phase_bytes()["rollout"]
  message = _refusal(plan, rollout_bytes // 3)
  prompts = int(re.search(r"lower rollout\.prompts_per_step to (\d+)", message).group(1))
  assert prompts <= 64 // 3 + 1 and "lower rollout.max_response_tokens to" in message


def test_the_aime_plan_on_256_chips():
  # As shipped: pure FSDP over 256 chips, packed rows of 22,528 tokens, one per chip (the padded
  # layout: the whole mini-batch of 512 at once, 2 sequences per chip), flash attention and log-probs
  # from logit blocks: every phase fits 95 GiB.
  config = get_experiment("aime")
  assert config.mesh.preset == "fsdp" and config.mesh.tensor == 1 and config.algo.micro_batch_responses is None
  mesh = {"data": 1, "fsdp": 256, "tensor": 1}
  shipped = hand_plan.plan_memory(config, mesh)
  advice.refuse(shipped, 95 * GIB)
  cfg = preset("qwen2.5-32b")
  assert math.isclose(_resident(shipped, "actor_params"), 4 * cfg.num_parameters() / 256, rel_tol=0.01)
  text = shipped.format(95 * GIB)
  assert "micro-batch 256 rows of 22528 tokens, 1 per device" in text and "fits" in text
  config = dataclasses.replace(config, packing=PackingConfig(enabled=False))
  padded = hand_plan.plan_memory(config, mesh)
  advice.refuse(padded, 95 * GIB)
  assert "micro-batch 512 sequences, 2 per device" in padded.format(95 * GIB)
  assert _item(shipped, "actor update", "activations") < _item(padded, "actor update", "activations")
  # The rollout in 32 tensor-parallel groups of 8 chips, each group's pool of pages split by KV heads.
  groups = hand_plan.rollout_groups(config, mesh)
  engine = hand_plan.refill_engine(config, cfg, groups)
  assert config.rollout.tensor_parallel == 8 and groups == 32 and engine.slots == config.rollout.slots
  page_bytes = engine.page_tokens * 2 * 64 * 8 * 128 * 2 // 8  # Keys and values, 64 layers, 8 KV heads over 8 chips.
  assert engine.pages == int(config.rollout.kv_cache_budget_gib * GIB // page_bytes) == 16384
  assert _item(shipped, "rollout", "kv_cache") == PagedKVCache.pool_bytes(
      cfg, queues=1, pages=engine.pages, page_tokens=engine.page_tokens, dtype=jnp.bfloat16) // 8
  # The static engine (rollout.engine=static) in rounds of 128 prompts fits as well (256 would not,
  # beside the rollout copy: 100 GiB).
  static = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine="static"))
  advice.refuse(hand_plan.plan_memory(static, mesh), 95 * GIB)
  # With the dense reference attention (float32 [N, T, T] scores) the same layout is refused, naming
  # tensor parallelism: why the layout before flash attention split the heads over 4 chips.
  dense = dataclasses.replace(config, model=dataclasses.replace(config.model, attention="reference"))
  message = _refusal(hand_plan.plan_memory(dense, mesh), 95 * GIB)
  assert re.search(r"actor update needs [\d.]+ GiB: raise mesh\.tensor", message), message
  # All 8192 responses generated at once by the static engine: refused, naming rounds.
  at_once = dataclasses.replace(static, rollout=dataclasses.replace(static.rollout, prompts_per_generation=None))
  message = _refusal(hand_plan.plan_memory(at_once, mesh), 95 * GIB)
  assert "rollout.prompts_per_generation=" in message and "lower rollout.prompts_per_step to" in message


def test_device_memory_and_the_command_line(capsys):
  config = _config()
  assert hand_plan.device_memory_bytes(config) is None  # CPU devices report no limit.
  sized = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, device_memory_gib=95.0))
  assert hand_plan.device_memory_bytes(sized) == 95 * GIB
  assert memory_cli.main(["--exp", "aime", "--mesh", "fsdp=256", "--device-gib", "95"]) == 0
  out = capsys.readouterr().out
  assert "mesh data=1 fsdp=256 tensor=1" in out and "fits" in out
  assert memory_cli.main(["--exp", "aime", "--mesh", "fsdp=256", "--device-gib", "60"]) == 1
  assert "refused:" in capsys.readouterr().out
  assert memory_cli.main(["--exp", "tiny", "--mesh", "data=8", "--device-gib", "1"]) == 0
  assert "fits" in capsys.readouterr().out
  assert memory_cli.main(["--exp", "tiny", "--mesh", "dp=8"]) == 2
  assert memory_cli.main(["--model", "tiny", "--sharding", "fsdp", "--mesh", "fsdp=8"]) == 0
  assert "policy:" in capsys.readouterr().out
  assert memory_cli.main(["--model", "tiny", "--sharding", "nope"]) == 2


def test_make_memory_says_what_it_assumed_and_did_not_check(capsys):
  """Without a mesh it says what it assumed and that no device memory was known, so nothing was
  checked (not a silent one-device plan of 14,030 GiB per device for aime and exit 0)."""
  assert memory_cli.main(["--exp", "aime"]) == 0
  notes = capsys.readouterr().out.splitlines()[-2:]
  assert notes[0].startswith("assumed: the configured mesh on this machine's 8 cpu devices, data=")
  assert notes[1].startswith("not checked: no device memory is known (cpu devices report none), so nothing was "
                             "compared with it; give --device-gib")
  assert memory_cli.main(["--exp", "aime", "--mesh", "fsdp=256", "--device-gib", "95"]) == 0
  out = capsys.readouterr().out
  assert "assumed:" not in out and "not checked:" not in out

