"""The trainer end to end at smoke size: every algorithm runs, value pretraining fits, dynamic
sampling fills the batch, a memorised batch's losses fall, 1 and 8 devices agree, and one RL step
moves only its declared host transfers.

Every run is the default experiment at smoke size (`smoke_config`, tests/conftest.py), its baselines
from experiments/variants.py; programs they share (model, sampler, scoring) compile once per test run
through the compilation cache that tests/conftest.py sets up."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from vapo_jax import metric_keys
from vapo_jax.rl import advantages, losses
from vapo_jax.train import updates
from vapo_jax.train.trainer import Trainer

PARITY_REWARD = "rewards_for_tests:even_first_byte"  # Random per sample: mixed groups.
PROMPT_REWARD = "rewards_for_tests:answer_at_least_five"  # Decided by the prompt: learnable by a critic.
ALGORITHMS = ("vapo", "ppo", "grpo", "dapo")  # VAPO and experiments/variants.py's baselines.
QUICK = {"sft.steps": 0, "eval.path": None}  # No warm start and no held-out evaluation.


# All four in make test-slow, for time: make test runs VAPO through every stage in `aime`'s rehearsal
# (test_rehearsal.py: finite metrics, declared keys, TensorBoard, the export), a finished run run again
# (test_trainer_failures.py) and the warm start (test_disk_full.py).
@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_runs_with_finite_losses(tmp_path, smoke_config, name):
  # VAPO runs every stage (warm start, evaluation, value pretraining, RL); the others RL only.
  trainer = Trainer(smoke_config(None if name == "vapo" else QUICK, algorithm=name), write_logs=True,
                    verbose=False)
  summary = trainer.run()
  rl = [h for h in trainer.history if h["stage"] == "rl"]
  assert len(rl) == 2
  keys = ["actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout/response_len_mean"]
  keys += ["critic/value_loss"] if trainer.config.algo.uses_critic else ["actor/ref_kl"] if name == "grpo" else []
  for h in rl:
    for key in keys:
      assert math.isfinite(h[key]), (key, h[key])
    assert h["rollout/logprob_gap"] < 1e-4  # float32: the trainer's log-probs are the sampler's.
  if name == "vapo":
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert [h["stage"] for h in trainer.history] == ["sft"] * 2 + ["value_pretrain"] + ["rl"] * 2
    assert (tmp_path / "test" / "export" / "model.safetensors").exists()  # The final policy, HF format.
    again = Trainer(trainer.config, verbose=False)  # The same run again: resumes at its end.
    assert again.progress.stage == "done" and again.run()["accuracy_after_rl"] == summary["accuracy_after_rl"]
  if not trainer.config.algo.dynamic_sampling:  # Without it, groups are not selected: the fraction is measured.
    assert "rollout/mixed_group_frac" not in rl[0] and "reward/sampled_mean" not in rl[0]
  logged = {key for h in trainer.history for key in h}  # Every key the run logs is declared (metric_keys.py).
  assert [key for key in sorted(logged) if not metric_keys.declared(key)] == []
  lines = (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()
  assert any('"stage": "rl"' in line and "actor/clip_frac_high" in line and "time/rollout_s" in line for line in lines)
  assert list((tmp_path / "test" / "tensorboard").iterdir())


def _held_out_batch(trainer):
  state, key = trainer.state.split_key()
  out, rewards, correct, *_ = trainer.experience.sample(state, trainer.progress.prompts, key)
  trainer.state = state
  return out, np.asarray(rewards), np.asarray(correct)


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_value_pretraining_raises_explained_variance(smoke_config):
  cfg = smoke_config(QUICK | {"reward.reward_fn": PROMPT_REWARD, "algo.value_pretrain_steps": 10,
                              "algo.mini_batch_responses": 8,
                              "data.train_path": "synthetic:arithmetic?terms=1-1&count=50",
                              "rollout.prompts_per_step": 16, "rollout.samples_per_prompt": 2})
  trainer = Trainer(cfg, write_logs=False, verbose=False)
  # A held-out batch from the same fixed policy, scored before and after value pretraining.
  out, rewards, _ = _held_out_batch(trainer)
  mask = np.asarray(out.response_mask)
  returns = advantages.monte_carlo_returns(advantages.last_token_rewards(rewards, mask), mask)
  tokens, attention = updates.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, mask)

  def explained_variance():
    v = updates.values(trainer.steps.critic_def, trainer.state.critic, tokens, attention, response_len=16)
    return float(losses.explained_variance(v, returns, mask))

  actor_before = jax.tree.map(np.asarray, trainer.state.actor)
  before = explained_variance()
  trainer.value_pretrain_stage()
  after = explained_variance()
  assert len([h for h in trainer.history if h["stage"] == "value_pretrain"]) == 10
  assert after > before + 0.2, (before, after)
  for a, b in zip(jax.tree.leaves(actor_before), jax.tree.leaves(trainer.state.actor)):
    np.testing.assert_array_equal(a, b)  # Only the critic trains.
  trainer.pool.close()


def test_dynamic_sampling_fills_the_batch_with_mixed_groups(smoke_config):
  cfg = smoke_config(QUICK | {"reward.reward_fn": PARITY_REWARD, "algo.dynamic_sampling_max_rounds": 10},
                     algorithm="dapo")
  trainer = Trainer(cfg, write_logs=False, verbose=False)
  state, key = trainer.state.split_key()
  out, _, correct, stats, _ = trainer.experience.sample(state, trainer.progress.prompts, key)
  accuracy = np.asarray(correct).reshape(8, 4).mean(axis=1)
  assert out.response_tokens.shape[0] == 32
  assert np.all((accuracy > 0) & (accuracy < 1)), accuracy
  assert stats["rollout/mixed_group_frac"] == 1.0 and stats["rollout/sampling_rounds"] >= 1
  assert np.isfinite(stats["reward/sampled_mean"]) and stats["reward/sampled_mean"] <= 1.0  # ≥ −1 less penalties
  assert all(metric_keys.declared(key) for key in stats)
  trainer.pool.close()


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_losses_on_a_memorised_batch_fall(smoke_config):
  # μ = 0: the policy-gradient term itself must fall (not only the positive-example NLL).
  trainer = Trainer(smoke_config(QUICK | {"reward.reward_fn": PARITY_REWARD, "algo.mini_batch_responses": 32,
                                          "algo.positive_nll_coef": 0.0}), write_logs=False, verbose=False)
  out, rewards, correct = _held_out_batch(trainer)
  state = trainer.state
  batch, _ = trainer.steps.score(state, out, *trainer.steps.place((rewards, correct)))
  history = []
  for _ in range(15):
    state, m = trainer.steps.ppo_update(state, batch, actor=True, critic=True)
    history.append({k: float(v) for k, v in m.items()})
  assert history[-1]["critic/value_loss"] < 0.5 * history[0]["critic/value_loss"]
  assert history[-1]["actor/pg_loss"] < history[0]["actor/pg_loss"] - 0.05
  trainer.pool.close()


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_one_and_eight_devices_give_the_same_losses_and_parameters(smoke_config):
  """AdamW's ε is 1e-3 here. At 1e-8, a coordinate whose gradient is a near-cancelling sum (an output
  kernel column of a token the batch never holds) takes a step of about the learning rate whatever the
  gradient's size, so the parameter's error is the learning rate times the gradient's relative rounding:
  1 and 8 devices sum in different orders and differed by 4.2e-6 in 2 of 8,288 entries. At 1e-3 such a
  coordinate moves by its gradient over ε, which carries the rounding through unamplified (measured:
  every parameter within 1e-8, while the median one moves 2e-6 to 1e-3)."""
  runs = []
  for devices in ([jax.devices()[0]], jax.devices()):
    cfg = smoke_config(QUICK | {"reward.reward_fn": PARITY_REWARD, "algo.value_pretrain_steps": 1,
                                "algo.mini_batch_responses": 16, "algo.micro_batch_responses": 8,
                                "rl_steps": 1,
                                "optim.eps": 1e-3})
    trainer = Trainer(cfg, devices=devices, write_logs=False, verbose=False)
    assert trainer.mesh.size == len(devices)
    trainer.run()
    metrics = {f"{h['stage']}:{k}": v for h in trainer.history for k, v in h.items()
               if k.startswith(("actor/", "critic/")) and isinstance(v, float)}
    runs.append((metrics, jax.tree.map(np.asarray, (trainer.state.actor, trainer.state.critic))))
  (one, one_params), (eight, eight_params) = runs
  assert one.keys() == eight.keys() and any(k.startswith("value_pretrain:") for k in one)
  for key in one:
    np.testing.assert_allclose(eight[key], one[key], rtol=1e-5, atol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(one_params), jax.tree.leaves(eight_params)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # make test-slow, for time (13 s): a guard of the step's speed on a pod, not of its results.
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_an_rl_step_moves_only_its_declared_host_transfers(smoke_config, monkeypatch, packed):
  """Host→device: the prompts and the verifier's rewards and verdicts, placed by `distributed`'s two
  placement functions (any other transfer raises under the guard), and with packed rows each
  sequence's (row, offset) for scoring and the epoch's mini-batch. Device→host: the rollout's
  lengths and finish reasons, the verifier's token ids and lengths, with packed rows the batch's
  prompt and response lengths and mini-batch orders, then the step's metrics in one fetch (counted
  where arrays reach numpy)."""
  from jax._src import array as jax_array

  from vapo_jax import distributed
  trainer = Trainer(smoke_config(QUICK | {"reward.reward_fn": PARITY_REWARD, "packing.enabled": packed}),
                    write_logs=False, verbose=False)
  trainer.state, _ = trainer.step(trainer.state)  # Compiles every program once.
  placed, fetched = [], []
  for name in ("global_array", "global_array_from_share"):
    original = getattr(distributed, name)
    monkeypatch.setattr(distributed, name, lambda x, *a, _f=original: placed.append(np.shape(x)) or _f(x, *a))
  value = jax_array.ArrayImpl._value
  monkeypatch.setattr(jax_array.ArrayImpl, "_value",
                      property(lambda x: fetched.append(x.shape) or value.fget(x)))
  with jax.transfer_guard_host_to_device("disallow"):
    trainer.state, metrics = trainer.step(trainer.state)
  monkeypatch.undo()
  # Prompt ids and mask; rewards and verdicts; packed: (row, offset) [scoring + 1 epoch, 2, B].
  assert placed == [(8, 16), (8, 16), (32,), (32,)] + [(2, 2, 32)] * packed, placed
  # The rollout's lengths and finish reasons (its metrics), the verifier's response ids and lengths,
  # packed: the prompt and response lengths and the epoch's order [2 + 1, B], then the step's device
  # metrics as one vector.
  assert fetched[:-1] == [(32,), (32,), (32, 16),
                          (32,)] + [(3, 32)] * packed and len(fetched[-1]) == 1, fetched
  assert 20 < fetched[-1][0] < len(metrics) and "actor/pg_loss" in metrics and "rollout/response_len_p90" in metrics
  assert {"perf/padding_frac_scoring", "perf/padding_frac_update", "perf/micro_batches",
          "perf/train_tokens_per_s"} <= metrics.keys()
  trainer.close()


@pytest.mark.slow  # The engines' own tests cover the layout's tokens in make test (test_refill, test_rollout).
def test_a_tensor_parallel_rollout_samples_the_training_layouts_tokens(smoke_config):
  """`rollout.tensor_parallel=2`: the rollout decodes on 4 groups of 2 devices (the actor resharded, the KV
  cache split by its 2 heads) and samples the tokens the training layout samples (`tensor_parallel=1`); an
  RL step runs on it, scoring and updating in the training layout (whose log-probs equal the sampler's)."""
  from vapo_jax.rollout.layout import layout_for
  from vapo_jax.train.experience import Experience
  cfg = smoke_config(QUICK | {"reward.reward_fn": PARITY_REWARD, "rollout.tensor_parallel": 2})
  trainer = Trainer(cfg, write_logs=False, verbose=False)
  assert dict(trainer.experience.layout.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  one = Experience(cfg, steps=trainer.steps, layout=layout_for(
      dataclasses.replace(cfg.rollout, tensor_parallel=1), trainer.mesh, compute_dtype=cfg.model.dtype,
      training_rules=trainer.steps.rules), model_cfg=trainer.model_cfg, tokenizer=trainer.tokenizer,
                   pool=trainer.pool)
  records, key = next(trainer.progress.prompts), jax.random.key(3)
  settings = dict(samples_per_prompt=cfg.rollout.samples_per_prompt, temperature=cfg.rollout.temperature,
                  top_p=cfg.rollout.top_p)
  tp, _ = trainer.experience.generate_in_layout(trainer.experience.policy(trainer.state), records, key,
                                                **settings)
  reference, _ = one.generate_in_layout(one.policy(trainer.state), records, key, **settings)
  assert tp.response_tokens.sharding.is_equivalent_to(reference.response_tokens.sharding,
                                                      2)  # The training layout.
  np.testing.assert_array_equal(tp.response_tokens, reference.response_tokens)
  np.testing.assert_allclose(tp.policy_logprobs, reference.policy_logprobs, rtol=1e-5, atol=1e-5)
  trainer.state, metrics = trainer.step(trainer.state)
  assert math.isfinite(metrics["actor/loss"]) and metrics["rollout/logprob_gap"] < 1e-4
  trainer.close()
