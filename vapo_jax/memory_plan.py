"""Memory planning: bytes per device of every phase of a run, before anything is compiled.

  python -m vapo_jax.memory_plan --exp aime --mesh data=1,fsdp=256,tensor=1 --device-gib 95 [field=value ...]

`plan(config, mesh_shape)` lays out, per device, what the trainer holds in each phase, and
`check(plan, device_bytes)` refuses a configuration whose largest phase exceeds the device's
memory, naming the settings that would fix it and the values they would need. Nothing is
allocated: parameter shapes come from `nnx.eval_shape`, everything else from the config's sizes.

What is counted, following the code as it is (`trainer.py`, `experience.py`, `train_step.py`,
`rollout.py`, `refill.py`, `models/`; change this file with them):

- Resident in every phase: actor and critic parameters (`model.param_dtype`) and their AdamW
  moments (two float32 per parameter; the trainer builds the critic even when `algo.estimator`
  is "group"), and the reference policy (a copy of the actor's parameters) when `algo.kl_coef` > 0.
- Phases run one after another, so the device needs the largest, not their sum:
  rollout (`rollout_phase`: the KV cache of the sequences decoded at once, `rollout.cache_bytes`,
  in the refill engine's slots plus every prompt's prefilled cache, or one static round's; and
  the prefill, whose logits are the last position's only), scoring (old log-probs, values,
  reference log-probs: forward passes over the rollout batch in micro-batches of
  `algo.micro_batch_responses`, `train_step.logprobs_and_entropy`), the actor update and the
  critic update (separate jitted calls: micro-batches of `algo.micro_batch_responses` accumulated by `lax.scan`, so activations
  are one micro-batch's; the gradient accumulator in the parameter dtype plus one micro-batch's
  gradient; a float32 parameter-sized AdamW update), and the supervised warm start when
  configured (micro-batches of min(micro-batch, `sft.batch_size`), with its own AdamW moments).
- Sequences are `prompt_bucket(rollout.max_prompt_tokens)` + `rollout.max_response_tokens`
  tokens (the worst case). A batch axis is split over the data × fsdp devices when it divides
  evenly and replicated otherwise, as `sharding.partition_spec` does; tensor parallelism
  (`fsdp_tp`) splits the activations' heads and MLP width, not the KV cache.
- Activations: `models.memory.activation_memory` (flash attention unless `model.attention` is
  "reference", whose float32 `[N, T, T]` scores it then counts; log-probs from vocabulary blocks
  of B·`model.logits_chunk`·V float32 logits; within 1.5× of XLA:CPU in float32, up to 4,096
  tokens). FSDP gathers weights in the compute dtype: two layers in flight (and one layer's
  gradient), plus the output projection, gathered whole for the log-probs' vocabulary blocks.

Not counted: XLA's workspace, fragmentation and collective buffers, evaluation rollouts (their
batch depends on the eval file), host memory. GiB are 2^30 bytes."""

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from vapo_jax import rollout
from vapo_jax.config import ConfigError, ExperimentConfig
from vapo_jax.models import attention, memory, sharding
from vapo_jax.models.config import TransformerConfig, preset
from vapo_jax.models.transformer import CausalLM, ValueModel

GIB = 2**30


class Item(NamedTuple):
  key: str  # Stable name (`check` looks components up by it).
  label: str  # What the report prints.
  bytes: int  # Per device.
  counted: bool = True  # False: shown for comparison only (the other remat setting, a part of another row).
  note: str = ""  # Printed after the figure.


class Phase(NamedTuple):
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

  config: ExperimentConfig  # What was planned (`check` re-plans variants of it).
  mesh_shape: tuple[tuple[str, int], ...]  # (axis, size) pairs.
  summary: str  # Model, dtypes, mesh and sequence sizes, in words.
  resident: tuple[Item, ...]  # Held in every phase.
  phases: tuple[Phase, ...]  # Run one after another.

  @property
  def resident_bytes(self) -> int:
    return sum(i.bytes for i in self.resident)

  def phase_bytes(self) -> dict[str, int]:
    """Each phase's total with the resident state."""
    return {p.name: p.bytes(self.resident_bytes) for p in self.phases}

  @property
  def peak_bytes(self) -> int:
    return max(self.phase_bytes().values())

  def format(self, device_bytes: int | None = None) -> str:
    """The per-device table in GiB; with `device_bytes`, the verdict against it."""
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
      over = [n for n, b in peaks.items() if b > device_bytes]
      verdict += (f" against {device_bytes / GIB:.2f} GiB: " +
                  (f"does NOT fit ({', '.join(over)} over)" if over else
                   f"fits ({(device_bytes - self.peak_bytes) / GIB:.2f} GiB spare)"))
    return "\n".join(lines + [verdict])


