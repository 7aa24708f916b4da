"""The reward model the paper's critics start from, made and loaded by the code path a user runs: the
toy's `toy_reward_model` experiment (`make train EXP=toy_reward_model`, the sweeps' shared stage) fits
the critic on the last token's verdict alone and exports it; a member given the export as
`model.critic_checkpoint` (as `make sweep` passes it) starts its critic with its weights and values.
And the held-out evaluation's keys: fixed by the seed and the RL steps done, shared by every member."""

import jax
import numpy as np

from vapo_jax.cli import resolve
from vapo_jax.rl import advantages
from vapo_jax.train import experience, updates
from vapo_jax.train.trainer import Trainer


def config(*argv):
  return resolve.resolve(["--smoke", *argv])[0]


def test_reward_model_fits_the_last_token_and_its_export_starts_the_critic(tmp_path):
  made = config("--exp", "toy_reward_model", f"run_dir={tmp_path}", "name=rm", "sft.steps=0")
  assert made.algo.value_pretrain_target == "outcome" and made.rl_steps == 0 and made.eval.path is None
  maker = Trainer(made, verbose=False)
  state, key = maker.state.split_key()
  out, rewards, correct, _ = maker.experience.sample(state, maker.progress.prompts, key)
  batch, _ = maker.steps.score(state, out, rewards, correct, critic_only=True)
  last = np.asarray(advantages.last_token_mask(batch.response_mask))
  np.testing.assert_array_equal(batch.value_mask, last)  # The value loss sees the last token alone...
  np.testing.assert_array_equal(np.asarray(batch.returns)[last], np.asarray(rewards))  # ...and its verdict.
  maker.run()
  export = tmp_path / "rm" / "critic_pretrained"
  assert (export / "model.safetensors").exists() and [h["stage"] for h in maker.history] == ["value_pretrain"]

  member = config("--exp", "toy_ppo", f"run_dir={tmp_path}", "name=ppo", "sft.steps=0",
                  f"model.critic_checkpoint={export}")
  trainer = Trainer(member, write_logs=False, verbose=False)
  for mine, theirs in zip(jax.tree.leaves(trainer.state.critic), jax.tree.leaves(maker.state.critic), strict=True):
    np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
  tokens, attention = updates.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, out.response_mask)
  value = lambda t: np.asarray(updates.values(t.steps.critic_def, t.state.critic, tokens, attention, response_len=16))
  np.testing.assert_array_equal(value(trainer), value(maker))
  assert np.abs(value(trainer)).max() > 1e-4  # Not the zero value head a critic from the policy starts with.
  trainer.close()


def test_evaluation_keys_are_fixed_by_the_seed_and_step_and_leave_the_key_chain(tmp_path, smoke_config, monkeypatch):
  data = lambda seed, done: np.asarray(jax.random.key_data(experience.evaluation_key(seed, done)))
  np.testing.assert_array_equal(data(3, 25), data(3, 25))
  assert len({data(s, d).tobytes() for s, d in [(0, 0), (0, 1), (1, 0), (1, 1)]}) == 4
  trainer = Trainer(smoke_config({"sft.steps": 0, "seed": 3}), write_logs=False, verbose=False)
  keys = []
  generate = trainer.experience.generate_in_layout
  monkeypatch.setattr(trainer.experience, "generate_in_layout",
                      lambda state, records, key, **kw: keys.append(np.asarray(jax.random.key_data(key)))
                      or generate(state, records, key, **kw))
  chain = np.asarray(jax.random.key_data(trainer.state.key))
  first = trainer.evaluate(25)
  assert keys and first == trainer.evaluate(25)  # The same key again: the same samples.
  chunk = jax.random.fold_in(experience.evaluation_key(3, 25), 0)  # Its first call's: chunk 0 of that key.
  np.testing.assert_array_equal(keys[0], np.asarray(jax.random.key_data(chunk)))
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(trainer.state.key)), chain)  # Not consumed.
  trainer.close()
