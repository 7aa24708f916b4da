"""Experience: prompts → sampled responses → verifier rewards, for training and evaluation.

  experience = Experience(config, steps=steps, layout=layout, model_cfg=model_cfg, tokenizer=tokenizer, pool=pool)
  out, rewards, correct, stats, _ = experience.sample(state, prompts, key)     # then `steps.score`

The rollout decodes in the rollout layout (`rollout/layout.py`): once per step (and per evaluation)
the actor is resharded into it, and the copy is dropped after generation; the rollout's arrays come
back laid out for scoring on the training mesh. The rollout stays on the devices as global arrays.
Crossing to the host, and nothing else: the prompts' token ids (in), the token ids and lengths of
this process's share of the responses (out, for the verifier), and the verifier's rewards and
verdicts (in). Dynamic sampling also brings every process the verdicts of the whole batch and sends
back the rows it keeps.

The problems → responses path outside a run (the plan, the sampling, `generate_responses`) is
`responses.py`; the held-out evaluation, which samples through an `Experience`, is `held_out.py`.
"""

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import distributed, rollout
from vapo_jax.config import ExperimentConfig
from vapo_jax.data import problems
from vapo_jax.data.prompt_iterator import PromptIterator
from vapo_jax.data.records import Record
from vapo_jax.errors import ConfigError
from vapo_jax.rewards import reward as reward_lib
from vapo_jax.rollout import common
from vapo_jax.rollout.layout import RolloutLayout
from vapo_jax.rollout.plan import plan_round
from vapo_jax.train import budgeted_rollout, held_out
from vapo_jax.train.algorithm import PrefixLabels
from vapo_jax.train.budgeted_rollout import BudgetedRollout
from vapo_jax.train.responses import generate_responses, plan, sampling_settings, stop_ids
from vapo_jax.train.state import TrainState
from vapo_jax.train.steps import Steps


def verifier_rounds(rounds: list[tuple[int, float, dict]]) -> dict[str, float]:
  """The verifier's metrics over a step's sampling rounds, each (responses, Σ rewards, its metrics): fractions
  weighted by the responses, counts and seconds summed, the rate over the sum, and `reward/sampled_mean`
  (every response sampled, before dynamic sampling's filter)."""
  responses = sum(n for n, _, _ in rounds)
  out = {"reward/sampled_mean": sum(total for _, total, _ in rounds) / max(responses, 1)}
  for key in rounds[0][2]:
    values = [(n, m[key]) for n, _, m in rounds]
    out[key] = (sum(n * v for n, v in values) / max(responses, 1) if key.endswith("_frac")
                else sum(v for _, v in values))
  if "time/verify_s" in out:
    out["perf/verify_responses_per_s"] = responses / max(out["time/verify_s"], 1e-9)
  return out


class DynamicSamplingCapReached(RuntimeError):
  """Dynamic sampling hit `algo.dynamic_sampling_max_rounds` with `dynamic_sampling_on_cap="raise"`."""


class Sampled(NamedTuple):
  """A verified rollout: the responses, their rewards and verdicts `[B]` (global arrays), the rollout's and
  verifier's metrics, and value pretraining's prefix labels (None unless asked for)."""

  out: common.Rollout
  rewards: jax.Array
  correct: jax.Array
  stats: dict
  prefixes: PrefixLabels | None = None


# Seeds the prefix lengths of value pretraining's "prefix" target, apart from every other stream of the run.
PREFIX_STREAM = 0x70726566  # "pref"


def prefix_rng(seed: int, step: int) -> np.random.Generator:
  """The prefix lengths' generator of value-pretraining step `step` (the run's global step): fixed by the
  seed, the step and the process, so a resumed step draws the same prefixes and no other stream moves."""
  return np.random.default_rng((seed, PREFIX_STREAM, step, jax.process_index()))


