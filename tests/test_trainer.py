"""The trainer end to end at tiny scale: every algorithm runs, value pretraining fits, dynamic
sampling fills the batch, a memorised batch's loss falls, and 1 and 8 devices agree.

Each test builds a Trainer; programs they share (model, sampler, scoring) compile once per session
through the compilation cache that tests/conftest.py sets up."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from vapo_jax.config import (AlgoConfig, DataConfig, EvalConfig, ExperimentConfig, MeshConfig, ModelConfig,
                             OptimizerConfig, RewardConfig, RolloutConfig, SFTConfig)
from vapo_jax import advantages, losses, train_step
from vapo_jax.rewards import reward
from vapo_jax.trainer import Trainer

PARITY_REWARD = "rewards_for_tests:even_first_byte"  # Random per sample: mixed groups.
PROMPT_REWARD = "rewards_for_tests:answer_at_least_five"  # Decided by the prompt: learnable by a critic.


def config(tmp_path, *, reward_fn=None, sft_steps=0, eval_path=None, **algo) -> ExperimentConfig:
  return ExperimentConfig(
      name="test", rl_steps=2, run_dir=str(tmp_path), seed=0,
      model=ModelConfig(preset="micro", dtype="float32", remat=False, tokenizer="bytes", random_init=True),
      algo=AlgoConfig(**({"value_pretrain_steps": 1, "mini_batch_responses": 16} | algo)),
      optim=OptimizerConfig(actor_lr=1e-3, critic_lr=3e-3, warmup_steps=0, weight_decay=0.0),
      rollout=RolloutConfig(prompts_per_step=8, samples_per_prompt=4, max_prompt_tokens=16, max_response_tokens=16),
      reward=RewardConfig(answer_forms=("answer_line",), verifier_workers=1, reward_fn=reward_fn),
      data=DataConfig(train_path="synthetic:arithmetic?terms=2-3&count=200&seed=0", template="raw", chat_template=False),
      eval=EvalConfig(path=eval_path, samples_per_problem=2, every_steps=0),
      sft=SFTConfig(path="synthetic:arithmetic?terms=2-3&count=50&seed=2", steps=sft_steps, batch_size=8, lr=1e-3),
      mesh=MeshConfig(preset="dp"),
  )


ALGORITHMS = {
    "vapo": {},
    "ppo": dict(lam_actor=0.95, lam_critic=0.95, decoupled_gae=False, length_adaptive_alpha=None,
                value_pretrain_steps=0, eps_high=0.2, loss_agg="seq-mean-token-mean", positive_nll_coef=0.0),
    "grpo": dict(estimator="group", value_pretrain_steps=0, eps_high=0.2, loss_agg="seq-mean-token-mean",
                 positive_nll_coef=0.0, kl_coef=0.001),
    "dapo": dict(estimator="group", value_pretrain_steps=0, positive_nll_coef=0.0, dynamic_sampling=True,
                 dynamic_sampling_max_rounds=1, overlong_buffer_tokens=4),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_runs_with_finite_losses(tmp_path, name):
  # VAPO runs every stage (warm start, evaluation, value pretraining, RL); the others RL only.
  full = dict(sft_steps=2, eval_path="synthetic:arithmetic?terms=2-3&count=8&seed=1") if name == "vapo" else {}
  trainer = Trainer(config(tmp_path, **full, **ALGORITHMS[name]), write_logs=True, verbose=False)
  summary = trainer.run()
  rl = [h for h in trainer.history if h["stage"] == "rl"]
  assert len(rl) == 2
  keys = ["actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout/response_len_mean"]
  keys += ["critic/value_loss"] if trainer.config.algo.uses_critic else ["actor/ref_kl"] if name == "grpo" else []
  for h in rl:
    for key in keys:
      assert math.isfinite(h[key]), (key, h[key])
  if name == "vapo":
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert [h["stage"] for h in trainer.history] == ["sft"] * 2 + ["value_pretrain"] + ["rl"] * 2
    assert (tmp_path / "test" / "export" / "model.safetensors").exists()  # The final policy, HF format.
    again = Trainer(trainer.config, verbose=False)  # The same run again: resumes at its end.
    assert again.stage == "done" and again.run()["accuracy_after_rl"] == summary["accuracy_after_rl"]
  lines = (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()
  assert any('"stage": "rl"' in line and "actor/clip_frac_high" in line and "time/rollout_s" in line for line in lines)
  assert list((tmp_path / "test" / "tensorboard").iterdir())


def test_value_pretraining_raises_explained_variance(tmp_path):
  cfg = config(tmp_path, reward_fn=PROMPT_REWARD, value_pretrain_steps=10, mini_batch_responses=8)
  cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, value_pretrain_patience=10),
                            data=dataclasses.replace(cfg.data, train_path="synthetic:arithmetic?terms=1-1&count=50"),
                            rollout=dataclasses.replace(cfg.rollout, prompts_per_step=16, samples_per_prompt=2))
  trainer = Trainer(cfg, write_logs=False, verbose=False)
  # A held-out batch from the same fixed policy, scored before and after value pretraining.
  out, _, arrays, _ = trainer.sample_batch()
  returns = advantages.monte_carlo_returns(reward.last_token_rewards(arrays["rewards"], out.response_mask),
                                           out.response_mask)
  tokens, attention = train_step.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, out.response_mask)

  def explained_variance():
    v = train_step.values(trainer.critic_def, trainer.critic, tokens, attention, response_len=16)
    return float(losses.explained_variance(v, returns, out.response_mask))

  actor_before = jax.tree.map(np.asarray, trainer.actor)
  before = explained_variance()
  trainer.value_pretrain_stage()
  after = explained_variance()
  assert len([h for h in trainer.history if h["stage"] == "value_pretrain"]) == 10
  assert after > before + 0.2, (before, after)
  for a, b in zip(jax.tree.leaves(actor_before), jax.tree.leaves(trainer.actor)):
    np.testing.assert_array_equal(a, b)  # Only the critic trains.
  trainer.pool.close()


def test_dynamic_sampling_fills_the_batch_with_mixed_groups(tmp_path):
  cfg = config(tmp_path, reward_fn=PARITY_REWARD, **ALGORITHMS["dapo"] | {"dynamic_sampling_max_rounds": 10})
  trainer = Trainer(cfg, write_logs=False, verbose=False)
  out, rows, arrays, stats = trainer.sample_batch()
  accuracy = arrays["correct"].reshape(8, 4).mean(axis=1)
  assert len(rows) == 8 and out.response_tokens.shape[0] == 32
  assert np.all((accuracy > 0) & (accuracy < 1)), accuracy
  assert stats["rollout/mixed_group_frac"] == 1.0 and stats["rollout/sampling_rounds"] >= 1
  trainer.pool.close()


def test_loss_on_a_memorised_batch_falls(tmp_path):
  trainer = Trainer(config(tmp_path, reward_fn=PARITY_REWARD, mini_batch_responses=32), write_logs=False,
                    verbose=False)
  out, _, arrays, _ = trainer.sample_batch()
  batch, _ = trainer.train_batch(out, arrays)
  history = [trainer.update(batch, actor=True, critic=True) for _ in range(15)]
  assert history[-1]["critic/value_loss"] < 0.5 * history[0]["critic/value_loss"]
  assert history[-1]["actor/loss"] < history[0]["actor/loss"] - 0.05
  trainer.pool.close()


def test_one_and_eight_devices_give_the_same_losses(tmp_path):
  losses = []
  for devices in ([jax.devices()[0]], jax.devices()):
    cfg = config(tmp_path, reward_fn=PARITY_REWARD, value_pretrain_steps=0)
    trainer = Trainer(dataclasses.replace(cfg, rl_steps=1), devices=devices, write_logs=False, verbose=False)
    assert trainer.mesh.size == len(devices)
    trainer.run()
    losses.append({k: v for h in trainer.history for k, v in h.items()
                   if k.startswith(("actor/", "critic/")) and isinstance(v, float)})
  assert losses[0].keys() == losses[1].keys()
  for key in losses[0]:
    np.testing.assert_allclose(losses[1][key], losses[0][key], rtol=1e-5, atol=1e-5, err_msg=key)
