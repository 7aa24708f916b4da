"""The hand plan: bytes per device of every phase of a run, before anything is compiled (an estimate;
which figure governs: `vapo_jax/memory/__init__.py`).

  python -m vapo_jax.cli.memory --exp aime --mesh data=1,fsdp=256,tensor=1 --device-gib 95 [field=value ...]

`plan_memory(config, mesh_shape)` lays out, per device, what the trainer holds in each phase, and
`advice.refuse(plan, device_bytes)` refuses a configuration whose largest phase exceeds the device's
memory, naming the settings that would fix it and the values they would need. Nothing is
allocated: parameter shapes come from `nnx.eval_shape`, everything else from the config's sizes.

What is counted, phase by phase as the run's code (`trainer.py`, `experience.py`, `steps.py`,
`rollout/`, `models/`) holds it:

- Resident in every phase: actor and critic parameters (`model.param_dtype`) and their AdamW
  moments (two float32 per parameter; the trainer builds the critic even when `algo.estimator`
  is "group"), and the reference policy (a copy of the actor's parameters) when `algo.kl_coef` > 0.
- Phases run one after another, so the device needs the largest, not their sum:
  rollout (`rollout_phase`: the refill engine's pool of KV-cache pages plus every prompt's prefilled
  cache, or one static round's KV cache, `common.cache_bytes`; and
  the prefill, whose logits are the last position's only; with `rollout.tensor_parallel` > 1, in the
  rollout layout: the actor's copy, the cache split by heads, the reshard's array in flight),
  scoring (old log-probs, values, reference log-probs: forward passes over the rollout batch in
  micro-batches of `algo.micro_batch_responses`, `updates.logprobs_and_entropy`), the actor update
  and the critic update (separate jitted calls: micro-batches of `algo.micro_batch_responses`
  accumulated by `lax.scan`, so activations are one micro-batch's; the gradient accumulator in the
  parameter dtype plus one micro-batch's gradient; a float32 parameter-sized AdamW update), and the
  supervised warm start when configured (micro-batches of min(micro-batch, `sft.batch_size`), with
  its own AdamW moments).
- Sequences are `prompt_bucket(rollout.max_prompt_tokens)` + `rollout.max_response_tokens`
  tokens (the worst case). With `packing.enabled`, scoring and the updates hold micro-batches of
  `packing.micro_batch_rows` rows (default: one per data-parallel device) of `packing.row_tokens`
  tokens, each projected onto the vocabulary whole (prompts included). A batch axis is split over the
  data × fsdp devices when it divides evenly and replicated otherwise, as `sharding.partition_spec`
  does; tensor parallelism (`fsdp_tp`) splits the activations' heads and MLP width, not the KV cache.
- Activations: `footprint.activation_memory` (flash attention unless `model.attention` is
  "reference", whose float32 `[N, T, T]` scores it then counts; log-probs from vocabulary blocks
  of B·`model.logits_chunk`·V float32 logits; within 1.5× of XLA:CPU in float32, up to 4,096
  tokens). FSDP gathers weights in the compute dtype: two layers in flight (and one layer's
  gradient), plus the output projection, gathered whole for the log-probs' vocabulary blocks.

Not counted: XLA's workspace, fragmentation and collective buffers, evaluation rollouts (their
batch depends on the eval file), host footprint. GiB are 2^30 bytes."""

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from vapo_jax import rollout
from vapo_jax.config import ExperimentConfig
from vapo_jax.memory import footprint
from vapo_jax.memory.topologies import GIB
from vapo_jax.models import flash, sharding
from vapo_jax.models.config import TransformerConfig
from vapo_jax.models.kv_cache import PagedKVCache
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout import common, layout
from vapo_jax.train import build, packed_batch


class Item(NamedTuple):
  key: str  # Stable name (`advice` looks components up by it).
  label: str  # What the report prints.
  bytes: int  # Per device.
  counted: bool = True  # False: shown for comparison only (the other remat setting, a part of another row).
  note: str = ""  # Printed after the figure.


