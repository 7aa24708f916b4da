"""The reward model the paper's critics start from, made and loaded by the code path a user runs: the
toy's `toy_reward_model` experiment (`make train EXP=toy_reward_model`, the sweeps' shared stage) fits
the critic on the last token's verdict alone and exports it; a member given the export as
`model.critic_checkpoint` (as `make sweep` passes it) starts its critic with its weights and values.
And the held-out evaluation's keys: fixed by the seed and the RL steps done, shared by every member."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.cli import resolve
from vapo_jax.data.tokenizer import ByteTokenizer
from vapo_jax.rewards import reward as reward_lib
from vapo_jax.rl import advantages
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import experience, held_out, updates
from vapo_jax.train.trainer import Trainer


def config(*argv):
  return resolve.resolve(["--smoke", *argv])[0]


@pytest.mark.slow  # For time (22 s): make test checks the reward model's labels and evaluation keys.
def test_reward_model_fits_the_last_token_and_its_export_starts_the_critic(tmp_path):
  made = config("--exp", "toy_reward_model", f"run_dir={tmp_path}", "name=rm", "sft.steps=0")
  assert made.algo.value_pretrain_target == "outcome" and made.rl_steps == 0 and made.eval.path is None
  maker = Trainer(made, verbose=False)
  state, key = maker.state.split_key()
  out, rewards, correct, _, prefixes = maker.experience.sample(state, maker.progress.prompts, key, prefix_step=0)
  assert prefixes is None  # Labels only for the "prefix" target.
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
  data = lambda seed, done: np.asarray(jax.random.key_data(held_out.evaluation_key(seed, done)))
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
  chunk = jax.random.fold_in(held_out.evaluation_key(3, 25), 0)  # Its first call's: chunk 0 of that key.
  np.testing.assert_array_equal(keys[0], np.asarray(jax.random.key_data(chunk)))
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(trainer.state.key)), chain)  # Not consumed.
  trainer.close()


def test_prefix_labels_are_the_verdicts_of_the_prefixes_read_as_finished_responses():
  """`toy_reward_model_prefix`'s labels: K prefix lengths per response, uniform over 1 ≤ k < l (k = l for a
  one-token response), each labelled with the reward `verify` gives the response cut at k (a whole response's
  path): a correct solution's prefixes are incorrect until its answer is whole, and then correct."""
  made = config("--exp", "toy_reward_model_prefix", "sft.steps=0", "algo.value_pretrain_prefixes=256")
  assert made.algo.value_pretrain_target == "prefix"
  tokenizer, width = ByteTokenizer(), 24
  texts = ["12+9\n21\nAnswer: 21", "12+9\n21\nAnswer: 22", ""]  # Correct, wrong, EOS alone; 7+5+9 = 21.
  ids = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]
  lengths = np.array([len(i) for i in ids], np.int32)
  response = np.array([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids], np.int32)
  mask = np.arange(width)[None] < lengths[:, None]
  zeros = np.zeros((3, width), np.float32)
  out = Rollout(*map(jnp.asarray, (np.ones((3, 4), np.int32), np.ones((3, 4), bool), response, mask, lengths,
                                   np.zeros(3, np.int32), zeros, zeros)))
  pool = reward_lib.make_pool(workers=0)
  try:
    labeller = experience.Experience(made, steps=None, layout=None, model_cfg=None, tokenizer=tokenizer, pool=pool)
    labels = labeller.prefix_labels(out, ["21"] * 3, experience.prefix_rng(0, 0))
    cut, got = np.asarray(labels.lengths), np.asarray(labels.rewards)
    assert cut.shape == got.shape == (3, 256)
    for b in range(2):  # Every length below the response's own is drawn; none at or beyond it.
      assert set(cut[b]) == set(range(1, lengths[b])), b
    np.testing.assert_array_equal(cut[2], 1)  # A one-token response: its only prefix is itself.
    for j in range(0, 256, 37):  # Each label is the reward of the response cut at k, verified as a whole one.
      whole = labeller.verify(out._replace(response_lengths=jnp.asarray(cut[:, j])), ["21"] * 3)
      np.testing.assert_array_equal(got[:, j], whole.rewards, err_msg=j)
    answer_done = lengths[0] - 1  # "…Answer: 21" without its EOS reads as a finished, correct response.
    np.testing.assert_array_equal(got[0], np.where(cut[0] >= answer_done, 1.0, -1.0))
    np.testing.assert_array_equal(got[1:], -1.0)
  finally:
    pool.close()


@pytest.mark.slow  # make test-slow: the toy's warm start and its prefix reward model, at a third of their steps.
def test_the_prefix_reward_model_scores_the_first_tokens_below_the_return(tmp_path, capsys):
  """`toy_reward_model_prefix` from the toy's warm start (both shortened): on fresh samples of the warm start,
  its values over the first decile of each response sit below the Monte-Carlo return (V − G < 0: the paper's
  sign), and below the outcome-only model's, from the same start on the same samples, printed beside it."""
  import json

  runs = {}
  for name, extra in (("toy_warm_start", ["sft.steps=300"]),
                      ("toy_reward_model_prefix", ["algo.value_pretrain_steps=15"]),
                      ("toy_reward_model", ["algo.value_pretrain_steps=15"])):
    start = [f"model.checkpoint={runs['toy_warm_start']}/export", "sft.steps=0"] if runs else []
    made = resolve.resolve(["--exp", name, f"run_dir={tmp_path}", f"name={name}", *extra, *start])[0]  # Full size.
    Trainer(made, verbose=False).run()
    runs[name] = str(tmp_path / name)
  bias = {}
  for name in ("toy_reward_model_prefix", "toy_reward_model"):
    rows = [json.loads(line) for line in open(f"{runs[name]}/metrics.jsonl")]
    last = [r for r in rows if r.get("stage") == "value_pretrain"][-3:]  # Each step scores fresh samples first.
    bias[name] = [np.mean([r[f"critic/value_bias_decile_{k}"] for r in last]) for k in (0, 9)]
  with capsys.disabled():
    print(f"\nV − G on the warm start's samples, first / last decile (mean of the last 3 value-pretraining steps): "
          f"prefix {bias['toy_reward_model_prefix'][0]:+.3f} / {bias['toy_reward_model_prefix'][1]:+.3f}, "
          f"outcome {bias['toy_reward_model'][0]:+.3f} / {bias['toy_reward_model'][1]:+.3f}")
  # Measured at these shortened steps (2-core machine): prefix −0.098 / −0.056, outcome +0.019 / −0.015; the
  # full stages of the sweep: prefix −0.66 to −0.94 on the first decile (docs/experiments.md, "Toy v3").
  prefix_first, outcome_first = bias["toy_reward_model_prefix"][0], bias["toy_reward_model"][0]
  assert prefix_first < 0 and prefix_first < outcome_first - 0.05, bias
