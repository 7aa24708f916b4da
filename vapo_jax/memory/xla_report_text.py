"""The compile report in words: its table (`table`), and for each phase that does not fit, what to
change (`refusal`).

A phase fits when it needs at most `Report.allowed`, (1 − `mesh.memory_margin`) of the device memory.
What to change is found by compiling the run again with each setting that can lower the phase
(`what_if`): every fix is printed with the figure XLA gave it.
"""

from vapo_jax.memory import tpu_said, what_if
from vapo_jax.memory.topologies import GIB, readable_bytes

MIB = 2**20


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
        lines.append(f"  {p.name}: the decode loop moves {readable_bytes(p.decode.bytes)} per device per "
                     f"step in {p.decode.count} collectives ({share:.2%} of the policy's "
                     f"{readable_bytes(report.weight_bytes)} of weights; largest "
                     f"{readable_bytes(p.decode.largest)}"
                     + (f"; {readable_bytes(p.decode.branch_bytes)} more on refill steps"
                        if p.decode.branch_bytes else "") + ")")
  return lines


def table(report) -> str:
  """The report: one row per program (GiB per device), the decode loop's traffic, the verdict."""
  c, t = report.config, report.target
  chip = (f"{t.chip.hbm_bytes / GIB:.2f} GiB HBM per chip" if t.chip else
          f"{readable_bytes(t.reported_bytes)} each, as the device reports" if t.reported_bytes else
          "memory not reported")
  layers = f"; ONLY {report.layers} decoder layers compiled" if report.layers else ""
  mesh = " ".join(f"{k}={v}" for k, v in report.mesh_shape.items())
  unit = GIB if max(phase.needs for phase in report.phases) >= GIB / 4 else MIB
  lines = [f"compile report of {c.name} for {t.name}: {len(t.devices)} x {t.device_kind} ({chip}){layers}",
           f"  mesh {mesh} (preset {c.mesh.preset}); {c.model.preset} in {c.model.dtype}, "
           f"{c.model.param_dtype} parameters, remat {c.model.remat}",
           f"  {('GiB' if unit == GIB else 'MiB') + ' per device':<50}{'args':>8}{'out':>8}{'alias':>8}{'temp':>8}"
           f"{'own':>8}{'beside':>8}{'needs':>8}{'compile s':>10}{'TFLOP':>10}{'GB acc':>9}{'MiB/step':>10}  "
           "attention"]
  for phase in report.phases:
    lines.append(f"  {phase.name} ({phase.detail})")
    lines += [_row(p, unit) for p in phase.programs] + ([f"    ({phase.skipped})"] if phase.skipped else [])
  lines += _decode_lines(report)
  kept = sum(p.kept for phase in report.phases for p in phase.programs)
  if kept:
    lines.append(f"  {kept} program(s) loaded from what the compiler said before ($JAX_COMPILATION_CACHE_DIR/"
                 f"{tpu_said.PREFIX}*): their compile s is the load's")
  worst = max(report.phases, key=lambda phase: phase.needs)
  peak = f"  peak {readable_bytes(worst.needs)} per device ({worst.name}: {worst.worst.name})"
  if report.device_bytes is None:
    return "\n".join(lines + [peak + ": no device memory known (mesh.device_memory_gib)"])
  over, margin = report.over(), c.mesh.memory_margin
  verdict = (f"does NOT fit ({', '.join(p.name for p in over)} over)" if over else
             f"fits ({readable_bytes(report.allowed - worst.needs)} spare)")
  share = f"{worst.needs / report.device_bytes:.1%} of {readable_bytes(report.device_bytes)}"
  return "\n".join(lines + [f"{peak}, {share}, against {readable_bytes(report.allowed)} ({1 - margin:.0%}: "
                             f"mesh.memory_margin={margin:g}): {verdict}",
                            "  (own: args + out - alias + temp, XLA's; beside: the run's other arrays held "
                            "while it runs (and inputs XLA does not read); "
                            "TFLOP, GB acc: cost_analysis per device, loop bodies counted once)"])


def refusal(report) -> str | None:
  """For each phase over what the device memory allows, one line naming it and what to change, each fix
  compiled (`what_if`; None: every phase fits)."""
  over = report.over()
  if not over:
    return None
  margin = report.config.mesh.memory_margin
  lines = [f"the run does not fit {report.target.name}: {readable_bytes(report.allowed)} per device allowed, "
           f"{1 - margin:.0%} of {readable_bytes(report.device_bytes)} ({report.target.device_kind}; "
           f"mesh.memory_margin={margin:g}); change one setting per phase (each compiled to check it):"]
  for phase in over:
    fixes = what_if.fixes(report, phase.name) or [
        "no single setting found; shorten the sequences, use more devices or a larger chip"]
    lines.append(f"  {phase.name} needs {readable_bytes(phase.needs)} ({phase.worst.name}): " + "; or ".join(fixes))
  return "\n".join(lines)


def remat_table(rows, allowed: float) -> str:
  """`what_if.remat_policies`' rows as lines: each policy's update bytes per device against what is allowed
  and its compiled FLOPs, then the least recomputation that fits."""
  lines = ["model.remat  update needs (allowed " + readable_bytes(allowed) + ")  compiled TFLOP per device "
           "(a loop body once)"]
  for policy, needs, flops in rows:
    if needs is None:
      lines.append(f"  {policy:<20} not a valid config")
      continue
    verdict = "fits" if needs <= allowed else "over"
    lines.append(f"  {policy:<20} {readable_bytes(needs):>12} {verdict:<5} {flops / 1e12:10.3f}")
  best = what_if.least_recomputation(rows, allowed)
  lines.append(f"least recomputation that fits: model.remat={best}" if best else
               "no model.remat policy fits the update")
  return "\n".join(lines)
