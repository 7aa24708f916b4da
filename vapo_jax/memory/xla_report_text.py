"""The compile report in words: its table (`table`), and for each phase that does not fit, what to
change (`refusal`).

A phase fits when it needs at most `Report.allowed`, (1 − `mesh.memory_margin`) of the device memory.
What to change comes from the hand plan (`advice.fixes`, the settings and values that bring a
planned phase under a budget), asked for the allowed bytes lowered by what the compiled phase needs beyond
the plan's figure for it, so that its advice aims at XLA's number; for the refill engine's rollout
also from the KV cache's bytes per slot.
"""

import math

from vapo_jax.memory import advice, compiled_cache, hand_plan
from vapo_jax.memory.topologies import GIB
from vapo_jax.models.kv_cache import PagedKVCache
from vapo_jax.rollout import common
from vapo_jax.train import build

MIB = 2**20
_PLANNED = {"supervised warm start": ("supervised update",), "rollout": ("rollout",), "scoring": ("scoring",),
            "value pretraining": ("scoring", "critic update"), "update": ("actor update", "critic update")}


def readable_bytes(n: float) -> str:
  """Bytes in the largest binary unit below them: "3.20 GiB", "512.00 KiB"."""
  unit = next((u for u in ("GiB", "MiB", "KiB") if n >= 2 ** (10 * ("KMG".index(u[0]) + 1))), "B")
  return f"{n / 2 ** (10 * ('KMG'.index(unit[0]) + 1)):.2f} {unit}" if unit != "B" else f"{n:.0f} B"


def _row(p, unit: int) -> str:
  size = lambda x: f"{x / unit:8.2f}"
  if p.memory is None:
    own = f"{'refused by the compiler, needs':>34}{size(p.refused_bytes)}"
  else:
    m = p.memory
    own = f"{size(m.arguments)}{size(m.outputs)}{size(m.aliased)}{size(m.temporaries)}{size(m.total)}"
  decode = f"{p.decode.bytes / MIB:10.3f}" if p.decode is not None else f"{'':>10}"
  beside = p.needs - (p.memory.total if p.memory is not None else p.refused_bytes)
  return (f"    {p.name:<46}{own}{size(beside)}{size(p.needs)}{p.lower_s + p.compile_s:10.1f}"
          f"{p.flops / 1e12:10.2f}{p.bytes_accessed / 1e9:9.1f}{decode}  {'+'.join(p.attention) or '-'}")


def _decode_lines(report) -> list[str]:
  lines = []
  for phase in report.phases:
    for p in phase.programs:
      if p.decode is not None and p.memory is not None:
        share = p.decode.bytes / report.weight_bytes
        lines.append(f"  {p.name}: the decode loop moves {readable_bytes(p.decode.bytes)} per device per step in "
                     f"{p.decode.count} collectives ({share:.2%} of the policy's "
                     f"{readable_bytes(report.weight_bytes)} of weights; largest {readable_bytes(p.decode.largest)}"
                     + (f"; {readable_bytes(p.decode.branch_bytes)} more on refill steps"
                        if p.decode.branch_bytes else "") + ")")
  return lines


def table(report) -> str:
  """The report: one row per program (GiB per device), the decode loop's traffic, the verdict."""
  c, t = report.config, report.target
  chip = f"{t.chip.hbm_bytes / GIB:.2f} GiB HBM per chip" if t.chip else "memory unknown"
  layers = f"; ONLY {report.layers} decoder layers compiled" if report.layers else ""
  mesh = " ".join(f"{k}={v}" for k, v in report.mesh_shape.items())
  unit = GIB if max(phase.needs for phase in report.phases) >= GIB / 4 else MIB
  lines = [f"compile report of {c.name} for {t.name}: {len(t.devices)} x {t.device_kind} ({chip}){layers}",
           f"  mesh {mesh} (preset {c.mesh.preset}); {c.model.preset} in {c.model.dtype}, {c.model.param_dtype} "
           f"parameters, remat {'on' if c.model.remat else 'off'}",
           f"  {('GiB' if unit == GIB else 'MiB') + ' per device':<50}{'args':>8}{'out':>8}{'alias':>8}{'temp':>8}"
           f"{'own':>8}{'beside':>8}{'needs':>8}{'compile s':>10}{'TFLOP':>10}{'GB acc':>9}{'MiB/step':>10}  attention"]
  for phase in report.phases:
    lines.append(f"  {phase.name} ({phase.detail})")
    lines += [_row(p, unit) for p in phase.programs] + ([f"    ({phase.skipped})"] if phase.skipped else [])
  lines += _decode_lines(report)
  kept = sum(p.kept for phase in report.phases for p in phase.programs)
  if kept:
    lines.append(f"  {kept} program(s) loaded from what the compiler said before ($JAX_COMPILATION_CACHE_DIR/"
                 f"{compiled_cache.PREFIX}*): their compile s is the load's")
  worst = max(report.phases, key=lambda phase: phase.needs)
  peak = f"  peak {readable_bytes(worst.needs)} per device ({worst.name}: {worst.worst.name})"
  if report.budget is None:
    return "\n".join(lines + [peak + ": no memory budget known (mesh.device_memory_gib)"])
  over, margin = report.over(), c.mesh.memory_margin
  verdict = (f"does NOT fit ({', '.join(p.name for p in over)} over)" if over else
             f"fits ({readable_bytes(report.allowed - worst.needs)} spare)")
  share = f"{worst.needs / report.budget:.1%} of {readable_bytes(report.budget)}"
  return "\n".join(lines + [f"{peak}, {share}, against {readable_bytes(report.allowed)} ({1 - margin:.0%}: "
                             f"mesh.memory_margin={margin:g}): {verdict}",
                            "  (own: args + out - alias + temp, XLA's; beside: the run's other arrays held while it "
                            "runs (and inputs XLA does not read); "
                            "TFLOP, GB acc: cost_analysis per device, loop bodies counted once)"])


