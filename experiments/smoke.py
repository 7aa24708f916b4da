"""`smoke(config)`: any experiment rehearsed at smoke-test size, for tests and a first look on a laptop.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m vapo_jax.cli.train --exp aime --smoke

Small numbers, the experiment's own choices (big_vision's `runlocal`, for any config, with MaxText's habit of
running the big config in miniature). A one-layer model from random weights, the byte tokenizer, synthetic
arithmetic, 32 sequences of 16-token responses a step, at most two steps of each stage the experiment has (and
a held-out evaluation where it has one). Every choice that selects code is the full run's:

  mesh       its preset, the axes shrunk to the devices present (`fsdp_tp` stays `fsdp_tp`: tensor 2, FSDP
             filling the rest); packed micro-batches of one row per data-parallel device, fewer than the mesh's
             devices wherever the full run's are
  model      scanned layers or not, remat, the attention kernel
  rollout    the tensor-parallel groups (of 2), the engine the full run's plan picks (`plan.engine`), its
             queues one per data-parallel group where the full run's are, a pool that can run out of pages
             (preempting) where the full run's can, in the same share of its slots; a decode budget in
             proportion to the cap
  algorithm  as is: the critic or its absence, dynamic sampling, every technique

Sized for 8 devices (a pool's pages are per data-parallel group), it runs on any count the mesh splits.
`rehearsal_table` prints each choice with the full run's value and the rehearsal's (`--smoke` prints it).
"""

import dataclasses
import math
import warnings

from vapo_jax.config import ExperimentConfig
from vapo_jax.models.config import preset

TRAIN = "synthetic:arithmetic?terms=2-3&count=200&seed=0"
EVAL = "synthetic:arithmetic?terms=2-3&count=8&seed=1"
SFT = "synthetic:arithmetic?terms=2-3&count=50&seed=2"
DEVICES = 8  # The rehearsal's devices (tests: 8 virtual CPU devices), which a pool's pages are sized for.
SEQUENCES = 32  # Sequences of a step (prompts × samples).
PROMPT_TOKENS = RESPONSE_TOKENS = 16
PAGE_TOKENS = 4  # A refill pool's page: a response spans 4 pages, so pages run out as in the full run.
MODEL = "micro"
# Overrides of these fields shape the full run that the smoke shrinks (`cli/resolve.py`), and are not applied
# again: the smoke derives its own from them.
DERIVED = ("rollout.decode_budget",)


def smoke(config: ExperimentConfig) -> ExperimentConfig:
  """`config` shrunk to run in seconds on a CPU, keeping every choice that selects code (module docstring)."""
  replace = dataclasses.replace
  samples_per_prompt = 4 if config.rollout.samples_per_prompt > 1 else 1
  tensor_parallel = math.gcd(config.rollout.tensor_parallel, preset(MODEL).num_kv_heads)
  rollout = replace(config.rollout, prompts_per_step=SEQUENCES // samples_per_prompt,
                    samples_per_prompt=samples_per_prompt,
                    max_prompt_tokens=PROMPT_TOKENS, max_response_tokens=RESPONSE_TOKENS,
                    prompts_per_generation=None, tensor_parallel=tensor_parallel, slots=None, pages=None,
                    page_tokens=None, decode_budget=_budget(config.rollout))
  rollout = replace(rollout, **_pool(config, rollout))
  return replace(
      config, rl_steps=min(config.rl_steps, 2),
      model=replace(config.model, preset=MODEL, dtype="float32", tokenizer="bytes", random_init=True,
                    checkpoint=None, critic_checkpoint=None),
      algo=replace(config.algo, value_pretrain_steps=min(config.algo.value_pretrain_steps, 1),
                   mini_batch_responses=16, micro_batch_responses=None,
                   dynamic_sampling_max_rounds=min(config.algo.dynamic_sampling_max_rounds, 1),
                   overlong_buffer_tokens=min(config.algo.overlong_buffer_tokens, 4)),
      optim=replace(config.optim, actor_lr=1e-3, critic_lr=3e-3, warmup_updates=0, weight_decay=0.0),
      rollout=rollout,
      packing=replace(config.packing, micro_batch_rows=None),  # One row per data-parallel device.
      reward=replace(config.reward, answer_forms=("answer_line",), verifier_workers=1),
      data=replace(config.data, train_path=TRAIN, template="raw", chat_template=False),
      eval=replace(config.eval, path=EVAL if config.eval.path else None, samples_per_problem=2, every_steps=0,
                   max_problems=None),
      sft=replace(config.sft, path=SFT, steps=min(config.sft.steps, 2), batch_size=8, lr=1e-3),
      mesh=replace(config.mesh, device_memory_gib=None, **_mesh(config.mesh)))


def _mesh(mesh) -> dict:
  """The preset's axes shrunk: tensor parallelism in pairs (the micro model's KV heads), FSDP or data parallelism
  over the devices left."""
  tensor = min(mesh.tensor, 2) if mesh.tensor != 1 else 1
  if mesh.fsdp != 1:
    return dict(data=1, fsdp=-1, tensor=tensor)
  return dict(data=-1, fsdp=1, tensor=tensor)


