"""The compile report's rollout phases: the actor's reshard into the rollout layout, the training rollout as
its `RolloutPlan` runs it, and a partial rollout's round (`rollout.decode_budget`), each program on abstract
inputs as `Experience.sample` calls it."""

import jax
import jax.numpy as jnp
from flax import nnx

from vapo_jax.config import ExperimentConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory.aot import chip_bytes
from vapo_jax.memory.phases import CompiledPhase, add
from vapo_jax.models import sharding
from vapo_jax.rollout import common
from vapo_jax.rollout.plan import RolloutPlan, plan_round
from vapo_jax.rollout.refill import engine as refill
from vapo_jax.rollout.refill.resumed import Resumed
from vapo_jax.train import responses

PAD_ID = 0  # A constant of the rollout programs: the tokenizer's pad id changes nothing compiled.


def stop_ids(config: ExperimentConfig) -> tuple[int, ...]:
  """`responses.stop_ids` (the tokenizer's EOS when the config names a tokenizer; a constant of the
  programs, not a size)."""
  from vapo_jax.data import tokenizer as tok_lib
  name = config.model.tokenizer or config.model.checkpoint
  return responses.stop_ids(config,
                             tok_lib.load(name)) if name else tuple(sorted(set(config.rollout.stop_token_ids)))


def reshard(run, log) -> CompiledPhase:
  """`RolloutLayout.reshard`'s programs, one per kind of array: at the last, the training state and the
  whole rollout copy are held, with one array in flight."""
  state = run.state("rl")
  copy, kinds = run.layout.abstract_copy(state.actor), run.layout.reshard_programs(state.actor)
  phase = CompiledPhase("reshard", f"the actor's {len(jax.tree.leaves(state.actor))} arrays into the rollout "
                           f"layout (tensor_parallel={run.layout.tensor_parallel}, "
                           f"{run.layout.compute_dtype.name}"
                           f"{', int8 layer kernels' if run.layout.weight_dtype == 'int8' else ''}) by "
                           f"{len(kinds)} programs")
  held = chip_bytes(state) + chip_bytes(copy)
  for program, x in kinds:
    add(phase, log, f"reshard {x.dtype.name}{list(x.shape)}", program, (x,), resident=held - chip_bytes(x),
         fallback=run.decoding, outputs_resident=True)  # Its output is one of the copy's arrays.
  return phase


def rollout(run, log) -> tuple[CompiledPhase, common.Rollout]:
  """The programs of the training rollout's plan (`plan.programs`), as `Experience.sample` calls them: the
  actor's rollout copy (the actor itself with tensor_parallel 1) decoding on the rollout mesh."""
  c, layout = run.config, run.layout
  prompts, samples_per_prompt = c.rollout.prompts_per_step, c.rollout.samples_per_prompt
  tp = common.prompt_bucket(c.rollout.max_prompt_tokens)
  with sharding.use_rules(layout.mesh, layout.rules):  # The engine's defaults are the target platform's.
    run.plan = plan = responses.plan(c, run.full_cfg, prompts=prompts, samples_per_prompt=samples_per_prompt,
                                     prompt_tokens=tp,
                                      devices=layout.data_devices)
  model, key, beside, programs = _decoding(run, plan)
  if plan.engine == "refill":
    phase = CompiledPhase("rollout", f"refill engine, {prompts} prompts x {samples_per_prompt} samples in "
                             f"{plan.slots} slots, {plan.queues} queue(s), "
                             f"tensor_parallel={layout.tensor_parallel}, "
                             f"{plan.queue_pages} pages of {plan.page_tokens} tokens per queue "
                             f"({plan.attention}), prefilled in "
                             f"{plan.lanes} lane(s) of {plan.prefill_chunk}-token chunks")
    tokens = (run.rows((prompts, tp), jnp.int32, rollout=True),
              run.rows((prompts, tp), jnp.bool_, rollout=True))
    out = _refill(run, phase, log, plan, programs, model, tokens, key, beside)
  else:
    out = _static(run, phase := CompiledPhase("rollout", ""), log, plan, programs(), model, key, beside)
  return phase, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=run.training(x.shape)),
                             out) \
      if layout.tensor_parallel > 1 else out  # RolloutLayout.to_training.


def _static(run, phase: CompiledPhase, log, plan: RolloutPlan, fn, model, key, beside: int) -> common.Rollout:
  """The static engine's generate: the first round's program, and the later rounds' (their offset passed)."""
  per_round, rounds, tp = plan.prompts_per_round, plan.rounds, plan.prompt_tokens
  samples_per_prompt = plan.samples_per_prompt
  phase.detail = (f"static engine, {rounds} round(s) of {per_round} prompts x {samples_per_prompt} samples, "
                  f"tensor_parallel={run.layout.tensor_parallel}")
  tokens = tuple(run.rows((per_round, tp), dtype, rollout=True) for dtype in (jnp.int32, jnp.bool_))
  out = add(phase, log, "generate", fn, (model, *tokens, key), resident=beside, fallback=run.decoding)
  if rounds > 1:  # Earlier rounds' rollouts are held until the last round ends.
    out = add(phase, log, "generate (later rounds)", fn,
              (model, *tokens, key, run.rows((), jnp.int32, rollout=True)),
               resident=beside + (rounds - 1) * chip_bytes(out), fallback=run.decoding)
    out = jax.tree.map(lambda x: run.rows((x.shape[0] * rounds,) + x.shape[1:], x.dtype, rollout=True), out)
  return out


