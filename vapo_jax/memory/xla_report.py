"""The compile report: every program a run executes, compiled ahead of time for a target, and what
each needs per device against the device's memory.

  report = xla_report.compile_run(config, topologies.named("v5p:8x8x4"))
  print(xla_report_text.table(report)); xla_report_text.refusal(report)   # each phase that does not fit

It builds the run's training mesh on the target's devices (in `sharding.tensor_groups` order, as the
trainer does), its rollout layout, and its `TrainState`, batches and rollout inputs as abstract
arrays (`build.abstract_state`: shapes, dtypes and shardings, nothing allocated), then lowers and
compiles, in the order of a run, the very programs the trainer calls (`aot.compile_program`):

  supervised warm start  `Steps.sft_program` (when `sft.steps` and `sft.path` are set)
  reshard                `RolloutLayout.reshard_programs`: the actor into the rollout layout, cast to
                         the compute dtype, one program per kind of array (`rollout.tensor_parallel` > 1)
  rollout                the programs of the training rollout's `RolloutPlan` as `rollout.sample` runs them
                         on the rollout mesh (`rollout/layout.py`; the training mesh with tensor_parallel 1):
                         the static engine's generate (the first round's, and the later rounds'), or the
                         refill engine's start (the prefill written into the pool's pages), its decode loop
                         over the paged KV cache, the compaction to fewer slots in the tail (and with
                         `tail=True` the decode loop at every slot count it shrinks through) and finish
  partial rollout        with `rollout.decode_budget`: a round's refill engine over its sequences, each a
                         prompt with its carried tokens, the decode stopped at the budget
                         (`rollout_phases.partial_round`)
  value pretraining      `Steps.score_program(critic_only=True)`, then `Steps.ppo_program` of the
                         critic alone (when the algorithm has a critic and `value_pretrain_steps`)
  scoring, update        `Steps.score_program`, `Steps.ppo_program` (critic and actor in one program)

With `packing.enabled` (the default) scoring, the updates and the warm start are compiled on packed
rows at the most rows a plan can give them (every sequence in a row of its own: all responses at the
cap), so the figures bound every step's; a run compiles fewer rows when its responses are shorter.

Each program's inputs are the outputs of the programs before it as compiled (a batch is laid out as the
scoring program leaves it), as in a run. A phase needs, per device, the largest of its programs' own bytes
(XLA's arguments + outputs − aliased + temporaries) plus what the run holds beside them (the `TrainState`
parts that are not arguments, the KV cache while the rollout finishes, ...). The device memory is the chip's
HBM as the TPU compiler counts it (`topologies.CHIPS`), or what a run's own device reports
(`topologies.here`), lowered to `mesh.device_memory_gib` when that is set; a CPU has none unless
`mesh.device_memory_gib` gives one. A phase may need (1 − `mesh.memory_margin`) of it (`Report.allowed`,
default 92 %): the rest is left to the runtime, fragmentation and the collectives' buffers, which no compiled
figure shows.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from vapo_jax.config import ExperimentConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import aot, rollout_phases, topologies, tpu_said
from vapo_jax.memory.aot import Program, chip_bytes, weight_elements
from vapo_jax.memory.phases import CompiledPhase, add
from vapo_jax.memory.topologies import GIB, Topology
from vapo_jax.models import sharding
from vapo_jax.rollout import common
from vapo_jax.rollout.layout import layout_for
from vapo_jax.rollout.plan import RolloutPlan
from vapo_jax.train import build
from vapo_jax.train.steps import Steps, TrainBatch


@dataclasses.dataclass(frozen=True)
class Report:
  """What every phase of a run needs per device on a target (see the module docstring)."""

  config: ExperimentConfig
  target: Topology
  mesh_shape: dict
  device_bytes: int | None  # The device memory; None: unknown (nothing is refused).
  phases: tuple[CompiledPhase, ...]
  weights: frozenset  # Element counts of the policy's weight matrices, whole, per device, and per layer.
  parameters: tuple[int, int]  # Of the policy and the critic, as compiled.
  architecture: object  # The policy's `TransformerConfig` as compiled (`layers` applied).
  layers: int | None  # Compiled with only this many decoder layers (None: all).
  plan: RolloutPlan | None = None  # The training rollout's plan, as compiled (None: not compiled).
  round: RolloutPlan | None = None  # A partial rollout's round's plan, as compiled (None: no budget, or not compiled).
  rollout_weights: int | None = None  # Bytes of the rollout's copy of the policy, whole (None: no copy).

  @property
  def refill(self) -> bool | None:
    """The rollout's engine: refill (True) or static (False); None: not compiled."""
    return None if self.plan is None else self.plan.engine == "refill"

  @property
  def decode_rows(self) -> int:
    """Rows its decode loop runs at first: the refill slots, or a static round's sequences."""
    return 0 if self.plan is None else self.plan.decode_rows

  @property
  def weight_bytes(self) -> int:
    """The policy's weights in the compute dtype, whole: what FSDP decoding gathers every step."""
    return self.parameters[0] * jnp.dtype(self.config.model.dtype).itemsize

  @property
  def decode_weight_bytes(self) -> int:
    """The weights the rollout decodes with, whole: its copy's bytes (int8 kernels with their scales, the
    rest in the compute dtype), or `weight_bytes` where it decodes from the parameters."""
    return self.weight_bytes if self.rollout_weights is None else self.rollout_weights

  @property
  def allowed(self) -> int | None:
    """Bytes per device a phase may need: (1 − `mesh.memory_margin`) of the device memory (None: unknown)."""
    return allowed_bytes(self.device_bytes, self.config.mesh.memory_margin)

  def over(self) -> list[CompiledPhase]:
    """The phases that need more than the device memory allows (`allowed`)."""
    return [p for p in self.phases if self.allowed is not None and p.needs > self.allowed]

  def program(self, name: str) -> Program:
    """The program of this name (the first, if several phases share it)."""
    return next(p for phase in self.phases for p in phase.programs if p.name == name)