class Experience:
  """Sampling and verifying for one run (its config, programs, rollout layout, model shape, tokenizer and
  verifier)."""

  def __init__(self, config: ExperimentConfig, *, steps: Steps, layout: RolloutLayout, model_cfg, tokenizer,
               pool):
    self.config, self.steps, self.layout = config, steps, layout
    self.model_cfg, self.tokenizer, self.pool = model_cfg, tokenizer, pool
    # An RL step's rollout, chosen once: partial rounds under a decode budget, else a whole rollout
    # (`sample`).
    self.partial = BudgetedRollout(self._partial_context(), seed=config.seed, mesh=steps.mesh) if (
        config.rollout.decode_budget) else None
    self.rl_rollout = self._partial_rollout if self.partial else self._whole_rollout

  def _partial_context(self) -> budgeted_rollout.Context:
    r = self.config.rollout
    return budgeted_rollout.Context(
        settings=r, plan=self.plan_round(), policy=self.policy, layout=self.layout, place=self.steps.place,
        sampling=self.sampling_for(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        encode=lambda record: problems.encode_prompt(record, self.tokenizer, self.config),
        verify=lambda out,
        answers: (*self.place_share(scored := self.verify(out, answers), out), scored.metrics),
        pad_id=self.tokenizer.pad_token_id, cache_dtype=jnp.dtype(self.config.cache_dtype))

  def plan_round(self) -> rollout.RolloutPlan:
    """A partial rollout's round's plan on this run's groups (`plan.plan_round`); a `ConfigError` naming the
    budget when it cannot run."""
    r = self.config.rollout
    try:
      return plan_round(r, self.model_cfg, dtype=jnp.dtype(self.config.cache_dtype),
                        devices=self.layout.data_devices)
    except MemoryError as e:
      raise ConfigError(f"a partial rollout's round (rollout.decode_budget={r.decode_budget}) cannot run: "
                        f"{e}; or set rollout.decode_budget=0") from None

  def _partial_rollout(self, state: TrainState, prompts: PromptIterator, key: jax.Array, *,
                       version: int) -> "Sampled":
    del key  # Partial rollouts sample each run sequence from its own key (`BudgetedRollout.key`).
    return Sampled(*self.partial.sample(state, prompts, version=version))

  def _whole_rollout(self, state: TrainState, prompts: PromptIterator, key: jax.Array, *,
                     version: int) -> "Sampled":
    del version
    return self.sample(state, prompts, key)

  def policy(self, state: TrainState) -> nnx.Module:
    """The actor in the rollout layout: a resharded copy (with `rollout.tensor_parallel` > 1), to drop
    once generation is done."""
    return nnx.merge(self.steps.actor_def, self.layout.reshard(state.actor))

  def plan_for(self, *, prompts: int, samples_per_prompt: int, prompt_tokens: int,
               **options) -> rollout.RolloutPlan:
    """`plan` for a rollout call of this run (its data-parallel devices)."""
    return plan(self.config, self.model_cfg, prompts=prompts, samples_per_prompt=samples_per_prompt,
                prompt_tokens=prompt_tokens, devices=self.layout.data_devices, **options)

  def sampling_for(self, *, temperature: float, top_p: float, top_k: int = 0) -> common.Sampling:
    return sampling_settings(self.config, stop_ids(self.config, self.tokenizer), temperature=temperature,
                             top_p=top_p,
                    top_k=top_k)

  def generate_in_layout(self, policy: nnx.Module, records: list[Record], key: jax.Array, *,
                         samples_per_prompt: int, temperature: float, top_p: float,
                         top_k: int = 0) -> tuple[common.Rollout, dict[str, float]]:
    """`generate_responses` with `policy` (from `self.policy`) in the rollout layout; the rollout comes back
    as global arrays laid out for scoring on the training mesh."""
    out, stats = generate_responses(policy, records, key, config=self.config, tokenizer=self.tokenizer,
                                    samples_per_prompt=samples_per_prompt,
                                    temperature=temperature, top_p=top_p, top_k=top_k, jit=self.layout.jit,
                                    place=self.layout.place, devices=self.layout.data_devices)
    return self.layout.to_training(out), stats

  def check_cache_budget(self, eval_problems: int = 0) -> list[rollout.RolloutPlan]:
    """At start-up: every rollout of the run, with the longest prompts allowed, is one its engine runs (its KV
    cache fits, its slots split over the groups, its pool holds its prompts): the training rollout's, each
    call of the held-out evaluation of `eval_problems` problems, and a partial rollout's round. Returns their
    plans; else a `ConfigError` naming the setting."""
    settings, evaluation = self.config.rollout, self.config.eval
    calls = [(settings.prompts_per_step, settings.samples_per_prompt)] + [  # The training rollout's first.
        (problems, evaluation.samples_per_problem) for problems in held_out.evaluation_calls(self.config,
                                                                                    eval_problems)]
    plans = [self.plan_for(prompts=prompts, samples_per_prompt=samples_per_prompt,
                           prompt_tokens=common.prompt_bucket(settings.max_prompt_tokens))
             for prompts, samples_per_prompt in dict.fromkeys(calls)]
    if self.partial is not None:  # A partial rollout's round: one sequence per prompt, the carried tokens in it.
      plans.append(self.partial.context.plan)
    return plans

  def verify(self, out: common.Rollout, answers: list[str]) -> reward_lib.RewardBatch:
    """Verifier rewards of this process's share of the responses (a host transfer of their token ids
    and lengths); with several processes the per-response fields are this process's rows only and
    the metrics are combined over processes."""
    share, tokens = distributed.local_rows(out.response_tokens)
    _, lengths = distributed.local_rows(out.response_lengths)
    return self._score([self.tokenizer.decode(t[:k]) for t, k in zip(tokens, lengths)], answers[share],
                       lengths)

  def prefix_labels(self, out: common.Rollout, answers: list[str], rng: np.random.Generator) -> PrefixLabels:
    """Value pretraining's prefix labels (`algo.value_pretrain_target="prefix"`) of this process's share of
    the responses: `algo.value_pretrain_prefixes` lengths k each, uniform over 1 ≤ k < l (`rng`; k = l for
    a one-token response), each prefix verified as if it were the whole response (the reward it would
    get had it ended there: no answer yet is the incorrect reward), as global arrays `[B, K]` laid out
    like the rollout's rows. Host transfers: the token ids and lengths of the share, as `verify`."""
    share, tokens = distributed.local_rows(out.response_tokens)
    _, lengths = distributed.local_rows(out.response_lengths)
    count, lengths = self.config.algo.value_pretrain_prefixes, np.maximum(lengths.astype(np.int64), 1)
    drawn = rng.integers(1, np.maximum(lengths, 2)[:, None], (len(lengths), count))
    cut = np.where(lengths[:, None] > 1, drawn, lengths[:, None]).astype(np.int32)
    texts = [self.tokenizer.decode(t[:k]) for t, ks in zip(tokens, cut) for k in ks]
    scored = self._score(texts, np.repeat(np.asarray(answers, dtype=object)[share], count), cut.reshape(-1))
    n, sharding = out.response_lengths.shape[0], out.response_lengths.sharding
    place = lambda x: distributed.global_array_from_share(x, sharding, n)
    return PrefixLabels(place(cut), place(scored.rewards.astype(np.float32).reshape(cut.shape)))

  def _score(self, texts: list[str], answers, lengths: np.ndarray) -> reward_lib.RewardBatch:
    """The verifier's rewards of `texts` (this process's) against `answers`, combined metrics, errors checked."""
    config = self.config
    scored = reward_lib.compute_rewards(
        self.pool, texts, list(answers), lengths, correct_reward=config.reward.correct,
        incorrect_reward=config.reward.incorrect, forms=config.reward.answer_forms,
        max_response_tokens=config.rollout.max_response_tokens,
        overlong_buffer_tokens=config.algo.overlong_buffer_tokens,
        overlong_penalty_factor=config.algo.overlong_penalty_factor,
        format_penalty_value=config.reward.format_penalty)
    scored = scored._replace(metrics=distributed.combine_metrics(scored.metrics))
    reward_lib.check_errors(scored, self.pool,
                            max_error_frac=config.reward.max_error_frac)  # Every process agrees.
    return scored

  def sample(self, state: TrainState, prompts: PromptIterator, key: jax.Array, *,
             prefix_step: int | None = None) -> Sampled:
    """A verified whole rollout of P prompts × G samples, the rewards and verdicts as global arrays (an RL
    step's under `rl_rollout`, which may be partial). Under dynamic sampling, refilled with groups of mixed
    verdicts. `prefix_step`: a value-pretraining step (the run's global step), whose "prefix" target (if it is
    the target) needs the prefix labels (`prefix_labels`)."""
    config, settings = self.config, self.config.rollout
    samples_per_prompt, policy = settings.samples_per_prompt, self.policy(state)  # One set of weights for the step.
    rng = prefix_rng(config.seed, prefix_step) if (
        prefix_step is not None and config.algo.value_pretrain_target == "prefix") else None
    labels = lambda out, answers: None if rng is None else self.prefix_labels(out, answers, rng)
    if not config.algo.dynamic_sampling:
      records, out, scored, generated = self._sample_round(policy, prompts, key)
      del policy  # The rollout copy (tensor_parallel > 1) is dropped: its memory is free for scoring.
      rewards, correct = self.place_share(scored, out)
      return Sampled(out, rewards, correct, generated | scored.metrics | {"rollout/sampling_rounds": 1.0},
                     labels(out, [x.answer for x in records for _ in range(samples_per_prompt)]))
    kept, spare, parts, answers, rounds, rollout_s, verified = [], [], [], [], 0, 0.0, []
    while True:
      key, sample_key = jax.random.split(key)
      records, out, scored, generated = self._sample_round(policy, prompts, sample_key)
      answers += [x.answer for x in records for _ in range(samples_per_prompt)]
      rollout_s += generated["time/rollout_s"]
      correct = distributed.gather_rows(scored.correct).reshape(len(records), samples_per_prompt)
      rewards = distributed.gather_rows(scored.rewards).reshape(len(records), samples_per_prompt)
      verified.append((rewards.size, float(rewards.sum()), scored.metrics))
      offset = sum(len(p[0].response_lengths) for p in parts)
      parts.append((out, rewards, correct))
      for p, accuracy in enumerate(correct.mean(axis=1)):
        (kept if 0 < accuracy < 1 else spare).append(offset // samples_per_prompt + p)
      rounds += 1
      if len(kept) >= settings.prompts_per_step or rounds > config.algo.dynamic_sampling_max_rounds:
        break
    del policy  # As above.
    if len(kept) < settings.prompts_per_step:
      message = (f"dynamic sampling found {len(kept)} groups with mixed verdicts of the "
                 f"{settings.prompts_per_step} a step needs in {rounds} rounds "
                 "(algo.dynamic_sampling_max_rounds="
                 f"{config.algo.dynamic_sampling_max_rounds}); {settings.prompts_per_step - len(kept)} "
                 "groups of all-equal verdicts (zero advantage) fill the batch")
      if config.algo.dynamic_sampling_on_cap == "raise":
        raise DynamicSamplingCapReached(message + ". Raise the cap, or set algo.dynamic_sampling_on_cap=warn")
      warnings.warn(message, stacklevel=2)
    groups = np.asarray((kept + spare)[:settings.prompts_per_step])
    rows = (groups[:, None] * samples_per_prompt + np.arange(samples_per_prompt)).reshape(-1)
    out = _concat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    out = _take_rows(out, self.steps.place(rows.astype(np.int32)))
    rewards, correct = (self.steps.place(np.concatenate([p[i] for p in parts]).reshape(-1)[rows]) for i in (1,
                                                                                                            2))
    stats = generated | verifier_rounds(verified) | {
        "time/rollout_s": rollout_s, "rollout/sampling_rounds": float(rounds),
        "rollout/mixed_group_frac": min(len(kept), len(groups)) / len(groups),
        "rollout/unmixed_groups": float(max(0, len(groups) - len(kept)))}
    return Sampled(out, rewards, correct, stats, labels(out, [answers[r] for r in rows]))

  def _sample_round(self, policy: nnx.Module, prompts: PromptIterator, key: jax.Array):
    """One round of sampling: the next P prompts, G responses to each with the training sampling
    settings, verified: (records, rollout, verifier's `RewardBatch`, rollout metrics)."""
    settings = self.config.rollout
    records = next(prompts)
    out, generated = self.generate_in_layout(policy, records, key,
                                             samples_per_prompt=settings.samples_per_prompt,
                                             temperature=settings.temperature, top_p=settings.top_p,
                                             top_k=settings.top_k)
    scored = self.verify(out, [x.answer for x in records for _ in range(settings.samples_per_prompt)])
    return records, out, scored, generated

  def place_share(self, scored: reward_lib.RewardBatch, out: common.Rollout):
    """This process's rewards and verdicts as global arrays laid out like the rollout's rows."""
    n = out.response_lengths.shape[0]
    place = lambda x: distributed.global_array_from_share(np.asarray(x), out.response_lengths.sharding, n)
    return place(scored.rewards.astype(np.float32)), place(scored.correct.astype(bool))


@jax.jit
def _concat(parts: list[common.Rollout]) -> common.Rollout:
  """Rollouts concatenated along the batch, prompts left-padded to the widest."""
  width = max(p.prompt_tokens.shape[1] for p in parts)
  pad = lambda x: jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))
  parts = [p._replace(prompt_tokens=pad(p.prompt_tokens), prompt_mask=pad(p.prompt_mask)) for p in parts]
  return common.Rollout(*(jnp.concatenate(fields) for fields in zip(*parts)))


@jax.jit
def _take_rows(tree, rows):
  return jax.tree.map(lambda x: x[rows], tree)