def _refill(run, phase: CompiledPhase, log, plan: RolloutPlan, programs, model, tokens, key, beside: int,
            decode_args: tuple = (None,)) -> common.Rollout:
  """The refill engine's programs: start (the empty pool and slots), decode (the loop, its prefill chunks in
  it; its arguments after the key: `decode_args`), compaction (and with `tail`, decode at every slot count it
  shrinks through), finish."""
  fns = programs()
  slots = add(phase, log, "start", fns.start, (model, *tokens), resident=beside, fallback=run.decoding)
  held = beside + chip_bytes(tokens)
  slots, _ = add(phase, log, f"decode ({plan.slots} slots)", fns.decode, (model, slots, key, *decode_args),
                  resident=held, fallback=run.decoding)
  rows, sizes = plan.slots, plan.shrink_sizes
  for smaller in sizes if run.tail else sizes[:1]:
    slots = add(phase, log, f"compaction ({rows} -> {smaller} slots)",
                 refill.compaction(smaller, plan.queues, run.layout.jit), (slots,),
                 resident=held, fallback=run.decoding)
    if not run.tail:
      break
    fns, rows = programs(slots=smaller), smaller
    slots, _ = add(phase, log, f"decode ({smaller} slots)", fns.decode, (model, slots, key, *decode_args),
                    resident=held, fallback=run.decoding)
  if sizes and not run.tail:
    phase.skipped = (f"decode at {', '.join(map(str, sizes))} slots: not compiled (the tail; fewer slots "
                     f"than decode ({plan.slots} slots), the same program otherwise; tail=True / --tail "
                     "compiles them)")
  o = slots.outputs
  outputs = (o.tokens, o.sampler, o.policy, o.lengths, o.stopped)
  return add(phase, log, "finish", fns.finish, (*tokens, *outputs), fallback=run.decoding,
              resident=beside + chip_bytes(slots) - chip_bytes(outputs))


def _decoding(run, plan: RolloutPlan):
  """(the actor's rollout copy, the sampling key, the bytes held beside the copy, `plan.programs` at the run's
  sampling settings) of a rollout phase."""
  c, layout = run.config, run.layout
  sampling = responses.sampling_settings(c, stop_ids(c), temperature=c.rollout.temperature,
                                         top_p=c.rollout.top_p,
                                 top_k=c.rollout.top_k)
  actor_def, _, state = run.states["rl"]
  model = nnx.merge(actor_def, layout.abstract_copy(state.actor))
  beside = chip_bytes(state if layout.copies else state._replace(actor=None))  # Held beside the copy.
  key = layout.place(state.key)  # The trainer's key, replicated on the training mesh, placed as the trainer does.
  programs = lambda **slots: plan.programs(sampling=sampling, pad_id=PAD_ID,
                                           cache_dtype=jnp.dtype(c.cache_dtype), jit=layout.jit, **slots)
  return model, key, beside, programs


def partial_round(run, log) -> CompiledPhase:
  """A partial rollout's round (`train/budgeted_rollout.py`) as its plan (`plan.plan_round`) runs it: the
  refill engine over `plan.OVERPROVISION` × P·G sequences, one per prompt, each a problem's prompt followed by
  its carried tokens, in the slots of P·G, each admitted to pages and prefilled in chunks as it is about to
  run, the decode stopped at the budget (`refill.engine.decode`'s `resumed`)."""
  c, layout = run.config, run.layout
  with sharding.use_rules(layout.mesh, layout.rules):  # The engine's defaults are the target platform's.
    try:
      run.round = plan = plan_round(c.rollout, run.full_cfg, dtype=jnp.dtype(c.cache_dtype),
                                    devices=layout.data_devices)
    except MemoryError as e:
      raise ConfigError(f"a partial rollout's round (rollout.decode_budget={c.rollout.decode_budget}) cannot "
                        f"run: {e}; or set rollout.decode_budget=0") from None
  call, width = plan.prompts, plan.prompt_tokens
  phase = CompiledPhase("partial rollout", f"a round of {call} sequences of up to {width} prompt and carried "
                        f"tokens in {plan.slots} slots, {plan.queues} queue(s), {plan.queue_pages} pages of "
                        f"{plan.page_tokens} tokens per queue, prefilled in {plan.lanes} lane(s) of "
                        f"{plan.prefill_chunk}-token chunks, stopped at {c.rollout.decode_budget} decode "
                        "steps")
  model, key, beside, programs = _decoding(run, plan)
  rows = lambda shape, dtype: run.rows(shape, dtype, rollout=True)
  tokens = (rows((call, width), jnp.int32), rows((call, width), jnp.bool_))
  resumed = Resumed(rows((call,), jnp.int32), rows((call,), jnp.int32), rows((), jnp.int32))
  _refill(run, phase, log, plan, programs, model, tokens, key, beside,
          decode_args=(rows((call,), jnp.int32), resumed))
  return phase