class _Run:
  """A run's meshes, programs and abstract state on a target, built as the trainer builds them."""

  def __init__(self, config: ExperimentConfig, target: Topology, layers: int | None, tail: bool):
    m = config.mesh
    self.config, self.target, self.tail = config, target, tail
    self.plan = self.round = None  # The training rollout's plan and a partial round's: set as they compile.
    devices = sharding.tensor_groups(list(target.devices), config.rollout.tensor_parallel)
    self.mesh = sharding.make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, devices=devices)
    self.rules = sharding.rules(m.preset, collective_matmul=m.collective_matmul)
    self.full_cfg = build.model_configs(config)[0]  # The rollout engine sizes its slots for the whole model.
    self.layout = layout_for(config.rollout, self.mesh, compute_dtype=config.model.dtype,
                             training_rules=self.rules)
    self.layout.check_model(self.full_cfg)
    txs = build.optimizers(config)
    self.states = {stage: build.abstract_state(config, self.mesh, self.rules, txs, stage=stage, layers=layers)
                   for stage in ("sft", "value_pretrain", "rl")}
    actor_def, critic_def, _ = self.states["rl"]
    self.steps = Steps(config, self.mesh, self.rules, actor_def=actor_def, critic_def=critic_def,
                       actor_tx=txs["actor"], critic_tx=txs["critic"], sft_tx=txs["sft"])

  def state(self, stage: str):
    return self.states[stage][2]

  def training(self, shape) -> jax.sharding.NamedSharding:
    """Where `Steps.place` (and `RolloutLayout.to_training`) put a batch of `shape` on the training mesh."""
    return sharding.batch_sharding(shape, self.mesh, self.rules)

  def decoding(self, shape) -> jax.sharding.NamedSharding:
    """Where `RolloutLayout.place` puts a batch of `shape` on the rollout mesh."""
    return sharding.batch_sharding(shape, self.layout.mesh, self.layout.rules)

  def rows(self, shape, dtype, *, rollout: bool = False) -> jax.ShapeDtypeStruct:
    """A host array as the trainer places it: `Steps.place`, or for the rollout `RolloutLayout.place` (the one
    placement of a rollout program's inputs)."""
    return (self.layout.place if rollout else self.steps.place)(jax.ShapeDtypeStruct(shape, dtype))


