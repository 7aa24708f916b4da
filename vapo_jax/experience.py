"""Experience: prompts → sampled responses → verifier rewards → a scored `TrainBatch`.

  experience = Experience(config, steps=steps, model_cfg=model_cfg, tokenizer=tokenizer, pool=pool)
  batch, stats = experience.collect(state, prompts, key)

The rollout stays on the devices as global arrays. Crossing to the host, and nothing else:
the prompts' token ids (in), the token ids and lengths of this process's share of the responses
(out, for the verifier), and the verifier's rewards and verdicts (in). Dynamic sampling also
brings every process the verdicts of the whole batch and sends back the rows it keeps.
Log-probs, values, advantages and the batch statistics are one jitted program (`_score`).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import advantages as adv_lib, algorithm, data, distributed, generation, losses, masked, problems
from vapo_jax import rollout
from vapo_jax import train_step
from vapo_jax.config import ConfigError, ExperimentConfig
from vapo_jax.models import sharding
from vapo_jax.rewards import reward as reward_lib
from vapo_jax.state import TrainState


class DynamicSamplingCapReached(RuntimeError):
  """Dynamic sampling hit `algo.dynamic_sampling_max_rounds` with `dynamic_sampling_on_cap="raise"`."""


class Experience:
  """Sampling, verifying and scoring for one run (its config, mesh, models, tokenizer and verifier)."""

  def __init__(self, config: ExperimentConfig, *, steps: train_step.Steps, model_cfg, tokenizer, pool):
    self.config, self.steps, self.model_cfg, self.tokenizer, self.pool = config, steps, model_cfg, tokenizer, pool
    self.mesh = steps.mesh
    self.rows = jax.sharding.NamedSharding(self.mesh, sharding.partition_spec(("batch",), steps.rules))
    self.stop_ids = tuple(sorted({tokenizer.eos_token_id, *config.rollout.stop_token_ids}))
    self._score = {only: steps.jit(functools.partial(_score, steps, config, critic_only=only)) for only in (False, True)}

  def place(self, tree):
    """Host arrays (the same on every process) → global arrays split over the batch axes."""
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: distributed.global_array(
        x, self.rows if np.ndim(x) and np.shape(x)[0] % shards == 0 else replicated), tree)

  def generate(self, state: TrainState, records: list[data.Record], key: jax.Array, *, group: int,
               temperature: float, top_p: float, top_k: int = 0) -> tuple[rollout.Rollout, dict[str, float]]:
    """`group` sampled responses for each record's prompt, as global arrays (B = len(records)·group),
    and the rollout's metrics, with the configured engine (`generation`: static, in rounds of
    `rollout.prompts_per_generation` prompts, or slot refill). Sequence n draws from fold_in(key, n)
    whatever the engine."""
    settings, dtype = self.config.rollout, jnp.dtype(self.config.model.dtype)
    tokens, mask = rollout.pad_prompts([problems.encode_prompt(x, self.tokenizer, self.config) for x in records],
                                       pad_id=self.tokenizer.pad_token_id)
    engine = self.engine(len(records), group, tokens.shape[1])
    sampling = rollout.Sampling(max_new_tokens=settings.max_response_tokens, stop_token_ids=self.stop_ids,
                                temperature=temperature, top_p=top_p, top_k=top_k)
    return generation.sample(nnx.merge(self.steps.actor_def, state.actor), tokens, mask, key, sampling=sampling,
                             samples_per_prompt=group, engine=engine, pad_id=self.tokenizer.pad_token_id,
                             cache_dtype=dtype, jit=self.steps.jit, place=self.place)

  def engine(self, prompts: int, group: int, prompt_tokens: int) -> generation.Engine:
    """The rollout engine for `prompts` × `group` sequences of `prompt_tokens`-token prompts; a KV
    cache over `rollout.kv_cache_budget_gib` per device is a `ConfigError` naming what to change."""
    settings, dtype = self.config.rollout, jnp.dtype(self.config.model.dtype)
    try:
      engine = generation.engine_for(settings, self.model_cfg, sequences=prompts * group, prompt_tokens=prompt_tokens,
                                     dtype=dtype, devices=self.steps.shards)
      if engine.kind == "static":
        rollout.check_cache_fits(self.model_cfg, batch=min(settings.prompts_per_generation or prompts, prompts) * group,
                                 prompt_tokens=prompt_tokens, max_new_tokens=settings.max_response_tokens,
                                 dtype=dtype, devices=self.steps.shards,
                                 budget_bytes=int(settings.kv_cache_budget_gib * 2**30))
    except MemoryError as e:
      raise ConfigError(str(e)) from None
    return engine

  def check_cache_budget(self) -> None:
    """At start-up: the KV cache of a training rollout with the longest prompts allowed fits."""
    settings = self.config.rollout
    self.engine(settings.prompts_per_step, settings.samples_per_prompt, rollout.prompt_bucket(settings.max_prompt_tokens))

  def verify(self, out: rollout.Rollout, answers: list[str]) -> reward_lib.RewardBatch:
    """Verifier rewards of this process's share of the responses (a host transfer of their token ids
    and lengths); with several processes the per-response fields are this process's rows only and
    the metrics are combined over processes."""
    config = self.config
    share, tokens = distributed.local_rows(out.response_tokens)
    _, lengths = distributed.local_rows(out.response_lengths)
    texts = [self.tokenizer.decode(t[:k]) for t, k in zip(tokens, lengths)]
    scored = reward_lib.compute_rewards(
        self.pool, texts, answers[share], lengths, correct_reward=config.reward.correct,
        incorrect_reward=config.reward.incorrect, forms=config.reward.answer_forms,
        max_response_tokens=config.rollout.max_response_tokens, overlong_buffer_tokens=config.algo.overlong_buffer_tokens,
        overlong_penalty_factor=config.algo.overlong_penalty_factor, format_penalty_value=config.reward.format_penalty)
    scored = scored._replace(metrics=distributed.combine_metrics(scored.metrics))
    reward_lib.check_errors(scored, self.pool, max_error_frac=config.reward.max_error_frac)  # Every process agrees.
    return scored

  def sample(self, state: TrainState, prompts: data.PromptIterator, key: jax.Array):
    """A verified rollout of P prompts × G samples: (rollout, rewards, correct, stats), the rewards and
    verdicts as global arrays. Under dynamic sampling, refilled with groups of mixed verdicts."""
    config, settings = self.config, self.config.rollout
    group = settings.samples_per_prompt
    if not config.algo.dynamic_sampling:
      records = next(prompts)
      out, generated = self.generate(state, records, key, group=group, temperature=settings.temperature,
                                     top_p=settings.top_p, top_k=settings.top_k)
      scored = self.verify(out, [x.answer for x in records for _ in range(group)])
      rewards, correct = self._place_share(scored, out)
      return out, rewards, correct, generated | scored.metrics | {"rollout/sampling_rounds": 1.0}
    kept, spare, parts, rounds, rollout_s = [], [], [], 0, 0.0
    while True:
      records = next(prompts)
      key, sample_key = jax.random.split(key)
      out, generated = self.generate(state, records, sample_key, group=group, temperature=settings.temperature,
                                     top_p=settings.top_p, top_k=settings.top_k)
      rollout_s += generated["time/rollout_s"]
      scored = self.verify(out, [x.answer for x in records for _ in range(group)])
      correct = distributed.gather_rows(scored.correct).reshape(len(records), group)
      rewards = distributed.gather_rows(scored.rewards).reshape(len(records), group)
      offset = sum(len(p[0].response_lengths) for p in parts)
      parts.append((out, rewards, correct))
      for p, accuracy in enumerate(correct.mean(axis=1)):
        (kept if 0 < accuracy < 1 else spare).append(offset // group + p)
      rounds += 1
      if len(kept) >= settings.prompts_per_step or rounds > config.algo.dynamic_sampling_max_rounds:
        break
    if len(kept) < settings.prompts_per_step:
      message = (f"dynamic sampling found {len(kept)} groups with mixed verdicts of the {settings.prompts_per_step} "
                 f"a step needs in {rounds} rounds (algo.dynamic_sampling_max_rounds="
                 f"{config.algo.dynamic_sampling_max_rounds}); {settings.prompts_per_step - len(kept)} groups of "
                 "all-equal verdicts (zero advantage) fill the batch")
      if config.algo.dynamic_sampling_on_cap == "raise":
        raise DynamicSamplingCapReached(message + ". Raise the cap, or set algo.dynamic_sampling_on_cap=warn")
      warnings.warn(message, stacklevel=2)
    groups = np.asarray((kept + spare)[:settings.prompts_per_step])
    rows = (groups[:, None] * group + np.arange(group)).reshape(-1)
    out = _concat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    out = _take(out, self.place(rows.astype(np.int32)))
    rewards, correct = (self.place(np.concatenate([p[i] for p in parts]).reshape(-1)[rows]) for i in (1, 2))
    stats = generated | scored.metrics | {"time/rollout_s": rollout_s, "rollout/sampling_rounds": float(rounds),
                              "rollout/mixed_group_frac": min(len(kept), len(groups)) / len(groups),
                              "rollout/unmixed_groups": float(max(0, len(groups) - len(kept)))}
    return out, rewards, correct, stats

  def _place_share(self, scored: reward_lib.RewardBatch, out: rollout.Rollout):
    """This process's rewards and verdicts as global arrays laid out like the rollout's rows."""
    n = out.response_lengths.shape[0]
    place = lambda x: distributed.global_array_from_share(np.asarray(x), out.response_lengths.sharding, n)
    return place(scored.rewards.astype(np.float32)), place(scored.correct.astype(bool))

  def score(self, state: TrainState, out: rollout.Rollout, rewards, correct, *, critic_only: bool = False):
    """The `TrainBatch` of a verified rollout and its statistics (device scalars), in one program.
    `critic_only` (value pretraining): values and Monte-Carlo returns, no actor forward."""
    return self._score[critic_only](state, out, rewards, correct)

  def collect(self, state: TrainState, prompts: data.PromptIterator, key: jax.Array, *, critic_only: bool = False):
    """A scored `TrainBatch` of the next prompts and its statistics (device scalars and host floats)."""
    out, rewards, correct, stats = self.sample(state, prompts, key)
    batch, batch_stats = self.score(state, out, rewards, correct, critic_only=critic_only)
    return batch, stats | batch_stats

  def evaluate(self, state: TrainState, records: list[data.Record], key: jax.Array) -> dict:
    """avg@k on held-out problems with the eval sampling settings (device scalars)."""
    evaluation, settings = self.config.eval, self.config.rollout
    per_call = max(1, (settings.prompts_per_generation or settings.prompts_per_step) * settings.samples_per_prompt // evaluation.samples_per_problem)
    correct, lengths = [], []
    for n, i in enumerate(range(0, len(records), per_call)):
      part = records[i:i + per_call]
      out, _ = self.generate(state, part, jax.random.fold_in(key, n), group=evaluation.samples_per_problem,
                             temperature=evaluation.temperature, top_p=evaluation.top_p)
      scored = self.verify(out, [x.answer for x in part for _ in range(evaluation.samples_per_problem)])
      correct.append(distributed.gather_rows(scored.correct))
      lengths.append(distributed.gather_rows(distributed.local_rows(out.response_lengths)[1]))
    return {"eval/accuracy": float(np.concatenate(correct).mean()),
            "eval/response_len_mean": float(np.concatenate(lengths).mean())}


@jax.jit
def _concat(parts: list[rollout.Rollout]) -> rollout.Rollout:
  """Rollouts concatenated along the batch, prompts left-padded to the widest."""
  width = max(p.prompt_tokens.shape[1] for p in parts)
  pad = lambda x: jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))
  parts = [p._replace(prompt_tokens=pad(p.prompt_tokens), prompt_mask=pad(p.prompt_mask)) for p in parts]
  return rollout.Rollout(*(jnp.concatenate(fields) for fields in zip(*parts)))


@jax.jit
def _take(tree, rows):
  return jax.tree.map(lambda x: x[rows], tree)


def _score(steps: train_step.Steps, config: ExperimentConfig, state: TrainState, out: rollout.Rollout, rewards,
           correct, *, critic_only: bool):
  """Values, log-probs, advantages (or Monte-Carlo returns) and the batch statistics: one program."""
  algo, mask = config.algo, out.response_mask
  tokens, attention = train_step.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, mask)
  response_len = mask.shape[1]
  chunks = {"micro": steps.micro, "shards": steps.shards}
  lengths = jnp.sum(mask, axis=-1)
  token_rewards = jnp.where(jnp.arange(response_len)[None] == (lengths - 1)[:, None], rewards[:, None], 0.0)
  values = (train_step.values(steps.critic_def, state.critic, tokens, attention, response_len=response_len, **chunks)
            if algo.uses_critic else None)
  stats = {"rollout/reward_mean": jnp.mean(rewards), "rollout/accuracy": jnp.mean(correct.astype(jnp.float32)),
           "actor/positive_frac": jnp.mean(correct.astype(jnp.float32)),
           "rollout/response_len_mean": jnp.mean(lengths), "rollout/response_len_min": jnp.min(lengths),
           "rollout/truncated_frac": jnp.mean((lengths >= config.rollout.max_response_tokens).astype(jnp.float32))}
  if critic_only:
    returns = adv_lib.monte_carlo_returns(token_rewards, mask, gamma=algo.gamma)
    stats["critic/explained_variance"] = losses.explained_variance(values, returns, mask)
    return train_step.TrainBatch(tokens, attention, mask, returns, values, correct), stats
  logprob_args = dict(response_len=response_len, chunk=steps.chunk, **chunks)
  old_logprobs, entropy = train_step.logprobs_and_entropy(steps.actor_def, state.actor, tokens, attention,
                                                          **logprob_args)
  ref = (train_step.logprobs_and_entropy(steps.actor_def, state.ref, tokens, attention, **logprob_args)[0]
         if state.ref is not None else None)
  est = algorithm.compute_advantages(algo, token_rewards, jnp.where(mask, values, 0.0) if values is not None
                                     else jnp.zeros(mask.shape, jnp.float32), mask, rewards,
                                     group_size=config.rollout.samples_per_prompt)
  stats |= {
      "actor/entropy": masked.masked_mean(entropy, mask),  # Of the rollout policy, on this batch.
      "rollout/logprob_gap": masked.masked_mean(jnp.abs(out.policy_logprobs - old_logprobs), mask),
      "critic/explained_variance": losses.explained_variance(values, est.returns, mask) if values is not None else 0.0,
      "critic/value_mean": masked.masked_mean(values, mask) if values is not None else 0.0,
      "critic/return_mean": masked.masked_mean(est.returns, mask),
      "adv/lam_actor_mean": jnp.mean(est.lam_actor), "adv/lam_actor_min": jnp.min(est.lam_actor),
      "adv/lam_actor_max": jnp.max(est.lam_actor), "adv/mean_abs": masked.masked_mean(jnp.abs(est.advantages), mask)}
  batch = train_step.TrainBatch(tokens, attention, mask, est.returns, values, correct, old_logprobs, est.advantages, ref)
  return batch, stats
