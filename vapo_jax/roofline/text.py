"""The roofline as text: one step's phases, a comparison of engines and profiles, what bounds the update."""

from vapo_jax.roofline import decode_cost, micro_batch_cost
from vapo_jax.roofline.step import MFU_FLOOR, StepEstimate, read_cores


def update_bound(step: StepEstimate) -> str | None:
  """What bounds the update when its MFU is under `MFU_FLOOR`, and which setting would move it (None: above)."""
  mfu = step.phase_mfu("update")
  if mfu >= MFU_FLOOR:
    return None
  p = step.phase("update")
  per_chip = p.model_flops / step.chips
  terms = {"compute": p.compute_s, "HBM bandwidth": p.memory_s, "collectives": p.collective_s}
  bound = max(terms, key=terms.get)
  why = {"compute": (f"the compiled FLOPs are {p.flops / per_chip:.2f}x the model FLOPs (remat's second "
                     "forward, attention's masked blocks): a model.remat policy that recomputes less, where "
                     "the memory allows it (make memory's what-if names one)"),
         "HBM bandwidth": ("its bytes per FLOP: larger micro-batches (packing.micro_batch_rows) reuse each "
                           "gathered weight over more rows"),
         "collectives": ("FSDP gathers every weight and reduces every gradient once per micro-batch: larger "
                         "micro-batches (packing.micro_batch_rows) or a smaller mesh.fsdp with mesh.data > 1 "
                         "move fewer bytes")}[bound]
  share = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in terms.items())
  return f"update MFU {mfu:.1%} < {MFU_FLOOR:.0%}: bound by {bound} ({share}); {why}"


def format_estimate(step: StepEstimate, chip_name: str, rl_steps: int | None = None) -> str:
  """One step's phases: FLOPs, bytes, collectives, seconds and MFU, the step's time, share and MFU; with
  `rl_steps`, the run's RL at that step's price."""
  lines = [f"roofline of one RL step per chip at {step.peak_flops / 1e12:.0f} TFLOP/s bf16, the HBM and ICI "
           f"bandwidth of a {chip_name}; the {step.engine} rollout engine, {step.decode_steps} decode steps; "
           f"{step.profile}",
           f"  {'phase':<12}{'TFLOP':>10}{'HBM GB':>10}{'ICI GB':>10}{'compute s':>11}{'memory s':>10}{'ICI s':>10}"
           f"{'cycles s':>10}{'estimate s':>12}{'MFU':>8}"]
  lines += [f"  {p.phase:<12}{p.flops / 1e12:10.1f}{p.bytes / 1e9:10.1f}{p.collective_bytes / 1e9:10.1f}"
            f"{p.compute_s:11.1f}{p.memory_s:10.1f}{p.collective_s:10.1f}{p.cycles_s:10.1f}{p.seconds:12.1f}"
            f"{step.phase_mfu(p.phase):8.1%}" for p in step.phases]
  lines.append("  (HBM GB: walked from each program's HLO, loops by their trips, in-place writes as their "
               "updates; cycles s: the compiler's estimated cycles at the core's clock, uncalibrated, "
               "kernels and gathers counting none; estimate s: the rollout's decode steps one by one, scoring's "
               "and the update's instructions one after another, each the slower of its compute and memory, "
               "collectives over ICI on top, less those the compiled schedule runs under the core's work; a "
               "Pallas kernel group's TFLOP: what splash computes, the block pairs it visits on the profile's "
               "packed rows times the products its compiled calls run a pair, roofline/attention_cost.py)")
  lines += format_groups(step)
  lines.append(f"  {summary(step)}")
  lines.append(f"  {compiler_summary(step)}")
  if rl_steps:
    lines.append(f"  the run's RL: {rl_steps} steps x {step.seconds:.0f} s = "
                 f"{rl_steps * step.seconds / 3600:.1f} h "
                 "(value pretraining and the held-out evaluations besides)")
  if bound := update_bound(step):
    lines.append(f"  {bound}")
  return "\n".join(lines)


def format_groups(step: StepEstimate) -> list[str]:
  """Scoring's and the update's instructions by group: the bound beside the compiler's cycles, and what the
  phase-wide figure (compute and memory overlapped across every instruction) would have said."""
  lines = []
  for p in (p for p in step.phases if p.groups):
    lines.append(f"  {p.phase} by instruction group, per chip: {p.instructions_s:.1f} s one after another "
                 f"(+ {p.collective_s:.1f} s of collectives over ICI, {p.hidden_s:.1f} s of them under the core's "
                 f"work at its bound, {p.hidden_cycles_s:.1f} s at the compiler's cycles), against "
                 f"{p.overlapped_s:.1f} s with compute and memory overlapped across the phase; the compiler's cycles "
                 f"{p.cycles_s:.1f} s")
    lines.append(f"    {'group':<17}{'runs':>12}{'TFLOP':>10}{'HBM GB':>10}{'bound s':>10}{'cycles s':>10}"
                 f"{'cycles / bound':>16}")
    for name, (runs, flops, bytes_, bound, cycles) in sorted(p.groups.items(), key=lambda kv: -kv[1][3]):
      over = "over ICI" if name == "collective" else "none" if not cycles else f"{cycles / bound:.2f}" if bound \
          else "-"
      lines.append(f"    {name:<17}{runs:12,.0f}{flops / 1e12:10.1f}{bytes_ / 1e9:10.1f}"
                   f"{'' if name == 'collective' else f'{bound:.1f}':>10}{cycles:10.1f}{over:>16}")
  return lines