def _packed(run: _Run, size: int, groups: int, samples_per_prompt: int) -> tuple[int | None,
                                                                                 jax.ShapeDtypeStruct | None]:
  """With `packing.enabled`: the most rows a plan compiles for `groups` groups of `samples_per_prompt` sequences
  (one sequence a row: every response at the cap; `packing.bucket_rows` of that) and the placement
  `[groups, 2, size]` as `Steps.plan_packing` leaves it. Padded: (None, None)."""
  rows = run.steps.largest_rows(samples_per_prompt)
  return rows, rows and jax.ShapeDtypeStruct((groups, 2, size), jnp.int32, sharding=run.steps.replicated)


def _supervised(run: _Run, log) -> CompiledPhase:
  c, state = run.config, run.state("sft")
  tp, tr, b = common.prompt_bucket(c.rollout.max_prompt_tokens), c.rollout.max_response_tokens, c.sft.batch_size
  batch = TrainBatch(run.rows((b, tp + tr), jnp.int32), run.rows((b, tp + tr), jnp.bool_),
                     run.rows((b, tr), jnp.bool_), None, None, run.rows((b,), jnp.bool_))
  phase = CompiledPhase("supervised warm start", f"{b} demonstrations of {tp} + {tr} tokens")
  rows, placement = _packed(run, b, 2, b)
  add(phase, log, "sft update", run.steps.sft_program(state, b, rows=rows), (state, batch, placement))
  return phase


def _scoring(run: _Run, phase: CompiledPhase, log, state, verified: tuple, *,
             critic_only: bool) -> TrainBatch:
  """`Steps.score_program` on the verified rollout (rollout, rewards, verdicts)."""
  name = "score (critic only)" if critic_only else "score"
  size = verified[1].shape[0]
  rows, placement = _packed(run, size, 1 + run.config.algo.ppo_epochs, size)
  batch, _ = add(phase, log, name, run.steps.score_program(critic_only=critic_only, rows=rows),
                  (state, *verified, placement), fallback=run.training)
  return batch