def model_configs(config: ExperimentConfig) -> tuple[TransformerConfig, TransformerConfig]:
  """Architectures of the policy and the critic (from their checkpoints' config.json when given)."""
  m = config.model
  actor = TransformerConfig.from_pretrained(m.checkpoint) if m.checkpoint else preset(m.preset)
  critic = TransformerConfig.from_pretrained(m.critic_checkpoint) if m.critic_checkpoint else actor
  return actor, critic


_PARAMETERS: dict = {}


def _parameters(cfg: TransformerConfig, cls, param_dtype: str, preset_name: str, mesh: tuple) -> memory.MemoryReport:
  """Parameter memory (eval_shape of one- and two-layer models), memoised: `check` re-plans variants."""
  key = (cfg, cls.__name__, param_dtype, preset_name, mesh)
  if key not in _PARAMETERS:
    _PARAMETERS[key] = memory.layered_parameter_memory(
        lambda c: cls(c, param_dtype=param_dtype, rngs=nnx.Rngs(0)), cfg, rules=sharding.PRESETS[preset_name],
        mesh_shape=dict(mesh))
  return _PARAMETERS[key]


def refill_slots(config: ExperimentConfig, cfg: TransformerConfig, devices: int) -> int:
  """Decode slots of the refill engine over `devices` batch devices, as `generation.engine_for`
  chooses them (at least one per device); 0 when the static engine runs (or every sequence has a slot)."""
  r = config.rollout
  prompt_len, sequences = rollout.prompt_bucket(r.max_prompt_tokens), r.prompts_per_step * r.samples_per_prompt
  if r.engine != "refill":
    return 0
  per_sequence = rollout.cache_bytes(cfg, batch=1, prompt_tokens=prompt_len, max_new_tokens=r.max_response_tokens,
                                     dtype=jnp.dtype(config.model.dtype))
  slots = r.slots or max(1, min(-(-sequences // devices), int(r.kv_cache_budget_gib * GIB) // per_sequence)) * devices
  return slots if slots < sequences else 0


def rollout_phase(config: ExperimentConfig, cfg: TransformerConfig, rows, activations, batch_rows: int) -> Phase:
  """The rollout: the prefill (last-position logits only) and the KV cache of the sequences decoded
  at once. The refill engine (`rollout.engine`) decodes in `slots` rows (`rollout.slots`, else as
  many as `kv_cache_budget_gib` holds) and keeps every prompt's prefilled cache; the static one
  generates in rounds of `prompts_per_generation` prompts × G samples."""
  r, dtype = config.rollout, jnp.dtype(config.model.dtype)
  prompt_len = rollout.prompt_bucket(r.max_prompt_tokens)
  tokens, sequences = prompt_len + r.max_response_tokens, r.prompts_per_step * r.samples_per_prompt
  kv = lambda n, slots: rollout.cache_bytes(cfg, batch=n, prompt_tokens=slots, max_new_tokens=0, dtype=dtype,
                                            devices=n // rows(n))
  slots = refill_slots(config, cfg, sequences // rows(sequences))
  if slots:
    prefill = activations(cfg, r.prompts_per_step, backward=False, head="last_logits", length=prompt_len, scored=0)
    detail = (f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples through {slots} refill slots, "
              f"{rows(slots)} per device")
    items = (Item("kv_cache", f"KV cache of the slots ({config.model.dtype}, {tokens} slots each)", kv(slots, tokens)),
             Item("prompt_cache", f"prefilled prompts' KV cache ({prompt_len} slots each)",
                  kv(r.prompts_per_step, prompt_len)))
  else:
    per_call = r.prompts_per_generation or r.prompts_per_step  # Prompts per generation round.
    generated = per_call * r.samples_per_prompt
    prefill = activations(cfg, per_call, backward=False, head="last_logits", length=prompt_len, scored=0)
    detail = (f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples in rounds of {per_call} prompts, "
              f"{rows(generated)} sequences per device")
    items = (Item("kv_cache", f"KV cache ({config.model.dtype}, {tokens} slots)", kv(generated, tokens)),)
  return Phase("rollout", detail, items + (
      Item("prefill", "prefill activations (one layer's; last-position logits)", prefill.total),
      Item("samples", "sampled tokens and log-probs", batch_rows * r.max_response_tokens * 12)))


def plan(config: ExperimentConfig, mesh_shape: Mapping[str, int]) -> MemoryPlan:
  """The memory plan of `config` on a mesh of this shape (axes data, fsdp, tensor; missing: 1)."""
  mesh = tuple((a, int(mesh_shape.get(a, 1))) for a in sharding.MESH_AXES)
  if any(size < 1 for _, size in mesh):
    raise ValueError(f"mesh sizes must be >= 1, got {dict(mesh)}")
  shape = dict(mesh)
  m, algo, r = config.model, config.algo, config.rollout
  rules = sharding.PRESETS[config.mesh.preset]
  actor_cfg, critic_cfg = model_configs(config)
  e = jnp.dtype(m.dtype).itemsize
  actor_p = _parameters(actor_cfg, CausalLM, m.param_dtype, config.mesh.preset, mesh)
  critic_p = _parameters(critic_cfg, ValueModel, m.param_dtype, config.mesh.preset, mesh)
  prompt_len = rollout.prompt_bucket(r.max_prompt_tokens)
  tokens, resp = prompt_len + r.max_response_tokens, r.max_response_tokens
  responses, micro = r.responses_per_step, algo.micro_batch_responses or algo.mini_batch_responses
  rows = lambda n: memory.local_shape((n,), ("batch",), rules, shape)[0]

  def activations(cfg, n, *, remat=m.remat, backward=True, head="logprobs", length=tokens, scored=resp):
    heads, kv, mlp, embed = (memory.local_shape((n,), (axis,), rules, shape)[0] for n, axis in (
        (cfg.num_heads, "act_heads"), (cfg.num_kv_heads, "act_kv_heads"), (cfg.intermediate_size, "act_mlp"),
        (cfg.hidden_size, "embed")))
    return memory.activation_memory(
        cfg, rows=rows(n), tokens=length, scored_tokens=scored, dtype_bytes=e, remat=remat, backward=backward,
        head=head, dense_attention=m.attention == "reference", attention_block=(attention.BLOCK_Q, attention.BLOCK_K),
        logits_chunk=m.logits_chunk, heads=heads, kv_heads=kv, mlp=mlp, embed=embed)

  def gathered(cfg, *, backward: bool, value_head: bool = False) -> int:
    """Weights FSDP gathers in the compute dtype: two layers in flight (and one layer's gradient),
    and the output projection, gathered whole for the log-probs' vocabulary blocks."""
    if shape["fsdp"] == 1:
      return 0
    layer = memory.layer_weight_count(cfg) * e // shape["tensor"]
    output = 0 if value_head else cfg.vocab_size * cfg.hidden_size * e
    return (3 * layer if backward else 2 * layer) + output

  def forward(name, cfg, *, value_head=False) -> tuple[Item, ...]:
    act = activations(cfg, micro, backward=False, head="values" if value_head else "logprobs")
    head = "values" if value_head else "log-probs and entropy from logit blocks"
    return (Item("activations", f"{name}: activations (one layer's, or the {head.split(' and')[0]})", act.total),
            Item("head", f"  {head}", act.head, counted=False),
            Item("gathered", f"{name}: FSDP-gathered weights", gathered(cfg, backward=False, value_head=value_head)))

  def update(name, cfg, params, n, *, value_head=False, extra=()) -> Phase:
    head = "values" if value_head else "logprobs"
    on, off = (activations(cfg, n, remat=x, head=head) for x in (m.remat, not m.remat))
    with_on, with_off = ("with", "without") if m.remat else ("without", "with")
    return Phase(f"{name} update", f"micro-batch {n} sequences, {rows(n)} per device", tuple(extra) + (
        Item("grads", f"gradients: accumulator + one micro-batch ({m.param_dtype})", 2 * params.grad_bytes),
        Item("update", "AdamW update (float32)", params.optimizer_bytes // 2),
        Item("gathered", "FSDP-gathered weights and gradient", gathered(cfg, backward=True, value_head=value_head)),
        Item("activations", f"activations {with_on} remat (configured)", on.total),
        Item("stored", "  kept for the backward pass: " + ("layer inputs" if m.remat else "every layer's tensors"),
             on.stored, counted=False),
        Item("layer", "  working set: one layer's backward" + (" (recomputed)" if m.remat else ""), on.layer,
             counted=False),
        Item("head", "  working set: " + ("values" if value_head else "logit blocks, gradients (float32)"),
             on.head, counted=False),
        Item("activations_other", f"activations {with_off} remat", off.total, counted=False,
             note="  (not counted)")))

  batch_rows = rows(responses)
  train_batch = Item("train_batch", f"rollout batch ({batch_rows} sequences)", batch_rows * (5 * tokens + 25 * resp))
  phases = [rollout_phase(config, actor_cfg, rows, activations, batch_rows),
            Phase("scoring", f"micro-batches of {micro} sequences, {rows(micro)} per device",
                  (train_batch,) + max([forward("actor", actor_cfg), forward("critic", critic_cfg, value_head=True)],
                                       key=lambda items: sum(i.bytes for i in items))),
            update("actor", actor_cfg, actor_p, micro, extra=(train_batch,))]
  if algo.uses_critic:
    phases.append(update("critic", critic_cfg, critic_p, micro, value_head=True, extra=(train_batch,)))
  if config.sft.path and config.sft.steps:
    sft_opt = Item("sft_optimizer", "supervised AdamW moments (float32)", actor_p.optimizer_bytes)
    phases.append(update("supervised", actor_cfg, actor_p, min(micro, config.sft.batch_size), extra=(sft_opt,)))
  resident = [Item("actor_params", f"actor parameters ({m.param_dtype})", actor_p.param_bytes),
              Item("actor_optimizer", "actor AdamW moments (2 x float32)", actor_p.optimizer_bytes),
              Item("critic_params", f"critic parameters ({m.param_dtype})", critic_p.param_bytes),
              Item("critic_optimizer", "critic AdamW moments (2 x float32)", critic_p.optimizer_bytes)]
  if algo.kl_coef > 0:
    resident.append(Item("reference", f"reference policy ({m.param_dtype})", actor_p.param_bytes))
  count, devices = actor_p.num_parameters, math.prod(shape.values())
  count = f"{count / 1e9:.3f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"
  summary = (f"memory plan of {config.name}: {m.checkpoint or m.preset} ({count} parameters), {m.dtype} compute, "
             f"{m.param_dtype} parameters, remat {'on' if m.remat else 'off'}\n"
             f"  mesh data={shape['data']} fsdp={shape['fsdp']} tensor={shape['tensor']} "
             f"({devices} device{'s' if devices > 1 else ''}, preset {config.mesh.preset}); sequences "
             f"{prompt_len} prompt + {resp} response = {tokens} tokens; mini-batch {algo.mini_batch_responses}, "
             f"micro-batch {micro}")
  return MemoryPlan(config=config, mesh_shape=mesh, summary=summary, resident=tuple(resident), phases=tuple(phases))


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


# ------------------------------------------------------------------------------ refusing
def _variant(p: MemoryPlan, mesh: Mapping[str, int] | None = None, **changes) -> MemoryPlan | None:
  """`p`'s config re-planned with `section__field=value` changes (and a mesh); None if invalid."""
  sections: dict[str, dict] = {}
  for path, value in changes.items():
    section, field = path.split("__")
    sections.setdefault(section, {})[field] = value
  try:
    config = dataclasses.replace(p.config, **{s: dataclasses.replace(getattr(p.config, s), **f)
                                              for s, f in sections.items()})
    return plan(config, dict(p.mesh_shape) if mesh is None else mesh)
  except (ConfigError, ValueError):
    return None


def _fits(q: MemoryPlan | None, phase: str, budget: int) -> bool:
  return q is not None and q.phase_bytes().get(phase, 0) <= budget


def _effect(p: MemoryPlan, q: MemoryPlan, phase: str, key: str, what: str, budget: int) -> str:
  """'(what A -> B GiB[; rollout then needs C GiB])'."""
  get = lambda x: next(ph for ph in x.phases if ph.name == phase).get(key) if key else x.phase_bytes()[phase]
  worse = [f"{n} then needs {b / GIB:.1f} GiB" for n, b in q.phase_bytes().items()
           if b > budget and b > p.phase_bytes().get(n, 0)]
  return f"({what} {get(p) / GIB:.1f} -> {get(q) / GIB:.1f} GiB" + "".join(f"; {w}" for w in worse) + ")"


def _divisors_below(n: int, below: int) -> list[int]:
  return [d for d in range(below - 1, 0, -1) if n % d == 0]


def _first_fit(p: MemoryPlan, phase: str, budget: int, values, make) -> tuple[int, MemoryPlan] | None:
  """The first `value` whose variant `make(value)` (keyword changes, or (mesh, changes)) fits `phase`."""
  for value in values:
    mesh, changes = spec if isinstance(spec := make(value), tuple) else (None, spec)
    if _fits(q := _variant(p, mesh, **changes), phase, budget):
      return value, q
  return None


def _update_fixes(p: MemoryPlan, phase: str, budget: int) -> list[str]:
  """Remat, micro-batch size, then mesh layouts that bring an update phase under `budget`."""
  c, mesh = p.config, dict(p.mesh_shape)
  supervised = phase == "supervised update"
  field = "sft__batch_size" if supervised else "algo__micro_batch_responses"
  size = c.sft.batch_size if supervised else c.algo.mini_batch_responses
  current = min(c.algo.micro_batch_responses or c.algo.mini_batch_responses, size)  # The trainer's micro-batch.
  name = field.replace("__", ".")
  effect = lambda q: _effect(p, q, phase, "activations", "activations", budget)
  fixes = []
  if not c.model.remat and _fits(q := _variant(p, model__remat=True), phase, budget):
    fixes.append(f"set model.remat=true {effect(q)}")
  for also in ({}, {"model__remat": True}) if not (c.model.remat or fixes) else ({},):
    if fit := _first_fit(p, phase, budget, _divisors_below(size, current), lambda d, also=also: {field: d, **also}):
      fixes.append(f"set {name}={fit[0]}" + (" and model.remat=true " if also else " ") + effect(fit[1]))
      break
  devices = math.prod(mesh.values())
  for tensor in (t for t in (2, 4, 8, 16, 32) if not fixes and devices % t == 0 and t > mesh["tensor"]):
    layout = {"data": 1, "fsdp": devices // tensor, "tensor": tensor}  # Split the heads: tensor parallelism.
    if fit := _first_fit(p, phase, budget, _divisors_below(size, size + 1), lambda d, layout=layout: (
        layout, {"mesh__preset": "fsdp_tp", "model__remat": True, field: d})):
      fixes.append(f"raise mesh.tensor: mesh.preset=fsdp_tp mesh.data=1 mesh.fsdp={layout['fsdp']} "
                   f"mesh.tensor={tensor} with {name}={fit[0]} and model.remat=true {effect(fit[1])}")
  if mesh["data"] > 1:
    layout = {"data": 1, "fsdp": mesh["data"] * mesh["fsdp"], "tensor": mesh["tensor"]}
    q = _variant(p, layout, mesh__preset="fsdp" if c.mesh.preset == "dp" else c.mesh.preset)
    if _fits(q, phase, budget):
      fixes.append(f"raise mesh.fsdp to {layout['fsdp']} with mesh.data=1 (parameters, gradients and AdamW "
                   f"sharded further) {_effect(p, q, phase, '', 'phase', budget)}")
  return fixes


def _sequence_fixes(p: MemoryPlan, phase: str, budget: int) -> list[str]:
  """Fewer prompts, shorter responses or more batch devices for the rollout / scoring phase."""
  c, mesh = p.config, dict(p.mesh_shape)
  effect = lambda q: _effect(p, q, phase, "", phase, budget)
  fixes, prompts, tokens = [], c.rollout.prompts_per_step, c.rollout.max_response_tokens

  def fewer(n: int) -> dict:  # Keeps the mini- and micro-batch dividing the responses per step.
    mini = math.gcd(c.algo.mini_batch_responses, n * c.rollout.samples_per_prompt)
    micro = c.algo.micro_batch_responses and math.gcd(c.algo.micro_batch_responses, mini)
    return {"rollout__prompts_per_step": n, "algo__mini_batch_responses": mini, "algo__micro_batch_responses": micro}
  devices = mesh["data"] * mesh["fsdp"]  # The slots are split over the batch axes.
  slots = refill_slots(c, model_configs(c)[0], devices)
  if phase == "rollout" and slots and (fit := _first_fit(p, phase, budget, range(slots - devices, 0, -devices),
                                                         lambda n: {"rollout__slots": n})):
    fixes.append(f"fewer refill slots: rollout.slots={fit[0]} {effect(fit[1])}")
  if phase == "rollout" and not slots and (fit := _first_fit(p, phase, budget, _divisors_below(prompts, prompts),
                                                             lambda n: {"rollout__prompts_per_generation": n})):
    fixes.append(f"generate in rounds: rollout.prompts_per_generation={fit[0]} {effect(fit[1])}")
  if fit := _first_fit(p, phase, budget, _divisors_below(prompts, prompts), fewer):
    mini = fit[1].config.algo.mini_batch_responses
    also = "" if mini == c.algo.mini_batch_responses else f" and algo.mini_batch_responses={mini}"
    fixes.append(f"lower rollout.prompts_per_step to {fit[0]}{also} {effect(fit[1])}")
  if fit := _first_fit(p, phase, budget, range((tokens - 1) // 1024 * 1024, 0, -1024),
                       lambda n: {"rollout__max_response_tokens": n}):
    fixes.append(f"lower rollout.max_response_tokens to {fit[0]} {effect(fit[1])}")
  if mesh["tensor"] > 1:  # The rollout batch is split over data x fsdp only.
    layout = {"data": mesh["data"], "fsdp": mesh["fsdp"] * mesh["tensor"], "tensor": 1}
    if _fits(q := _variant(p, layout, mesh__preset="fsdp"), phase, budget):
      fixes.append(f"split the batch over more devices: mesh.fsdp={layout['fsdp']} mesh.tensor=1 {effect(q)}")
  return fixes


def check(plan: MemoryPlan, device_bytes: int | None) -> None:
  """Raises `ConfigError` when a phase of `plan` exceeds `device_bytes` (None: unknown, no check),
  naming for each phase over it the settings that would bring that phase under, with their values."""
  over = {n: b for n, b in plan.phase_bytes().items() if device_bytes is not None and b > device_bytes}
  if not over:
    return
  lines = [(f"the run needs {plan.peak_bytes / GIB:.1f} GiB per device, over the {device_bytes / GIB:.1f} GiB of "
            f"device memory (mesh.device_memory_gib; mesh.check_memory=false skips this check). Each of these "
            f"fixes one phase:")]
  for name, needed in over.items():
    fixes = ((_update_fixes(plan, name, device_bytes) if name != "rollout" else [])
             + (_sequence_fixes(plan, name, device_bytes) if name in ("rollout", "scoring") else []))
    if not fixes:
      fixes = ["no single setting fits it; shorten the sequences or use more devices"]
    lines.append(f"  {name} needs {needed / GIB:.1f} GiB: " + "; or ".join(fixes))
  raise ConfigError("\n".join(lines))


def main(argv: list[str]) -> int:
  """`python -m vapo_jax.memory_plan --exp NAME [--mesh data=1,fsdp=256,tensor=1] [--device-gib 95] [field=value ...]`

  Plans for `--mesh` (axes not named: 1), else for the configured mesh on this machine's devices;
  prints the plan and the verdict. Exit status 1 when it does not fit, 2 on a bad argument."""
  from vapo_jax import cli

  args, options = list(argv), {"--mesh": "", "--device-gib": ""}
  for flag in options:
    if flag in args:
      i = args.index(flag)
      options[flag] = args[i + 1] if i + 1 < len(args) else ""
      del args[i:i + 2]
  try:
    config, _ = cli.resolve(args)
    if options["--device-gib"]:
      config = dataclasses.replace(config, mesh=dataclasses.replace(
          config.mesh, device_memory_gib=float(options["--device-gib"])))
    if options["--mesh"]:  # The mesh to plan for; axes not named are 1.
      sizes = dict.fromkeys(sharding.MESH_AXES, 1)
      for item in options["--mesh"].split(","):
        axis, _, size = item.partition("=")
        if axis not in sizes:
          raise ConfigError(f"--mesh axis {axis!r} is not one of {', '.join(sharding.MESH_AXES)}")
        sizes[axis] = int(size)
    else:  # The configured mesh on this machine's devices.
      import jax
      sizes = {a: getattr(config.mesh, a) for a in sharding.MESH_AXES}
      known = math.prod(s for s in sizes.values() if s != -1)
      sizes = {a: max(1, jax.device_count() // known) if s == -1 else s for a, s in sizes.items()}
    p = plan(config, sizes)
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  device_bytes = device_memory_bytes(config)
  print(p.format(device_bytes))
  try:
    check(p, device_bytes)
  except ConfigError as e:
    print(f"refused: {e}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
