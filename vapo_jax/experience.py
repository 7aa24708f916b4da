"""Experience for the trainer: prompts → sampled responses → rewards → a `TrainBatch`.

`ExperienceMixin` is the part of `trainer.Trainer` that makes training data: it samples G
responses per prompt with the rollout engine, scores them with the verifier pool, refills the
batch with mixed groups under dynamic sampling, and computes the rollout policy's log-probs, the
critic's values and the advantages. It uses the trainer's mesh, models, tokenizer and PRNG key.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from vapo_jax import advantages as adv_lib
from vapo_jax import data, distributed, losses, masked, rollout, tasks, tokenizer as tok_lib, train_step
from vapo_jax.config import ExperimentConfig
from vapo_jax.models import sharding
from vapo_jax.rewards import reward as reward_lib


def load_problems(path: str, config: ExperimentConfig) -> list[dict]:
  """Rows with `problem`, `answer`, `id` (and `solution` when known) from a file or a synthetic spec."""
  if tasks.is_spec(path):
    return tasks.from_spec(path)
  d = config.data
  records = data.load_records(path, schema=d.schema, prompt_field=d.prompt_field, answer_field=d.answer_field,
                              id_field=d.id_field, split=d.split, skip_bad_rows=d.skip_bad_rows)
  if d.dedup:
    records, _ = data.deduplicate(records)
  return [{"problem": r.prompt, "answer": r.answer, "id": r.id, "source": r.source} for r in records]


def encode_prompt(row: dict, tokenizer, config: ExperimentConfig) -> list[int]:
  """Token ids of a problem in the configured template (and chat template); too long is an error."""
  d = config.data
  chat = d.chat_template and isinstance(tokenizer, tok_lib.HFTokenizer)
  text = data.format_prompt(row["problem"], template=d.template, tokenizer=tokenizer.tokenizer if chat else None)
  ids = tokenizer.encode(text)
  if len(ids) > config.rollout.max_prompt_tokens:
    raise data.DataError(f"prompt of problem id {row['id']!r} has {len(ids)} tokens, over "
                         f"rollout.max_prompt_tokens={config.rollout.max_prompt_tokens}")
  return ids


class ExperienceMixin:
  """Sampling, scoring and batch preparation; mixed into `trainer.Trainer`."""

  def shard_batch(self, tree):
    """Host arrays (the same on every process) → global arrays, batch axis over the data axes."""
    data_size = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    spec = sharding.partition_spec(("batch",), self.rules)
    def put(x):
      x = np.asarray(x)
      split = x.ndim and x.shape[0] % data_size == 0
      return distributed.global_array(x, jax.sharding.NamedSharding(
          self.mesh, spec if split else jax.sharding.PartitionSpec()))
    return jax.tree.map(put, tree)

  def next_key(self) -> jax.Array:
    self.key, sub = jax.random.split(self.key)
    return sub

  def encode_prompt(self, row: dict) -> list[int]:
    return encode_prompt(row, self.tokenizer, self.config)

  def generate(self, rows: list[dict], *, group: int, temperature: float, top_p: float, top_k: int = 0):
    """Samples `group` responses for each row's prompt; numpy `Rollout` with B = len(rows)·group."""
    r = self.config.rollout
    tokens, mask = rollout.pad_prompts([self.encode_prompt(row) for row in rows], pad_id=self.tokenizer.pad_token_id)
    data_size = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    rollout.check_cache_fits(self.model_cfg, batch=len(rows) * group, prompt_tokens=tokens.shape[1],
                             max_new_tokens=r.max_response_tokens, budget_bytes=int(r.kv_cache_budget_gib * 2**30),
                             dtype=jnp.dtype(self.config.model.dtype), devices=data_size)
    sampling = rollout.Sampling(max_new_tokens=r.max_response_tokens, stop_token_ids=self.stop_ids,
                                temperature=temperature, top_p=top_p, top_k=top_k)
    fn = rollout.make_generate(sampling=sampling, samples_per_prompt=group, pad_id=self.tokenizer.pad_token_id,
                               cache_dtype=jnp.dtype(self.config.model.dtype))
    key = self.next_key()
    with sharding.use_rules(self.mesh, self.rules):
      out = fn(nnx.merge(self.actor_def, self.actor), *self.shard_batch((tokens, mask)), key)
    return distributed.to_host(out)

  def score(self, out: rollout.Rollout, answers: list[str]) -> reward_lib.RewardBatch:
    """Verifier rewards of every response. With several processes each scores its share of the
    batch and the rewards are gathered (the per-response answer strings then stay local)."""
    c, n, processes = self.config, len(answers), distributed.process_count()
    share = distributed.local_share(n) if processes > 1 and n % processes == 0 else slice(0, n)
    lengths = out.response_lengths[share]
    texts = [self.tokenizer.decode(t[:k]) for t, k in zip(out.response_tokens[share], lengths)]
    scored = reward_lib.compute_rewards(
        self.pool, texts, answers[share], lengths, correct_reward=c.reward.correct,
        incorrect_reward=c.reward.incorrect, forms=c.reward.answer_forms,
        max_response_tokens=c.rollout.max_response_tokens, overlong_buffer_tokens=c.algo.overlong_buffer_tokens,
        overlong_penalty_factor=c.algo.overlong_penalty_factor, format_penalty_value=c.reward.format_penalty)
    if share == slice(0, n):
      return scored
    gather = lambda x: np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
    keys = sorted(scored.metrics)
    per_process = gather(np.asarray([[scored.metrics[k] for k in keys]], np.float64))  # [processes, K]
    metrics = {k: float(per_process[:, i].max() if k.startswith("time/") else
                        per_process[:, i].sum() if k.startswith("perf/") or "verifier_" in k else
                        per_process[:, i].mean()) for i, k in enumerate(keys)}
    return scored._replace(rewards=gather(scored.rewards), correct=gather(scored.correct), metrics=metrics)

  def sample_batch(self):
    """A scored rollout batch of P prompts × G samples (DAPO: refilled with mixed groups)."""
    c, group = self.config, self.config.rollout.samples_per_prompt
    kept, spare, rounds = [], [], 0
    while True:
      rows = [{"problem": r.prompt, "answer": r.answer, "id": r.id} for r in next(self.prompts)]
      per_call = c.rollout.prompts_per_generation or len(rows)  # Rounds bound the KV cache.
      out = concat_rollouts([self.generate(rows[i:i + per_call], group=group, temperature=c.rollout.temperature,
                                           top_p=c.rollout.top_p, top_k=c.rollout.top_k)
                             for i in range(0, len(rows), per_call)])
      scored = self.score(out, [row["answer"] for row in rows for _ in range(group)])
      rounds += 1
      accuracy = scored.correct.reshape(len(rows), group).mean(axis=1)
      for p, row in enumerate(rows):
        take = lambda x: x[p * group:(p + 1) * group]
        piece = (jax.tree.map(take, out), row, {"rewards": take(scored.rewards), "correct": take(scored.correct)})
        (kept if 0 < accuracy[p] < 1 or not c.algo.dynamic_sampling else spare).append(piece)
      if not c.algo.dynamic_sampling or len(kept) >= len(rows) or rounds > c.algo.dynamic_sampling_max_rounds:
        break
    pieces = (kept + spare)[:c.rollout.prompts_per_step]
    out = concat_rollouts([p[0] for p in pieces])
    arrays = {k: np.concatenate([p[2][k] for p in pieces]) for k in pieces[0][2]}
    stats = scored.metrics | {"rollout/sampling_rounds": float(rounds),
                              "rollout/mixed_group_frac": min(len(kept), len(pieces)) / len(pieces)}
    return out, [p[1] for p in pieces], arrays, stats

  def train_batch(self, out: rollout.Rollout, arrays: dict[str, np.ndarray], *, critic_only: bool = False):
    """Log-probs, values and advantages for a scored rollout; the `TrainBatch` and its metrics.

    `critic_only` (value pretraining): values and Monte-Carlo returns only; no actor forward.
    """
    c, response_len = self.config, out.response_tokens.shape[1]
    tokens, attention = train_step.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, out.response_mask)
    tokens, attention, response_tokens = self.shard_batch((tokens, attention, out.response_tokens))
    mask = self.shard_batch(np.asarray(out.response_mask))
    zeros = self.shard_batch(np.zeros(mask.shape, np.float32))
    token_rewards = self.shard_batch(reward_lib.last_token_rewards(arrays["rewards"], out.response_mask))
    stats, chunks = {}, {"micro": self.micro, "shards": self.batch_shards}
    with sharding.use_rules(self.mesh, self.rules):
      values = (train_step.values(self.critic_def, self.critic, tokens, attention, response_len=response_len, **chunks)
                if c.algo.uses_critic else zeros)
      if critic_only:
        returns, ev = _monte_carlo(token_rewards, mask, values, gamma=c.algo.gamma)
        batch = train_step.TrainBatch(tokens, attention, response_tokens, mask, zeros, zeros, returns, values,
                                      self.shard_batch(arrays["correct"]), zeros)
        return batch, {"critic/explained_variance": float(ev)}
      old_logprobs, entropy = train_step.logprobs_and_entropy(self.actor_def, self.actor, tokens, attention,
                                                              response_tokens, response_len=response_len, **chunks)
      ref = (train_step.logprobs_and_entropy(self.actor_def, self.ref, tokens, attention, response_tokens,
                                             response_len=response_len, **chunks)[0] if self.ref is not None else zeros)
    est = self._advantages(token_rewards, values, mask, self.shard_batch(arrays["rewards"]))
    batch = train_step.TrainBatch(tokens, attention, response_tokens, mask, old_logprobs, est.advantages,
                                  est.returns, values, self.shard_batch(arrays["correct"]), ref)
    policy_logprobs = self.shard_batch(np.asarray(out.policy_logprobs, np.float32))
    stats = _batch_stats(entropy, policy_logprobs, old_logprobs, values, est, mask, uses_critic=c.algo.uses_critic)
    return batch, {k: float(v) for k, v in stats.items()}