def _update(run: _Run, phase: CompiledPhase, log, state, batch: TrainBatch, *, actor: bool,
            held: int) -> None:
  """`Steps.ppo_program`; `held`: the rollout, its rewards and verdicts, held until the step ends."""
  critic = run.config.algo.uses_critic
  name = "update (critic + actor)" if actor and critic else "update (actor)" if actor else "update (critic)"
  size, algo = batch.response_mask.shape[0], run.config.algo
  mini = min(algo.mini_batch_responses, size)
  rows, placement = _packed(run, size, 1 + algo.ppo_epochs, mini)
  members = None  # `packing.fill_micro_batches`: ids of 2× the responses, as a plan sends them (`RowPlan.members`).
  if rows and run.config.packing.fill_micro_batches:
    members = jax.ShapeDtypeStruct((algo.ppo_epochs, size // mini, 2 * mini), jnp.int32,
                                   sharding=run.steps.replicated)
  add(phase, log, name, run.steps.ppo_program(state, actor=actor, critic=critic, rows=rows),
       (state, batch, placement, members), resident=held,
      fallback=run.training)  # Refused: outputs laid out as trained.


def device_bytes(config: ExperimentConfig, target: Topology) -> int | None:
  """Bytes per device the programs must fit: the least of the chip's HBM, what the device reports and
  `mesh.device_memory_gib` (None: none of them known)."""
  chip = target.chip.hbm_bytes if target.chip else None
  given = int(config.mesh.device_memory_gib * GIB) if config.mesh.device_memory_gib is not None else None
  known = [b for b in (chip, target.reported_bytes, given) if b is not None]
  return min(known) if known else None


def allowed_bytes(device_bytes: int | None, margin: float) -> int | None:
  """What a phase may need per device: (1 − `margin`) of `device_bytes` (`mesh.memory_margin`; the rest
  is left to the runtime, fragmentation and the collectives' buffers); None when the memory is unknown."""
  return None if device_bytes is None else int(device_bytes * (1.0 - margin))


# In a run's order; the reshard only where the rollout decodes from a copy (tensor_parallel > 1, int8 weights).
PHASES = ("supervised warm start", "reshard", "rollout", "partial rollout", "value pretraining", "scoring",
          "update")


def compile_run(config: ExperimentConfig, target: Topology, *, layers: int | None = None, phases=PHASES,
                tail: bool = False, log: Callable = lambda message: None) -> Report:
  """Every program of a run of `config` compiled for `target` (see the module docstring).
  `layers`: compile the models with only their first this many decoder layers (a quick look; the
  memory and times are then not the run's). `phases`: only these of `PHASES` (and the phases whose
  outputs they take: the rollout, and scoring for the update). `tail`: also the refill engine's
  decode programs at the slot counts it shrinks to after the first (the same program with fewer
  rows: at 64 layers minutes of compiling each, for nothing bigger than the first)."""
  unknown = set(phases) - set(PHASES)
  if unknown:
    raise ConfigError(f"unknown phase(s) {', '.join(sorted(unknown))}; phases: {', '.join(PHASES)}")
  run, done = _Run(config, target, layers, tail), []
  with topologies.persistent_cache_for(target), tpu_said.keeping(target), aot.walking(target.chip):
    if "supervised warm start" in phases and config.sft.steps and config.sft.path:
      done.append(_supervised(run, log))
    if "reshard" in phases and run.layout.copies:
      done.append(rollout_phases.reshard(run, log))
    if set(phases) & set(PHASES[2:]):
      done += _rollout_onwards(run, log, phases)
  state = run.state("rl")
  count = lambda params: sum(x.size for x in jax.tree.leaves(params))
  architecture = nnx.merge(run.states["rl"][0], state.actor).cfg
  copy = jax.tree.leaves(run.layout.abstract_copy(state.actor)) if run.layout.copies else None
  return Report(config, target, dict(run.mesh.shape), device_bytes(config, target), tuple(done),
                weight_elements(state.actor, architecture.num_layers),
                (count(state.actor), count(state.critic)), architecture, layers, run.plan, run.round,
                None if copy is None else sum(x.size * x.dtype.itemsize for x in copy))


def _micro_batches(run: _Run, size: int) -> str:
  """How `size` sequences are computed, in words."""
  steps = run.steps
  if rows := steps.largest_rows(size):
    return (f", packed: at most {rows} rows of {steps.row_tokens} tokens in micro-batches of "
            f"{steps.micro_rows} rows")
  return f" in micro-batches of {min(steps.micro, size)}"


def _rollout_onwards(run: _Run, log, phases) -> list[CompiledPhase]:
  """The rollout, value pretraining, scoring and the update, each compiled when asked for or needed."""
  config = run.config
  rollout_phase, out = rollout_phases.rollout(run, log)
  done = [rollout_phase]
  if "partial rollout" in phases and config.rollout.decode_budget:
    done.append(rollout_phases.partial_round(run, log))
  lengths = out.response_lengths  # The verifier's rewards and verdicts are placed like the rollout's rows.
  verified = (out,
              *(jax.ShapeDtypeStruct(lengths.shape, t, sharding=lengths.sharding) for t in (jnp.float32,
                                                                                            bool)))
  if "value pretraining" in phases and config.algo.uses_critic and config.algo.value_pretrain_steps:
    phase = CompiledPhase("value pretraining", "the critic alone on the rollout batch")
    state = run.state("value_pretrain")
    batch = _scoring(run, phase, log, state, verified, critic_only=True)
    _update(run, phase, log, state, batch, actor=False, held=chip_bytes(verified))
    done.append(phase)
  if {"scoring", "update"} & set(phases):
    scoring = CompiledPhase("scoring", f"{lengths.shape[0]} sequences{_micro_batches(run, lengths.shape[0])}")
    done.append(scoring)
    batch = _scoring(run, scoring, log, run.state("rl"), verified, critic_only=False)
  if "update" in phases:
    done.append(update := CompiledPhase("update", f"{config.updates_per_step} mini-batch updates of "
                                          f"{config.algo.mini_batch_responses} sequences"
                                          f"{_micro_batches(run, config.algo.mini_batch_responses)}"))
    _update(run, update, log, run.state("rl"), batch, actor=True, held=chip_bytes(verified))
  return done
