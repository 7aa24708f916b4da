"""Packed rows against padded sequences (their oracle): `Steps.score` gives the same values, log-probs,
advantages and statistics, and `Steps.ppo_update` / `Steps.sft_update` the same losses, metrics and
gradient of every parameter of the actor and the critic, for each loss aggregation, decoupled and
length-adaptive λ, micro-batch splits, several mini-batches and epochs, and under `fsdp` on 8 devices; there
also in micro-batches of fewer rows than devices, under `fsdp_tp` (FSDP over 4, tensor parallelism over 2).

The optimizers record the gradients instead of applying them (their state is Σ of every update's
gradient; the learning rate is 0, so each mini-batch's gradient is taken at the same parameters)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from vapo_jax import distributed
from vapo_jax.config import AlgoConfig, ExperimentConfig, MeshConfig, ModelConfig, PackingConfig, RolloutConfig
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import optim, packed_batch
from vapo_jax.train.state import TrainState
from vapo_jax.train.steps import Steps

B, TP, TR = 16, 16, 12  # Sequences; prompt bucket of max_prompt_tokens = 8; response budget.
PROMPT_LENGTHS = np.array([8, 1, 5, 3, 8, 2, 7, 4, 6, 1, 8, 3, 5, 2, 4, 7])
RESPONSE_LENGTHS = np.array([12, 0, 3, 12, 1, 7, 5, 11, 2, 9, 4, 6, 12, 8, 1, 10])  # One empty, three full.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _recorder() -> optax.GradientTransformation:
  """An optimizer shaped like `optim.make_optimizer`'s whose state sums the gradients and whose
  updates are 0."""
  record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (g, jax.tree.map(jnp.add, s, g)))
  return optax.apply_if_finite(optax.chain(record, optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)), 2**30)


def _config(packed: bool, algo: dict, packing: dict, preset_name: str) -> ExperimentConfig:
  return ExperimentConfig(
      name="packed", model=ModelConfig(preset="micro", dtype="float32", random_init=True, logits_chunk=5),
      algo=dataclasses.replace(AlgoConfig(mini_batch_responses=B, value_pretrain_steps=0), **algo),
      packing=PackingConfig(enabled=packed, **packing),
      rollout=RolloutConfig(prompts_per_step=B // 4, samples_per_prompt=4, max_prompt_tokens=8,
                            max_response_tokens=TR),
      mesh=MeshConfig(preset=preset_name))


def _rollout(seed: int = 0):
  rng = np.random.default_rng(seed)
  prompt_mask = np.arange(TP)[None] >= TP - PROMPT_LENGTHS[:, None]
  response_mask = np.arange(TR)[None] < RESPONSE_LENGTHS[:, None]
  tokens = lambda shape, mask: jnp.asarray(rng.integers(3, 259, shape) * mask, jnp.int32)
  logprobs = jnp.asarray(-rng.exponential(size=(B, TR)) * response_mask, jnp.float32)
  out = Rollout(tokens((B, TP), prompt_mask), jnp.asarray(prompt_mask), tokens((B, TR), response_mask),
                jnp.asarray(response_mask), jnp.asarray(RESPONSE_LENGTHS, jnp.int32), jnp.zeros(B, jnp.int32),
                logprobs, logprobs)
  correct = rng.random(B) < 0.5
  return out, jnp.asarray(np.where(correct, 1.0, -1.0), jnp.float32), jnp.asarray(correct)


def _models():
  cfg = preset("micro")
  actor = CausalLM(cfg, rngs=nnx.Rngs(0))
  critic = ValueModel(cfg, rngs=nnx.Rngs(1))
  critic.value_head[...] = jax.random.normal(jax.random.key(2), critic.value_head[...].shape)  # Zero at init.
  return actor, critic


def _run(config: ExperimentConfig, devices, *, critic_only: bool = False, tensor: int = 1, members=None):
  """(scored batch, scoring stats, update metrics, Σ actor gradients, Σ critic gradients, the packing plan) of
  one PPO step on the fixed rollout, in the config's layout (`critic_only`: a value-pretraining step) on a mesh
  of `tensor`-way tensor parallelism and FSDP over the rest; `members` (padded): these mini-batches."""
  mesh = sharding.make_mesh(data=1, fsdp=len(devices) // tensor, tensor=tensor, devices=devices)
  rules = sharding.PRESETS[config.mesh.preset]
  actor, critic = _models()
  (actor_def, actor_params), (critic_def, critic_params) = nnx.split(actor), nnx.split(critic)
  place = lambda params: jax.device_put(params, jax.tree.map(
      lambda s: jax.sharding.NamedSharding(mesh, s), sharding.state_partition_specs(params, rules, mesh)))
  actor_params, critic_params = place(actor_params), place(critic_params)
  tx = _recorder()
  steps = Steps(config, mesh, rules, actor_def=actor_def, critic_def=critic_def, actor_tx=tx, critic_tx=tx, sft_tx=tx)
  state = TrainState(actor_params, critic_params, optim.init_optimizer(tx, actor_params, mesh),
                     optim.init_optimizer(tx, critic_params, mesh),
                     key=distributed.replicate_local(jax.random.key(3), mesh),
                     ref=jax.tree.map(lambda x: x * 1.01, actor_params) if config.algo.kl_coef else None)
  out, rewards, correct = steps.place(_rollout())
  plan = steps.plan_packing(state, out)
  batch, stats = steps.score(state, out, rewards, correct, plan=plan, critic_only=critic_only)
  if members is None:
    state, metrics = steps.ppo_update(state, batch, actor=not critic_only, critic=True, plan=plan)
  else:
    program = steps.ppo_program(state, actor=not critic_only, critic=True)
    state, metrics = program(state, batch, None, distributed.global_array(members, steps.replicated))
  grads = [jax.tree.map(np.asarray, opt.inner_state[0]) for opt in (state.actor_opt, state.critic_opt)]
  return jax.tree.map(np.asarray, batch), jax.device_get(stats), jax.device_get(metrics), *grads, plan


def _assert_same_step(packed, padded, *, actor_trained: bool = True):
  (batch, stats, metrics, actor_grads, critic_grads), (want_batch, want_stats, want_metrics, want_actor,
                                                       want_critic) = packed[:5], padded[:5]
  mask = want_batch.response_mask
  for field in ("old_values", "old_logprobs", "advantages", "returns", "ref_logprobs", "value_mask"):
    got, want = getattr(batch, field), getattr(want_batch, field)
    assert (got is None) == (want is None), field
    if want is not None:
      np.testing.assert_allclose(got[mask], want[mask], **TOLERANCE, err_msg=field)
  for name, got, want in (("stats", stats, want_stats), ("metrics", metrics, want_metrics)):
    keys = {k for k in want if not k.startswith(("perf/", "time/"))}
    assert keys <= got.keys(), (name, keys - got.keys())
    for key in sorted(keys):
      np.testing.assert_allclose(got[key], want[key], **TOLERANCE, err_msg=f"{name}: {key}")
  for got, want, trained in ((actor_grads, want_actor, actor_trained), (critic_grads, want_critic, True)):
    flat_got, flat_want = nnx.to_flat_state(got), nnx.to_flat_state(want)
    for (path, g), (_, w) in zip(flat_got, flat_want):
      w = w.get_value()
      assert np.abs(w).max() > 0 or not trained, path  # Every parameter gets a gradient.
      np.testing.assert_allclose(g.get_value(), w, **TOLERANCE, err_msg=str(path))


CASES = {  # algo fields, packing fields, sharding preset, devices.
    # VAPO: token-mean, decoupled and length-adaptive GAE, NLL; KL and entropy terms; truncated importance
    # sampling against the rollout's sampler log-probs; 4 micro-batches of 2 rows.
    "vapo": (dict(kl_coef=0.05, entropy_coef=0.01, tis_cap=1.2), dict(micro_batch_rows=2, row_tokens=20), "dp", 1),
    # PPO's aggregation, λ_actor = λ_critic = 0.95; 2 epochs of 2 mini-batches, micro-batches of 3 rows.
    "seq-mean-token-mean": (dict(loss_agg="seq-mean-token-mean", decoupled_gae=False, length_adaptive_alpha=None,
                                 lam_actor=0.95, mini_batch_responses=8, ppo_epochs=2), dict(micro_batch_rows=3),
                            "dp", 1),
    "seq-mean-token-sum-norm": (dict(loss_agg="seq-mean-token-sum-norm", length_adaptive_alpha=None,
                                     mini_batch_responses=8, micro_batch_responses=2), dict(micro_batch_rows=1),
                                "dp", 1),
    # Under FSDP on 8 devices (rows and sequences split over them), with dual clip and value clipping.
    "seq-mean-token-sum-fsdp-8": (dict(loss_agg="seq-mean-token-sum", dual_clip=3.0, value_clip=0.2,
                                       micro_batch_responses=8), dict(row_tokens=22), "fsdp", 8),
}


# Every case in make test-slow, for time (the vapo case 24 s, the others about a minute each): make test holds
# packing's parts equal to padding (the log-probs and their gradients, tests/test_logprobs.py; the loss's per-segment
# aggregation, tests/test_losses.py; the model's packed rows, tests/test_model.py; the layout, tests/test_packing.py)
# and trains packed rows end to end in aime's rehearsal.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_step_equals_the_padded_one(case):
  algo, packing, preset_name, devices = CASES[case]
  devices = jax.devices()[:devices]
  padded = _run(_config(False, algo, packing, preset_name), devices)
  packed = _run(_config(True, algo, packing, preset_name), devices)
  _assert_same_step(packed, padded)
  assert packed[2]["perf/padding_frac_update"] < padded[2]["perf/padding_frac_update"]
  assert ("actor/tis_clip_frac" in packed[2]) == (algo.get("tis_cap") is not None)
  if preset_name == "fsdp":  # Micro-batches of fewer rows than devices: FSDP over 4, tensor parallelism over 2.
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # fsdp_tp replicates the 259-entry vocabulary (not divisible by 2).
      tensor = _run(_config(True, algo, packing | dict(micro_batch_rows=4), "fsdp_tp"), devices, tensor=2)
    _assert_same_step(tensor, padded)
    assert packed[2]["perf/micro_batches"] < tensor[2]["perf/micro_batches"] < tensor[2]["perf/micro_batches_compiled"]
    assert tensor[2]["perf/padding_frac_update"] < packed[2]["perf/padding_frac_update"]


@pytest.mark.slow  # For time (17 s): make test runs aime's rehearsal with them, and test_packing's cut.
def test_mini_batches_cut_to_fill_micro_batches_train_as_the_same_sets_padded():
  """`packing.fill_micro_batches`: each epoch's order cut where the packed rows fill whole micro-batches
  (`packing.cut_filled`); the update on those mini-batches, packed, equals the padded update on the same sets
  (`RowPlan.members`, −1 past a shorter mini-batch's own), and it runs fewer micro-batches than equal
  mini-batches of the same order do."""
  algo, packing = dict(mini_batch_responses=4, ppo_epochs=2), dict(micro_batch_rows=1, row_tokens=40)
  devices = jax.devices()[:1]
  packed = _run(_config(True, algo, packing | dict(fill_micro_batches=True), "dp"), devices)
  members = np.asarray(packed[5].members)
  assert members.shape == (2, 4, 8)  # Width 2× the equal mini-batch: one program whatever the cut.
  for epoch in members:  # Each epoch trains every sequence once, in mini-batches of varying size.
    np.testing.assert_array_equal(np.sort(epoch[epoch >= 0]), np.arange(B))
  sizes = (members >= 0).sum(-1)
  assert sizes.min() < 4 < sizes.max(), sizes
  padded = _run(_config(False, algo, packing, "dp"), devices, members=members)
  _assert_same_step(packed, padded)
  # The runs are contiguous pieces of the epoch's order: end to end, the order the equal mini-batches take.
  orders = np.stack([np.concatenate([m[m >= 0] for m in epoch]).reshape(4, 4) for epoch in members])
  equal = packed_batch.plan_rows(PROMPT_LENGTHS, RESPONSE_LENGTHS, orders, row_tokens=40, micro_rows=1).update_metrics
  assert packed[2]["perf/micro_batches"] < equal["perf/micro_batches"]
  assert packed[2]["perf/padding_frac_update"] < equal["perf/padding_frac_update"]
  assert {packed[2]["perf/mini_batch_responses_min"], packed[2]["perf/mini_batch_responses_max"]} == {
      sizes.min(), sizes.max()}


@pytest.mark.slow  # For time (9 s): make test packs value pretraining in aime's rehearsal (packing.enabled).
@pytest.mark.parametrize("target", ["returns", "outcome"])
def test_a_packed_value_pretraining_step_equals_the_padded_one(target):
  """Value pretraining on Monte-Carlo returns, and a reward model's (the last token's verdict alone:
  the value loss on `value_mask`), packed as padded."""
  config = lambda packed: _config(packed, dict(value_pretrain_target=target, mini_batch_responses=8),
                                  dict(micro_batch_rows=2, row_tokens=20), "dp")
  devices = jax.devices()[:1]
  padded, packed = (_run(config(p), devices, critic_only=True) for p in (False, True))
  _assert_same_step(packed, padded, actor_trained=False)
  fitted = padded[0].value_mask
  assert fitted.sum() == (RESPONSE_LENGTHS > 0).sum() if target == "outcome" else fitted.sum() == RESPONSE_LENGTHS.sum()


@pytest.mark.slow  # For time (6 s): make test holds a packed update equal to the padded one (the vapo case).
def test_a_packed_supervised_update_equals_the_padded_one():
  from vapo_jax.train.steps import TrainBatch, join
  runs = []
  for packed in (False, True):
    config = _config(packed, {}, dict(micro_batch_rows=2, row_tokens=20), "dp")
    mesh = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
    actor_def, params = nnx.split(_models()[0])
    tx = _recorder()
    steps = Steps(config, mesh, sharding.PRESETS["dp"], actor_def=actor_def, critic_def=None, actor_tx=tx,
                  critic_tx=tx, sft_tx=tx)
    out, _, _ = _rollout(seed=1)
    tokens, attention = (np.asarray(x) for x in join(out.prompt_tokens, out.prompt_mask, out.response_tokens,
                                                     out.response_mask))
    batch = TrainBatch(tokens, attention, np.asarray(out.response_mask), None, None, np.zeros(B, bool))
    state = TrainState(params, None, None, None, key=jax.random.key(0), sft_opt=optim.init_optimizer(tx, params, mesh))
    state, metrics = steps.sft_update(state, steps.place(batch), steps.sft_plan(batch))
    runs.append((jax.device_get(metrics), jax.tree.map(np.asarray, state.sft_opt.inner_state[0])))
  (want, want_grads), (got, got_grads) = runs
  np.testing.assert_allclose(got["sft/nll"], want["sft/nll"], **TOLERANCE)
  for (path, g), (_, w) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)):
    assert np.abs(w.get_value()).max() > 0, path
    np.testing.assert_allclose(g.get_value(), w.get_value(), **TOLERANCE, err_msg=str(path))
  assert got["perf/padding_frac_sft"] < want["perf/padding_frac_sft"] and got["perf/micro_batches"] > 1


def test_micro_batch_rows_must_split_over_the_batch_devices():
  from vapo_jax.errors import ConfigError
  mesh = sharding.make_mesh(data=8, devices=jax.devices())
  config = _config(True, {}, dict(micro_batch_rows=12), "dp")
  with pytest.raises(ConfigError, match=r"PackingConfig.micro_batch_rows must be a multiple of the data-parallel "
                                        r"devices \(mesh data x fsdp = 8\), got 12"):
    Steps(config, mesh, sharding.PRESETS["dp"], actor_def=None, critic_def=None, actor_tx=None, critic_tx=None,
          sft_tx=None)