class PlannedPhase(NamedTuple):
  name: str  # "rollout", "scoring", "actor update", "critic update", "supervised update".
  detail: str  # Batch per device, in words.
  items: tuple[Item, ...]

  def bytes(self, resident: int = 0) -> int:
    return resident + sum(i.bytes for i in self.items if i.counted)

  def get(self, key: str) -> int:
    return sum(i.bytes for i in self.items if i.key == key and i.counted)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
  """Bytes per device of each phase of a run on a mesh (see the module docstring)."""

  config: ExperimentConfig  # What was planned (`advice` re-plans variants of it).
  mesh_shape: tuple[tuple[str, int], ...]  # (axis, size) pairs.
  summary: str  # Model, dtypes, mesh and sequence sizes, in words.
  resident: tuple[Item, ...]  # Held in every phase.
  phases: tuple[PlannedPhase, ...]  # Run one after another.

  @property
  def resident_bytes(self) -> int:
    return sum(i.bytes for i in self.resident)

  def phase_bytes(self) -> dict[str, int]:
    """Each phase's total with the resident state."""
    return {p.name: p.bytes(self.resident_bytes) for p in self.phases}

  @property
  def peak_bytes(self) -> int:
    return max(self.phase_bytes().values())

  def format(self, device_bytes: int | None = None, *, margin: float = 0.0) -> str:
    """The per-device table in GiB; with `device_bytes`, the verdict against (1 − `margin`) of it."""
    row = lambda label, b, note="": f"    {label:<58}{b / GIB:10.2f}{note}"
    lines = [self.summary, f"  {'per device':<62}{'GiB':>10}", "  resident in every phase"]
    lines += [row(i.label, i.bytes) for i in self.resident] + [row("total", self.resident_bytes)]
    for phase in self.phases:
      lines.append(f"  {phase.name}: {phase.detail}")
      lines += [row(i.label, i.bytes, i.note) for i in phase.items]
      lines.append(row("peak, with resident", phase.bytes(self.resident_bytes)))
    peaks = self.phase_bytes()
    verdict = f"  peak {self.peak_bytes / GIB:.2f} GiB per device ({max(peaks, key=peaks.get)})"
    if device_bytes is not None:
      allowed = allowed_bytes(device_bytes, margin)
      over = [n for n, b in peaks.items() if b > allowed]
      share = f" ({1 - margin:.0%} of {device_bytes / GIB:.2f} GiB, mesh.memory_margin)" if margin else ""
      verdict += (f" against {allowed / GIB:.2f} GiB{share}: " +
                  (f"does NOT fit ({', '.join(over)} over)" if over else
                   f"fits ({(allowed - self.peak_bytes) / GIB:.2f} GiB spare)"))
    return "\n".join(lines + [verdict])


_PARAMETERS: dict = {}


def _parameters(cfg: TransformerConfig, cls, param_dtype: str, preset_name: str, mesh: tuple) -> footprint.MemoryReport:
  """Parameter memory (eval_shape of one- and two-layer models), memoised: `advice` re-plans variants."""
  key = (cfg, cls.__name__, param_dtype, preset_name, mesh)
  if key not in _PARAMETERS:
    _PARAMETERS[key] = footprint.layered_parameter_memory(
        lambda c: cls(c, param_dtype=param_dtype, rngs=nnx.Rngs(0)), cfg, rules=sharding.PRESETS[preset_name],
        mesh_shape=dict(mesh))
  return _PARAMETERS[key]


