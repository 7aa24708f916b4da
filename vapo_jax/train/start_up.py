"""The start-up check that runs, not only compiles: each rollout engine of the run executed once on a minimal
batch.

  start_up.run_rollouts(experience, state, plans)     # plans: `Experience.check_cache_budget`'s

The compile report and the memory verdict lower the rollout's programs from inputs they build; a run calls
them with its own (the actor resharded into the rollout layout, a key split on the training mesh). With
`rollout.tensor_parallel` > 1 the rollout decodes on a mesh of its own, and an input laid out for the wrong
one is an error only when a program runs. So before the first stage, each engine the run's plans use (static,
refill, a partial rollout's round) samples one token of one prompt, every input placed by
`RolloutLayout.place` as every call's is, and its rollout goes back to the training mesh. A failure is one
line naming the engine and the error, before the warm start, not a traceback after it. With
`rollout.tensor_parallel` 1 and the model's weights the rollout runs on the training mesh with the training's
placement and parameters, and nothing is run (int8 weights, `rollout.weight_dtype`, are a copy: checked).

Its cost is the minimal programs' compilation (one prompt, one slot, a one-token cap: seconds for the smoke
model on a CPU, a few minutes at 64 layers on a pod, where the run's own programs take as long again) and a
reshard of the actor.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import rollout
from vapo_jax.errors import ConfigError
from vapo_jax.rollout import common, partial
from vapo_jax.train.state import TrainState


def run_rollouts(experience, state: TrainState, plans: list[rollout.RolloutPlan]) -> list[str]:
  """Each engine of `plans` run once on one prompt for one token with `experience`'s actor, key, layout and
  placement (module docstring); returns the engines run. A failure is a `ConfigError` of one line."""
  if not experience.layout.copies:
    return []
  engines = sorted({plan.engine for plan in plans} | ({"round"} if experience.partial is not None else set()))
  policy = experience.policy(state)
  for engine in engines:
    try:
      _run_one(experience, policy, state.key, engine)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001  (any failure: said in one line, before the first stage)
      text = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise ConfigError(
          f"start-up check: the {engine} rollout failed on one prompt in the rollout layout "
          f"(rollout.tensor_parallel={experience.layout.tensor_parallel}): {type(e).__name__}: {text}. "
          "Nothing was trained; rollout.tensor_"
          "parallel=1 decodes in the training layout instead") from None
  return engines


def _run_one(experience, policy, key: jax.Array, engine: str) -> None:
  """One prompt, one token, with `engine` ("static", "refill", or "round": a partial rollout's refill call)."""
  config, layout, tokenizer = experience.config, experience.layout, experience.tokenizer
  one = dataclasses.replace(config.rollout, max_response_tokens=1, slots=None, pages=None,
                            prompts_per_generation=None,
                            engine="static" if engine == "static" else "refill", decode_budget=0)
  width = common.prompt_bucket(1)
  plan = rollout.plan_rollout(one, experience.model_cfg, prompts=1, samples_per_prompt=1, prompt_tokens=width,
                              dtype=jnp.dtype(config.cache_dtype), devices=layout.data_devices,
                              budgeted=engine != "static")
  r = config.rollout
  sampling = common.Sampling(max_response_tokens=1, stop_token_ids=(), temperature=r.temperature,
                             top_p=r.top_p, top_k=r.top_k)
  tokens = np.full((1, width), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((1, width), bool)
  mask[0, -1] = True
  cache_dtype = jnp.dtype(config.cache_dtype)
  if engine == "round":
    call = partial.Call(np.zeros(1, np.int64), tokens, mask, np.zeros(1, np.int32), np.zeros(1, np.int32),
                        np.ones(1, np.int32))
    partial.decode_round(policy, call, key, plan=plan, sampling=sampling, budget=1,
                         pad_id=tokenizer.pad_token_id,
                         cache_dtype=cache_dtype, jit=layout.jit, place=layout.place)
    return
  out, _ = rollout.sample(policy, tokens, mask, key, sampling=sampling, plan=plan,
                          pad_id=tokenizer.pad_token_id,
                          cache_dtype=cache_dtype, jit=layout.jit, place=layout.place)
  jax.block_until_ready(layout.to_training(out))