@functools.partial(jax.jit, static_argnames=("gamma",))
def _monte_carlo(token_rewards, mask, values, *, gamma):
  returns = adv_lib.monte_carlo_returns(token_rewards, mask, gamma=gamma)
  return returns, losses.explained_variance(values, returns, mask)


@functools.partial(jax.jit, static_argnames=("uses_critic",))
def _batch_stats(entropy, policy_logprobs, old_logprobs, values, est, mask, *, uses_critic: bool):
  """The rollout batch's metrics, in one program (not one dispatch per figure)."""
  return {
      "actor/entropy_rollout": masked.masked_mean(entropy, mask),
      "rollout/logprob_gap": masked.masked_mean(jnp.abs(policy_logprobs - old_logprobs), mask),
      "critic/explained_variance": losses.explained_variance(values, est.returns, mask) if uses_critic else 0.0,
      "critic/value_mean": masked.masked_mean(values, mask), "critic/return_mean": masked.masked_mean(est.returns, mask),
      "adv/lam_actor_mean": jnp.mean(est.lam_actor), "adv/lam_actor_min": jnp.min(est.lam_actor),
      "adv/lam_actor_max": jnp.max(est.lam_actor), "adv/mean_abs": masked.masked_mean(jnp.abs(est.advantages), mask),
  }


def concat_rollouts(parts: list[rollout.Rollout]) -> rollout.Rollout:
  """Concatenates rollouts along the batch, left-padding prompts to the widest."""
  width = max(p.prompt_tokens.shape[1] for p in parts)
  def pad(x):
    return np.pad(x, ((0, 0), (width - x.shape[1], 0)))
  parts = [p._replace(prompt_tokens=pad(p.prompt_tokens), prompt_mask=pad(p.prompt_mask)) for p in parts]
  return rollout.Rollout(*(np.concatenate(fields) for fields in zip(*parts)))