def compiler_summary(step: StepEstimate) -> str:
  """The step by the compiler's cycles for scoring and the update (`Estimate.compiler_s`), beside the bound's."""
  walked = [p for p in step.phases if p.groups]
  if not walked:
    return "the compiler's figure: none (no program walked)"
  parts = ", ".join(f"{p.phase} {p.compiler_s:.0f} s (bound {p.seconds:.0f} s)" for p in walked)
  return (f"by the compiler's cycles (Pallas kernels at their bound, collectives over ICI less those under the "
          f"core's work): {parts}; one RL step "
          f"{step.compiler_seconds:.0f} s, MFU {step.compiler_mfu:.1%} (by the bound: {step.mfu:.1%}); a target "
          "holds only where both reach it")


def summary(step: StepEstimate) -> str:
  rollout = step.phase("rollout").seconds
  return (f"one RL step: {step.seconds:.0f} s ({step.seconds / 60:.1f} min), the rollout {rollout:.0f} s, "
          f"{step.rollout_share:.0%} of it; model FLOPs {step.model_flops / 1e15:.0f} PFLOP: MFU "
          f"{step.mfu:.1%} (the update, critic and actor in one program: {step.phase_mfu('update'):.1%})"
          + ("" if step.update_fill is None else f"; the update's token fill {step.update_fill:.1%} in "
             f"micro-batches of {step.micro_rows} rows")
          + ("" if not step.fitting_rows or 1 - step.update_fill <= micro_batch_cost.MAX_PADDING else
             f" (packing.micro_batch_rows={step.fitting_rows} pads at most "
             f"{micro_batch_cost.MAX_PADDING:.0%})")
          + ("" if step.decode is None or not step.decode.chunks else
             f"; prefill in the loop: {step.decode.prefills} admissions, {step.decode.chunks} chunks, "
             f"{step.decode.prefill_s:.1f} s a queue")
          + ("" if step.partial is None else f"; {step.decode_steps} decode steps in "
             f"{step.partial.rounds / step.partial.steps:.2f} rounds of {step.budget[0]} (the round's plan: "
             f"{step.partial.plan.queue_pages} pages a queue, {step.partial.plan.slots} slots, "
             f"{step.partial.plan.lanes} lanes of {step.partial.plan.prefill_chunk}-token chunks), "
             f"a queue carrying {step.partial.carried:.0f} sequences, restarting "
             f"{step.partial.restarted / step.partial.steps:.0f} and prefilling "
             f"{step.partial.prefill.sum() / step.partial.steps / 1e6:.2f}M tokens a step; "
             f"{step.partial.stale_frac:.0%} of the trained tokens stale"))


def format_comparison(report, estimates: list[tuple[str, StepEstimate]]) -> str:
  """The profiles, the itemised decode bytes per chip and step of each (profile, engine), each step's phases,
  and the rollout's speed-up of the paged engine over the contiguous one under each profile."""
  chip = report.target.device_kind
  names = dict.fromkeys(label.split(",")[0] for label, _ in estimates)
  lines = [f"roofline of one RL step per chip ({chip}), by response-length profile and rollout engine:"]
  for letter, (_, step) in zip(names,
                               ((label, s) for label, s in estimates if label.endswith(estimates[0][0][2:]))):
    lines.append(f"  profile {letter}: {step.profile}")
  lines += decode_cost.format_costs([(label, step.decode) for label,
                                     step in estimates if step.decode is not None])
  if report.refill and report.plan.attention == "kernel" and report.target.chip is not None:
    cores, mode = read_cores(report, report.target.chip)
    lines.append(f"  the paged kernel reads the cache on {cores} of the chip's {report.target.chip.cores} "
                 f"TensorCore(s) (megacore_mode={mode})")
  width = max(len(label) for label, _ in estimates) + 2
  for label, step in estimates:
    lines.append(f"  {label:<{width}}{summary(step)}")
  by = dict(estimates)
  for letter in names:
    if f"{letter}, paged" in by and f"{letter}, contiguous" in by:
      paged, contiguous = by[f"{letter}, paged"], by[f"{letter}, contiguous"]
      ratio = contiguous.phase("rollout").seconds / paged.phase("rollout").seconds
      floor = ((contiguous.phase("rollout").seconds - contiguous.decode.seconds + contiguous.decode.floor_s)
               / (paged.phase("rollout").seconds - paged.decode.seconds + paged.decode.floor_s))
      lines.append(f"  profile {letter}: the paged rollout is {ratio:.2f}x the contiguous one's speed at the "
                   f"same KV-cache bytes ({paged.decode.slots} against {contiguous.decode.slots} slots; "
                   f"{floor:.2f}x with the decode's rest left out)")
  lines += [format_estimate(step, f"{chip} ({label})", report.config.rl_steps) for label, step in estimates]
  return "\n".join(lines)