def _budget(r) -> int:
  """A decode budget in the full run's proportion to the cap, that a restarted response can still finish within
  `max_staleness` + 1 rounds; 0 without one."""
  if not r.decode_budget:
    return 0
  return max(-(-RESPONSE_TOKENS * r.decode_budget // r.max_response_tokens),
             -(-RESPONSE_TOKENS // (r.max_staleness + 1)))


def _pool(config: ExperimentConfig, small) -> dict:
  """The rehearsal's slots and pages: the refill engine where the full run's plan runs it, as many slots per
  sequence, and a pool that holds the same share of its slots at the cap (fewer than all: it preempts) where the
  full run's does, and fewer than all even where every prompt fills one page (its pages are sized for
  PROMPT_TOKENS, the rehearsal's prompts fill fewer: at an int8 cache's share, 0.67 of `aime_ppo`'s slots, a pool
  sized for full prompts held every sequence of a group and never ran out); nothing (the static engine, sized as
  configured) where the full run's plan is static."""
  with warnings.catch_warnings():  # The full run's kernel choice is said when it plans, not in its rehearsal.
    warnings.simplefilter("ignore")
    full = plans(config, devices=None, platform="tpu")["rollout"]
  if isinstance(full, str) or full.engine != "refill":
    return {}
  groups = DEVICES // small.tensor_parallel
  per_group = SEQUENCES // groups
  slots = max(groups, round(SEQUENCES * full.slots / full.sequences / groups) * groups)
  prompt_pages = -(-small.prompts_per_step // groups) * -(-PROMPT_TOKENS // PAGE_TOKENS)
  sequence_pages = -(-RESPONSE_TOKENS // PAGE_TOKENS) + 1
  share = full.pool_share if full.preempts else 1.0
  held = min(slots // groups, per_group) * share
  if full.preempts:  # Pages the group's prompts leave free when each fills one, and one more: a sequence fewer.
    prompts = -(-small.prompts_per_step // groups)
    held = min(held, per_group - -(-(prompt_pages - prompts + 1) // sequence_pages))
  return dict(slots=slots, page_tokens=PAGE_TOKENS,
              pages=prompt_pages + sequence_pages * max(1,
                                                        math.floor(held) if full.preempts else math.ceil(held)))


def plans(config: ExperimentConfig, *, devices: int | None, platform: str) -> dict:
  """The plans of `config`'s rollouts (`rollout.plan_rollout`): the training rollout's ("rollout") and, under a
  decode budget, a partial round's ("round"), over `devices` data-parallel groups (None: the mesh's devices over
  `rollout.tensor_parallel`, or `DEVICES`' where the mesh fills the devices) on `platform`. A plan that cannot
  run is its error's text."""
  import jax.numpy as jnp

  from vapo_jax.rollout import common
  from vapo_jax.rollout.plan import plan_round
  from vapo_jax.train import build, responses

  r, mesh = config.rollout, config.mesh
  if devices is None:
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    devices = (math.prod(sizes) if -1 not in sizes else DEVICES) // r.tensor_parallel
  try:
    model_cfg = build.model_configs(config)[0]
  except Exception as e:  # noqa: BLE001  (an unreadable checkpoint: said in the table, planned for nothing)
    return {"rollout": f"{type(e).__name__}: {e}"}
  calls = {"rollout": lambda: responses.plan(config, model_cfg, prompts=r.prompts_per_step,
                                              samples_per_prompt=r.samples_per_prompt, devices=devices,
                                             platform=platform,
                                              prompt_tokens=common.prompt_bucket(r.max_prompt_tokens))}
  if r.decode_budget:
    calls["round"] = lambda: plan_round(r, model_cfg, dtype=jnp.dtype(config.cache_dtype), devices=devices,
                                        platform=platform)
  out = {}
  for name, call in calls.items():
    try:
      out[name] = call()
    except Exception as e:  # noqa: BLE001  (a plan that cannot run: said in the table)
      out[name] = f"{type(e).__name__}: {e}"
  return out


def choices(config: ExperimentConfig, *, devices: int | None = None, platform: str = "tpu") -> dict[str, str]:
  """Each choice that selects code, by name, with its value in `config` (and its plans on `devices`)."""
  m, r, a = config.mesh, config.rollout, config.algo
  out = {"mesh": f"{m.preset} (data {m.data}, fsdp {m.fsdp}, tensor {m.tensor})",
         "micro-batch rows": str(config.packing.micro_batch_rows or "one per data-parallel device"),
         "layers": f"{'scanned' if config.model.scan_layers else 'unrolled'}, remat {config.model.remat}",
         "rollout groups": f"tensor_parallel {r.tensor_parallel}",
         "decode budget": f"{r.decode_budget} (max_staleness {r.max_staleness})" if r.decode_budget else "off",
         "critic": "yes" if a.uses_critic else "no",
         "dynamic sampling": "yes" if a.dynamic_sampling else "no"}
  for name, plan in plans(config, devices=devices, platform=platform).items():
    out[f"{name}: engine"] = plan if isinstance(plan, str) else _plan_text(plan)
  return out


def _plan_text(plan) -> str:
  if plan.engine == "static":
    return f"static, {plan.rounds} round(s) of {plan.prompts_per_round} prompts"
  return (f"refill, {plan.queues} queue(s) of {plan.devices} group(s), {plan.slots} slots, "
          + (f"preempts (the pool holds {plan.pool_share:.0%} of its slots at the cap)" if plan.preempts
             else "never preempts"))


def rehearsal_table(full: ExperimentConfig, small: ExperimentConfig, *, devices: int, platform: str) -> str:
  """One table: each choice, the full run's value and the rehearsal's (`small` over `devices` data-parallel
  groups on `platform`)."""
  a, b = choices(full), choices(small, devices=devices, platform=platform)
  width = max(map(len, a))
  rows = [f"  {name:<{width}}  {a.get(name, '-')}\n  {'':<{width}}  rehearsal: {b.get(name, '-')}"
          for name in dict.fromkeys([*a, *b])]
  return "\n".join([f"rehearsal of {full.name} ({small.model.preset} model, "
                    f"{small.rollout.responses_per_step} "
                    f"sequences a step): each choice, the full run's, then the rehearsal's", *rows])
