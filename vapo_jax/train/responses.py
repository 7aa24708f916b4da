"""Problems → sampled responses for a config, inside a run or outside one: its rollout plan and sampling, the
tokens that end a response, and the supervised warm start's batch of demonstrations.

  plan(config, model_cfg, prompts=P, samples_per_prompt=G, prompt_tokens=Tp, devices=D)  # ConfigError: cannot fit
  out, metrics = generate_responses(model, records, key, config=config, tokenizer=tokenizer, samples_per_prompt=G, ...)

`generate_responses` is the one path from problems to sampled responses: the trainer's rollouts, its
held-out evaluation and `make eval` all call it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import rollout
from vapo_jax.config import ExperimentConfig
from vapo_jax.data import problems
from vapo_jax.data.records import Record
from vapo_jax.errors import ConfigError, DataError
from vapo_jax.rollout import common
from vapo_jax.train.steps import TrainBatch


def stop_ids(config: ExperimentConfig, tokenizer) -> tuple[int, ...]:
  """The tokens that end a response: the tokenizer's EOS and `rollout.stop_token_ids`."""
  return tuple(sorted({tokenizer.eos_token_id, *config.rollout.stop_token_ids}))


def plan(config: ExperimentConfig, model_cfg, *, prompts: int, samples_per_prompt: int, prompt_tokens: int,
         devices: int, **options) -> rollout.RolloutPlan:
  """The rollout plan (`rollout.plan_rollout`) for `prompts` × `samples_per_prompt` sequences of `prompt_tokens`-token
  prompts split over `devices` data-parallel devices; a KV cache that does not fit
  `rollout.kv_cache_budget_gib` per device is a `ConfigError` naming what to change. `options`:
  `plan_rollout`'s (`prompt_lengths`, `platform`)."""
  try:
    return rollout.plan_rollout(config.rollout, model_cfg, prompts=prompts,
                                samples_per_prompt=samples_per_prompt, prompt_tokens=prompt_tokens,
                                dtype=jnp.dtype(config.cache_dtype), devices=devices, **options)
  except MemoryError as e:
    raise ConfigError(str(e)) from None


def generate_responses(model, records: list[Record], key: jax.Array, *, config: ExperimentConfig, tokenizer,
                       samples_per_prompt: int, temperature: float, top_p: float, top_k: int = 0, jit=jax.jit,
                       place=None, devices: int = 1) -> tuple[common.Rollout, dict[str, float]]:
  """`samples_per_prompt` sampled responses for each record's prompt (B = len(records)·group; sequence n draws from
  fold_in(key, n) whatever the engine) and the rollout's metrics, with the configured engine.
  `jit`, `place` and `devices`: a run's mesh (`Steps.jit`, `Steps.place`, its data-parallel devices);
  the defaults run on the default device."""
  tokens, mask = common.pad_prompts([problems.encode_prompt(x, tokenizer, config) for x in records],
                                    pad_id=tokenizer.pad_token_id)
  chosen = plan(config, model.cfg, prompts=len(records), samples_per_prompt=samples_per_prompt,
                prompt_tokens=tokens.shape[1], devices=devices, prompt_lengths=mask.sum(axis=1))
  how = sampling_settings(config, stop_ids(config, tokenizer), temperature=temperature, top_p=top_p,
                          top_k=top_k)
  return rollout.sample(model, tokens, mask, key, sampling=how, plan=chosen, pad_id=tokenizer.pad_token_id,
                        cache_dtype=jnp.dtype(config.cache_dtype), jit=jit, place=place)


def sampling_settings(config: ExperimentConfig, stop_token_ids: tuple[int, ...], *, temperature: float,
                      top_p: float,
             top_k: int = 0) -> common.Sampling:
  """How a rollout of the run samples (`stop_ids`: the tokens that end a response)."""
  return common.Sampling(max_response_tokens=config.rollout.max_response_tokens,
                         stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k)


def demonstrations(rows: list[Record], tokenizer, config: ExperimentConfig) -> TrainBatch:
  """The supervised warm start's host batch: each row's prompt, then its solution and EOS (cut at
  `rollout.max_response_tokens`), as a `TrainBatch` of tokens, attention and response masks."""
  eos, length, pad = tokenizer.eos_token_id, config.rollout.max_response_tokens, tokenizer.pad_token_id
  prompt_tokens, prompt_mask = common.pad_prompts([problems.encode_prompt(r, tokenizer,
                                                                          config) for r in rows],
                                                  pad_id=pad)
  response = np.full((len(rows), length), pad, np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for b, row in enumerate(rows):
    ids = (tokenizer.encode(row.solution) + [eos])[:length]
    response[b, :len(ids)], lengths[b] = ids, len(ids)
  response_mask = np.arange(length)[None] < lengths[:, None]
  tokens, attention = (np.concatenate(x, axis=1) for x in ((prompt_tokens, response),
                                                           (prompt_mask, response_mask)))
  return TrainBatch(tokens, attention, response_mask, None, None, np.zeros(len(rows), bool))


def demonstration_rows(config: ExperimentConfig, tokenizer, held_out: list[Record], *, say) -> list[Record]:
  """The warm start's demonstrations (`sft.path` rows with a `solution`), less the `held_out` problems if
  `data.drop_eval_overlap` drops them (`say`: where the count dropped is said): read at start-up, so that a
  file the warm start cannot use is refused before anything is built."""
  rows = problems.training_problems(config, tokenizer, held_out, path=config.sft.path, dedup=False,
                                    noun="demonstrations", say=say)
  missing = [r.id for r in rows if r.solution is None]
  if missing:
    raise DataError(f"{config.sft.path}: supervised warm start needs a 'solution' (or 'response') field on "
                    f"every row; {len(missing)} of {len(rows)} have none, e.g. id {missing[0]!r}")
  return rows