def _page_advice(report, phase) -> str | None:
  """A smaller pool of KV-cache pages: the pool is the refill engine's rollout's bulk and shrinks by one page's
  bytes per page (None where the compiler refused the program: its figure then has no breakdown to scale)."""
  c = report.config
  if phase.worst.memory is None:
    return None
  cfg = build.model_configs(c)[0]
  engine = hand_plan.refill_engine(c, cfg, hand_plan.rollout_groups(c, report.mesh_shape))
  if not engine:
    return None
  per_page = PagedKVCache.pool_bytes(cfg, queues=1, pages=1, page_tokens=engine.page_tokens,
                                     dtype=c.model.dtype) / c.rollout.tensor_parallel  # Per chip.
  keep = engine.pages - math.ceil((phase.needs - report.allowed) / per_page)
  r, groups = c.rollout, hand_plan.rollout_groups(c, report.mesh_shape)
  least = (-(-r.prompts_per_step // groups) * -(-common.prompt_bucket(r.max_prompt_tokens) // engine.page_tokens)
           + common.sequence_pages(r.max_response_tokens, engine.page_tokens))  # A group's prompts and one sequence.
  return (f"rollout.pages={keep} (now {engine.pages}; {readable_bytes(per_page)} of KV cache per page per chip)"
          if keep >= least else None)


def _plan_advice(report, phase) -> list[str]:
  """The hand plan's fixes, aimed at the compiled figure (see the module docstring). Where the compiler
  refused the phase's largest program, its figure (what the compiler tried to allocate, often far above
  what a fitting setting needs) is not a measure to aim below: the plan's fixes then aim at the allowed
  bytes themselves, and the line says to compile the fix to confirm it."""
  plan = hand_plan.plan_memory(report.config, report.mesh_shape)
  planned = {name: b for name, b in plan.phase_bytes().items() if name in _PLANNED.get(phase.name, ())}
  if not planned:
    return []
  name = max(planned, key=planned.get)
  if phase.worst.memory is None:
    return [f + " by the hand plan (compile it to confirm)" for f in advice.fixes(plan, name, report.allowed)]
  aim = report.allowed - (phase.needs - planned[name])
  return advice.fixes(plan, name, int(aim)) if aim > 0 else []


def refusal(report) -> str | None:
  """For each phase over the budget, one line naming it and what to change (None: every phase fits)."""
  over = report.over()
  if not over:
    return None
  margin = report.config.mesh.memory_margin
  lines = [f"the run does not fit {report.target.name}: {report.allowed / GIB:.2f} GiB per device allowed, "
           f"{1 - margin:.0%} of {report.budget / GIB:.2f} GiB ({report.target.device_kind}; mesh.memory_margin="
           f"{margin:g}); change one setting per phase:"]
  for phase in over:
    pages = _page_advice(report, phase) if phase.name == "rollout" else None
    fixes = [pages] if pages else []  # The plan's own page count only where the pool's arithmetic gave none.
    fixes += [f for f in _plan_advice(report, phase) if not (pages and f.startswith("a smaller pool"))]
    fixes = fixes or ["no single setting found; shorten the sequences, use more devices or a larger chip"]
    lines.append(f"  {phase.name} needs {phase.needs / GIB:.2f} GiB ({phase.worst.name}): " + "; or ".join(fixes))
  return "\n".join(lines)

