"""Refusing a memory plan that does not fit, naming for each phase over the device's memory the
settings that would bring it under and the values they need (each found by re-planning the config
with that change: remat, smaller micro-batches, tensor parallelism, more FSDP, fewer refill slots,
rounds of prompts, fewer prompts, shorter responses).
"""

import math
from collections.abc import Mapping

from vapo_jax.config import overrides
from vapo_jax.errors import ConfigError
from vapo_jax.memory.hand_plan import GIB, MemoryPlan, allowed_bytes, plan_memory, refill_engine, rollout_groups
from vapo_jax.train import packed_batch
from vapo_jax.train.build import model_configs


def _variant(p: MemoryPlan, mesh: Mapping[str, int] | None = None, changes: dict | None = None) -> MemoryPlan | None:
  """`p`'s config re-planned with `{"field.path": value}` changes (and a mesh); None if invalid."""
  try:
    return plan_memory(overrides.replace_fields(p.config, changes or {}), dict(p.mesh_shape) if mesh is None else mesh)
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
    if _fits(q := _variant(p, mesh, changes), phase, budget):
      return value, q
  return None


def _update_fixes(p: MemoryPlan, phase: str, budget: int) -> list[str]:
  """Remat, micro-batch size, then mesh layouts that bring an update phase under `budget`."""
  c, mesh = p.config, dict(p.mesh_shape)
  if c.packing.enabled:  # Rows per micro-batch, a multiple of the batch devices.
    name, current = "packing.micro_batch_rows", packed_batch.micro_rows(c, mesh["data"] * mesh["fsdp"])
    smaller = lambda shards, below: list(range((below - 1) // shards * shards, 0, -shards))
    split_values = lambda shards: smaller(shards, max(current, shards) + 1)  # Fewer batch devices: as many rows.
  else:
    supervised = phase == "supervised update"
    name = "sft.batch_size" if supervised else "algo.micro_batch_responses"
    size = c.sft.batch_size if supervised else c.algo.mini_batch_responses
    current = min(c.algo.micro_batch_responses or c.algo.mini_batch_responses, size)  # The trainer's micro-batch.
    smaller = lambda shards, below: _divisors_below(size, below)
    split_values = lambda shards: _divisors_below(size, size + 1)
  effect = lambda q: _effect(p, q, phase, "activations", "activations", budget)
  fixes = []
  if not c.model.remat and _fits(q := _variant(p, None, {"model.remat": True}), phase, budget):
    fixes.append(f"set model.remat=true {effect(q)}")
  for also in ({}, {"model.remat": True}) if not (c.model.remat or fixes) else ({},):
    if fit := _first_fit(p, phase, budget, smaller(mesh["data"] * mesh["fsdp"], current),
                         lambda d, also=also: {name: d, **also}):
      fixes.append(f"set {name}={fit[0]}" + (" and model.remat=true " if also else " ") + effect(fit[1]))
      break
  devices = math.prod(mesh.values())
  for tensor in (t for t in (2, 4, 8, 16, 32) if not fixes and devices % t == 0 and t > mesh["tensor"]):
    layout = {"data": 1, "fsdp": devices // tensor, "tensor": tensor}  # Split the heads: tensor parallelism.
    if fit := _first_fit(p, phase, budget, split_values(layout["fsdp"]), lambda d, layout=layout: (
        layout, {"mesh.preset": "fsdp_tp", "model.remat": True, name: d})):
      fixes.append(f"raise mesh.tensor: mesh.preset=fsdp_tp mesh.data=1 mesh.fsdp={layout['fsdp']} "
                   f"mesh.tensor={tensor} with {name}={fit[0]} and model.remat=true {effect(fit[1])}")
  if mesh["data"] > 1:
    layout = {"data": 1, "fsdp": mesh["data"] * mesh["fsdp"], "tensor": mesh["tensor"]}
    q = _variant(p, layout, {"mesh.preset": "fsdp" if c.mesh.preset == "dp" else c.mesh.preset})
    if _fits(q, phase, budget):
      fixes.append(f"raise mesh.fsdp to {layout['fsdp']} with mesh.data=1 (parameters, gradients and AdamW "
                   f"sharded further) {_effect(p, q, phase, '', 'phase', budget)}")
  return fixes


def _sequence_fixes(p: MemoryPlan, phase: str, budget: int) -> list[str]:
  """Fewer prompts, shorter responses or more batch devices: for any phase (an update's rows are as long as
  its sequences)."""
  c, mesh = p.config, dict(p.mesh_shape)
  effect = lambda q: _effect(p, q, phase, "", phase, budget)
  fixes, prompts, tokens = [], c.rollout.prompts_per_step, c.rollout.max_response_tokens

  def fewer(n: int) -> dict:  # Keeps the mini- and micro-batch dividing the responses per step.
    mini = math.gcd(c.algo.mini_batch_responses, n * c.rollout.samples_per_prompt)
    micro = c.algo.micro_batch_responses and math.gcd(c.algo.micro_batch_responses, mini)
    return {"rollout.prompts_per_step": n, "algo.mini_batch_responses": mini, "algo.micro_batch_responses": micro}
  engine = refill_engine(c, model_configs(c)[0], rollout_groups(c, mesh))  # Pages per data-parallel group.
  if phase == "rollout" and engine and (fit := _first_fit(p, phase, budget, _fewer(engine.pages),
                                                          lambda n: {"rollout.pages": n})):
    fixes.append(f"a smaller pool of KV-cache pages: rollout.pages={fit[0]} {effect(fit[1])}")
  if phase == "rollout" and not engine and (fit := _first_fit(p, phase, budget, _divisors_below(prompts, prompts),
                                                              lambda n: {"rollout.prompts_per_generation": n})):
    fixes.append(f"generate in rounds: rollout.prompts_per_generation={fit[0]} {effect(fit[1])}")
  if fit := _first_fit(p, phase, budget, _divisors_below(prompts, prompts), fewer):
    mini = fit[1].config.algo.mini_batch_responses
    also = "" if mini == c.algo.mini_batch_responses else f" and algo.mini_batch_responses={mini}"
    fixes.append(f"lower rollout.prompts_per_step to {fit[0]}{also} {effect(fit[1])}")
  if fit := _first_fit(p, phase, budget, range((tokens - 1) // 1024 * 1024, 0, -1024),
                       lambda n: {"rollout.max_response_tokens": n}):
    fixes.append(f"lower rollout.max_response_tokens to {fit[0]} {effect(fit[1])}")
  if mesh["tensor"] > 1:  # The rollout batch is split over data x fsdp only.
    layout = {"data": mesh["data"], "fsdp": mesh["fsdp"] * mesh["tensor"], "tensor": 1}
    if _fits(q := _variant(p, layout, {"mesh.preset": "fsdp"}), phase, budget):
      fixes.append(f"split the batch over more devices: mesh.fsdp={layout['fsdp']} mesh.tensor=1 {effect(q)}")
  return fixes


def _fewer(pages: int) -> list[int]:
  """Smaller pools to try, largest first: 64 steps down from `pages`."""
  step = max(1, pages // 64)
  return list(range(pages - step, 0, -step))


def refuse(plan: MemoryPlan, device_bytes: int | None, *, margin: float = 0.0) -> None:
  """Raises `ConfigError` when a phase of `plan` needs more than (1 − `margin`) of `device_bytes` (None:
  unknown, no check), naming for each such phase the settings that would bring it under, with their values."""
  allowed = allowed_bytes(device_bytes, margin)
  over = {n: b for n, b in plan.phase_bytes().items() if allowed is not None and b > allowed}
  if not over:
    return
  lines = [f"the run needs {plan.peak_bytes / GIB:.1f} GiB per device, over the {allowed / GIB:.1f} GiB allowed: "
           f"{1 - margin:.0%} of the {device_bytes / GIB:.1f} GiB of device memory (mesh.memory_margin={margin:g}; "
           "mesh.device_memory_gib; mesh.check_memory=false skips this check). Each of these fixes one phase:"]
  for name, needed in over.items():
    lines.append(f"  {name} needs {needed / GIB:.1f} GiB: " + "; or ".join(
        fixes(plan, name, allowed) or ["no single setting fits it; shorten the sequences or use more devices"]))
  raise ConfigError("\n".join(lines))


def fixes(plan: MemoryPlan, phase: str, device_bytes: int) -> list[str]:
  """The settings, each with its value, that bring `phase` of `plan` under `device_bytes` per device."""
  return ((_update_fixes(plan, phase, device_bytes) if phase != "rollout" else [])
          + _sequence_fixes(plan, phase, device_bytes))  # An update's rows are as long as its sequences.