def refill_engine(config: ExperimentConfig, cfg: TransformerConfig, devices: int) -> "rollout.Engine | None":
  """The refill engine over `devices` data-parallel groups (`rollout_groups`), as `rollout.engine_for` chooses
  it (one slot per group and the pages one sequence needs when not even that fits the budget, so that the plan
  shows by how much); None when the static engine runs (`rollout.refills`)."""
  r = config.rollout
  sequences, prompt_len = r.responses_per_step, common.prompt_bucket(r.max_prompt_tokens)
  try:
    engine = rollout.engine_for(r, cfg, sequences=sequences, prompt_tokens=prompt_len,
                                dtype=jnp.dtype(config.model.dtype), devices=devices)
  except MemoryError:
    if r.engine != "refill" or devices >= sequences:
      return None
    tg = r.page_tokens or common.default_page_tokens()
    pages = -(-r.prompts_per_step // devices) * -(-prompt_len // tg) + common.sequence_pages(r.max_response_tokens, tg)
    return rollout.Engine(kind="refill", slots=devices, queues=devices, pages=pages, page_tokens=tg)
  refilled = rollout.refills(engine, prompts=r.prompts_per_step, group=r.samples_per_prompt, prompt_tokens=prompt_len,
                             max_new_tokens=r.max_response_tokens)  # As `rollout.sample` decides.
  return engine if refilled else None


def rollout_groups(config: ExperimentConfig, mesh_shape: Mapping[str, int]) -> int:
  """The rollout's data-parallel groups on a mesh of this shape: its batch devices, or with
  `rollout.tensor_parallel` = T > 1 the groups of T chips of the rollout layout (rollout/layout.py)."""
  t = config.rollout.tensor_parallel
  return mesh_shape["data"] * mesh_shape["fsdp"] if t == 1 else math.prod(mesh_shape.values()) // t


def _rollout_shapes(at: "_Shapes") -> "_Shapes":
  """`at` in the rollout layout: itself, or (tensor_parallel T > 1) data groups x T chips under "tp"."""
  t = at.config.rollout.tensor_parallel
  if t == 1:
    return at
  config = dataclasses.replace(at.config, mesh=dataclasses.replace(at.config.mesh, preset="tp"))
  return _Shapes(config, {"data": rollout_groups(at.config, at.shape), "fsdp": 1, "tensor": t})


def _rollout_weights(config: ExperimentConfig, cfg: TransformerConfig, ro: "_Shapes") -> tuple[Item, ...]:
  """In a tensor-parallel rollout layout: the actor's copy in the compute dtype split over each group,
  and the reshard's transient, one array in flight (at most its largest shard: a stacked decoder-layer
  parameter holds every layer's; before the KV cache exists, counted with it)."""
  t, m = config.rollout.tensor_parallel, config.model
  if t == 1:
    return ()
  copy = _parameters(cfg, CausalLM, m.dtype, "tp", tuple(ro.shape.items())).param_bytes
  largest = max(math.prod(footprint.local_shape(shape, axes, ro.rules, ro.shape)) for shape, axes in (
      ((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
      ((cfg.num_layers, cfg.hidden_size, cfg.intermediate_size), ("layers", "embed", "mlp"))))
  return (Item("rollout_weights", f"actor's rollout copy ({m.dtype}, split over {t} chips)", copy),
          Item("reshard", "reshard: one array in flight (the largest rollout shard)",
               largest * jnp.dtype(m.dtype).itemsize))


def rollout_phase(config: ExperimentConfig, cfg: TransformerConfig, at: "_Shapes") -> PlannedPhase:
  """The rollout: the prefill (last-position logits only) and the KV cache of the sequences decoded
  at once, in the rollout layout (`rollout.tensor_parallel` = T > 1: the actor's copy split over
  groups of T chips, which split the KV cache by heads; the batch split over the groups). The refill
  engine (`rollout.engine`) decodes its slots over a pool of pages (`rollout.pages`, else as many as
  `kv_cache_budget_gib` holds, up to what its slots need) beside the prompts' prefilled cache it
  writes into them; the static one generates in rounds of `prompts_per_generation` prompts × G samples."""
  layout.check_tensor_parallel(config.rollout.tensor_parallel, devices=math.prod(at.shape.values()),
                               kv_heads=cfg.num_kv_heads)
  r, dtype, ro = config.rollout, jnp.dtype(config.model.dtype), _rollout_shapes(at)
  prompt_len, rows, t = common.prompt_bucket(r.max_prompt_tokens), ro.rows, r.tensor_parallel
  tokens, sequences = prompt_len + r.max_response_tokens, r.prompts_per_step * r.samples_per_prompt
  kv = lambda n, slots: common.cache_bytes(cfg, batch=n, prompt_tokens=slots, max_new_tokens=0, dtype=dtype,
                                            devices=n // rows(n), tensor=t)
  where = "per device" if t == 1 else f"per group of {t} chips"
  engine = refill_engine(config, cfg, sequences // rows(sequences))
  if engine:
    prefill = ro.activations(cfg, r.prompts_per_step, backward=False, head="last_logits", length=prompt_len, scored=0)
    detail = (f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples through {engine.slots} refill slots, "
              f"{rows(engine.slots)} {where}, over {engine.pages} pages of {engine.page_tokens} tokens")
    pool = PagedKVCache.pool_bytes(cfg, queues=1, pages=engine.pages, page_tokens=engine.page_tokens, dtype=dtype) // t
    items = (Item("kv_cache", f"KV cache's pool ({config.model.dtype}, {engine.pages} pages of "
                              f"{engine.page_tokens} tokens)", pool),
             Item("prompt_cache", f"prefilled prompts' KV cache ({prompt_len} slots each)",
                  kv(r.prompts_per_step, prompt_len)))
  else:
    per_call = r.prompts_per_generation or r.prompts_per_step  # Prompts per generation round.
    generated = per_call * r.samples_per_prompt
    prefill = ro.activations(cfg, per_call, backward=False, head="last_logits", length=prompt_len, scored=0)
    detail = (f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples in rounds of {per_call} prompts, "
              f"{rows(generated)} sequences {where}")
    items = (Item("kv_cache", f"KV cache ({config.model.dtype}, {tokens} slots)", kv(generated, tokens)),)
  return PlannedPhase("rollout", detail, _rollout_weights(config, cfg, ro) + items + (
      Item("prefill", "prefill activations (one layer's; last-position logits)", prefill.total),
      Item("samples", "sampled tokens and log-probs", rows(sequences) * r.max_response_tokens * 12)))


@dataclasses.dataclass(frozen=True)
class _Shapes:
  """What a run's phases hold per device, from its config on a mesh of this shape."""

  config: ExperimentConfig
  shape: Mapping[str, int]

  @property
  def rules(self):
    return sharding.PRESETS[self.config.mesh.preset]

  @property
  def tokens(self) -> int:  # The longest sequence: the prompt bucket and the response budget.
    return common.prompt_bucket(self.config.rollout.max_prompt_tokens) + self.config.rollout.max_response_tokens

  @property
  def packed(self) -> bool:  # Scoring and updates on packed rows (`packing.enabled`).
    return self.config.packing.enabled

  @property
  def micro(self) -> int:  # Of scoring and the updates: sequences, or packed rows.
    if self.packed:
      return packed_batch.micro_rows(self.config, self.shape["data"] * self.shape["fsdp"])
    return self.config.algo.micro_batch_responses or self.config.algo.mini_batch_responses

  @property
  def row_tokens(self) -> int:  # Of a micro-batch's rows: a padded sequence, or a packed row.
    return packed_batch.row_tokens(self.config) if self.packed else self.tokens

  def unit(self, n: int) -> str:
    return f"{n} rows of {self.row_tokens} tokens" if self.packed else f"{n} sequences"

  def rows(self, n: int) -> int:
    """Rows of an n-row batch on one device (split over the batch axes when they divide it)."""
    return footprint.local_shape((n,), ("batch",), self.rules, self.shape)[0]

  def activations(self, cfg, n, *, remat=None, backward=True, head="logprobs", length=None, scored=None):
    m = self.config.model
    heads, kv, mlp, embed = (footprint.local_shape((n,), (axis,), self.rules, self.shape)[0] for n, axis in (
        (cfg.num_heads, "act_heads"), (cfg.num_kv_heads, "act_kv_heads"), (cfg.intermediate_size, "act_mlp"),
        (cfg.hidden_size, "embed")))
    # Packed: every column.
    scored_default = self.row_tokens if self.packed else self.config.rollout.max_response_tokens
    return footprint.activation_memory(
        cfg, rows=self.rows(n), tokens=self.row_tokens if length is None else length,
        scored_tokens=scored_default if scored is None else scored,
        dtype_bytes=jnp.dtype(m.dtype).itemsize, remat=m.remat if remat is None else remat, scan_layers=m.scan_layers,
        backward=backward,
        head=head, dense_attention=m.attention == "reference", attention_block=(flash.BLOCK_Q, flash.BLOCK_K),
        logits_chunk=m.logits_chunk, heads=heads, kv_heads=kv, mlp=mlp, embed=embed)

  def gathered(self, cfg, *, backward: bool, value_head: bool = False) -> int:
    """Weights FSDP gathers in the compute dtype: two layers in flight (and one layer's gradient),
    and the output projection, gathered whole for the log-probs' vocabulary blocks."""
    if self.shape["fsdp"] == 1:
      return 0
    e = jnp.dtype(self.config.model.dtype).itemsize
    layer = footprint.layer_weight_count(cfg) * e // self.shape["tensor"]
    output = 0 if value_head else cfg.vocab_size * cfg.hidden_size * e
    return (3 * layer if backward else 2 * layer) + output

  def forward(self, name, cfg, *, value_head=False) -> tuple[Item, ...]:
    act = self.activations(cfg, self.micro, backward=False, head="values" if value_head else "logprobs")
    head = "values" if value_head else "log-probs and entropy from logit blocks"
    return (Item("activations", f"{name}: activations (one layer's, or the {head.split(' and')[0]})", act.total),
            Item("head", f"  {head}", act.head, counted=False),
            Item("gathered", f"{name}: FSDP-gathered weights",
                 self.gathered(cfg, backward=False, value_head=value_head)))

  def update(self, name, cfg, params, n, *, value_head=False, extra=()) -> PlannedPhase:
    m = self.config.model
    on, off = (self.activations(cfg, n, remat=x, head="values" if value_head else "logprobs")
               for x in (m.remat, not m.remat))
    with_on, with_off = ("with", "without") if m.remat else ("without", "with")
    return PlannedPhase(f"{name} update", f"micro-batch {self.unit(n)}, {self.rows(n)} per device", tuple(extra) + (
        Item("grads", f"gradients: accumulator + one micro-batch ({m.param_dtype})", 2 * params.grad_bytes),
        Item("update", "AdamW update (float32)", params.optimizer_bytes // 2),
        Item("gathered", "FSDP-gathered weights and gradient",
             self.gathered(cfg, backward=True, value_head=value_head)),
        Item("activations", f"activations {with_on} remat (configured)", on.total),
        Item("stored", "  kept for the backward pass: " + ("layer inputs" if m.remat else "every layer's tensors"),
             on.stored, counted=False),
        Item("layer", "  working set: one layer's backward" + (" (recomputed)" if m.remat else ""), on.layer,
             counted=False),
        Item("head", "  working set: " + ("values" if value_head else "logit blocks, gradients (float32)"),
             on.head, counted=False),
        Item("activations_other", f"activations {with_off} remat", off.total, counted=False,
             note="  (not counted)")))


def plan_memory(config: ExperimentConfig, mesh_shape: Mapping[str, int]) -> MemoryPlan:
  """The memory plan of `config` on a mesh of this shape (axes data, fsdp, tensor; missing: 1)."""
  mesh = tuple((a, int(mesh_shape.get(a, 1))) for a in sharding.MESH_AXES)
  if any(size < 1 for _, size in mesh):
    raise ValueError(f"mesh sizes must be >= 1, got {dict(mesh)}")
  m, algo, r = config.model, config.algo, config.rollout
  at = _Shapes(config, dict(mesh))
  actor_cfg, critic_cfg = build.model_configs(config)
  actor_p = _parameters(actor_cfg, CausalLM, m.param_dtype, config.mesh.preset, mesh)
  critic_p = _parameters(critic_cfg, ValueModel, m.param_dtype, config.mesh.preset, mesh)
  batch_rows, resp = at.rows(r.responses_per_step), r.max_response_tokens
  train_batch = Item("train_batch", f"rollout batch ({batch_rows} sequences)", batch_rows * (5 * at.tokens + 25 * resp))
  phases = [rollout_phase(config, actor_cfg, at),
            PlannedPhase("scoring", f"micro-batches of {at.unit(at.micro)}, {at.rows(at.micro)} per device",
                         (train_batch,) + max([at.forward("actor", actor_cfg),
                                               at.forward("critic", critic_cfg, value_head=True)],
                                              key=lambda items: sum(i.bytes for i in items))),
            at.update("actor", actor_cfg, actor_p, at.micro, extra=(train_batch,))]
  if algo.uses_critic:
    phases.append(at.update("critic", critic_cfg, critic_p, at.micro, value_head=True, extra=(train_batch,)))
  if config.sft.path and config.sft.steps:
    sft_opt = Item("sft_optimizer", "supervised AdamW moments (float32)", actor_p.optimizer_bytes)
    sft_micro = at.micro if at.packed else min(at.micro, config.sft.batch_size)
    phases.append(at.update("supervised", actor_cfg, actor_p, sft_micro, extra=(sft_opt,)))
  resident = [Item("actor_params", f"actor parameters ({m.param_dtype})", actor_p.param_bytes),
              Item("actor_optimizer", "actor AdamW moments (2 x float32)", actor_p.optimizer_bytes),
              Item("critic_params", f"critic parameters ({m.param_dtype})", critic_p.param_bytes),
              Item("critic_optimizer", "critic AdamW moments (2 x float32)", critic_p.optimizer_bytes)]
  if algo.kl_coef > 0:
    resident.append(Item("reference", f"reference policy ({m.param_dtype})", actor_p.param_bytes))
  return MemoryPlan(config=config, mesh_shape=mesh, summary=_summary(at, actor_p.num_parameters),
                    resident=tuple(resident), phases=tuple(phases))


def _summary(at: _Shapes, parameters: int) -> str:
  m, shape, config = at.config.model, at.shape, at.config
  count = f"{parameters / 1e9:.3f} B" if parameters >= 1e9 else f"{parameters / 1e6:.2f} M"
  devices, resp = math.prod(shape.values()), config.rollout.max_response_tokens
  return (f"memory plan of {config.name}: {m.checkpoint or m.preset} ({count} parameters), {m.dtype} compute, "
          f"{m.param_dtype} parameters, remat {'on' if m.remat else 'off'}\n"
          f"  mesh data={shape['data']} fsdp={shape['fsdp']} tensor={shape['tensor']} "
          f"({devices} device{'s' if devices > 1 else ''}, preset {config.mesh.preset}); sequences "
          f"{at.tokens - resp} prompt + {resp} response = {at.tokens} tokens; mini-batch "
          f"{config.algo.mini_batch_responses}, micro-batch {at.unit(at.micro) if at.packed else at.micro}")


def allowed_bytes(device_bytes: int | None, margin: float) -> int | None:
  """What a phase may need per device: (1 − `margin`) of `device_bytes` (`mesh.memory_margin`; the rest
  is left to the runtime, fragmentation and the collectives' buffers); None when the memory is unknown."""
  return None if device_bytes is None else int(device_bytes * (1.0 - margin))


def device_memory_bytes(config: ExperimentConfig) -> int | None:
  """`mesh.device_memory_gib`, else the device's own `bytes_limit`, else None (CPU: unknown)."""
  if config.mesh.device_memory_gib is not None:
    return int(config.mesh.device_memory_gib * GIB)
  import jax
  try:
    stats = jax.devices()[0].memory_stats()
  except (RuntimeError, NotImplementedError):  # Backends without memory statistics.
    return None
  return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
