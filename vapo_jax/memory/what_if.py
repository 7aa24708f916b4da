"""What to change when a phase does not fit, found by compiling the run again: no model of the memory.

  what_if.fixes(report, "update")   # ["set packing.micro_batch_rows=8 (compiled: update needs 81.02 GiB)", ...]

For each setting that can lower a phase (`settings`), the phase is compiled once more at a second value of it
(about half the current one); the value that brings the phase under the allowed bytes is read off the line
through the two figures (XLA's bytes are close to affine in each: micro-batch rows, pages of KV cache, prompts
per generation, the response-length cap), rounded down to a value the setting takes, and compiled once more to
check it. Where the compiler refused the current value, its figure is what it tried to allocate, not a point
on the line: a third value (about half the second) is compiled for a second measured figure. A fix is printed
with its compiled figure; where the check refutes the line, a value compiled on the way that fits is named,
else the line says so. A choice (`model.remat`: the policies that recompute more than the current one) is
compiled value by value, least recomputation first, until one fits. `remat_policies` compiles the update under
every policy (`make memory --remat`) and names the one that recomputes least and fits. Each compile builds the
phase and those it takes inputs from (`xla_report.compile_run(phases=)`), so XLA's cache answers for the
programs a setting leaves unchanged.
"""

from vapo_jax.config import overrides
from vapo_jax.errors import ConfigError
from vapo_jax.kinds import Remat, names
from vapo_jax.memory import xla_report
from vapo_jax.memory.topologies import readable_bytes
from vapo_jax.train import packed_batch

REMAT = names(Remat)  # Least recomputation first.


def _divisors_below(n: int, below: int) -> list[int]:
  return [d for d in range(below - 1, 0, -1) if n % d == 0]


def _first_at_most(values, x: float) -> int:
  """The index of the first of `values` (largest first: a list or a range) at most `x` (len: none)."""
  lo, hi = 0, len(values)
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if values[mid] <= x else (mid + 1, hi)
  return lo


def settings(report, phase: str) -> list[tuple[str, object, list]]:
  """(field, its value now, the values to try: valid, below it, largest first, a list or a range) of each
  setting that can lower `phase` of `report`."""
  c, shape = report.config, report.mesh_shape
  r, found = c.rollout, []
  if phase == "rollout" and report.refill:  # Pages per data-parallel group, as rollout.pages counts them.
    pages = report.plan.pages
    found.append(("rollout.pages", pages, range(pages - 1, report.plan.least_pages - 1, -1)))
  elif phase == "rollout" and report.refill is False and r.engine == "static":
    now = report.plan.prompts_per_round
    found.append(("rollout.prompts_per_generation", now, _divisors_below(r.prompts_per_step, now)))
  elif phase == "partial rollout":  # A round's prompts carry up to a response: fewer rounds' sequences, or shorter.
    found.append(("rollout.prompts_per_step", r.prompts_per_step, _divisors_below(r.prompts_per_step,
                                                                                 r.prompts_per_step)))
  elif phase not in ("rollout", "reshard"):
    if more := REMAT[REMAT.index(c.model.remat) + 1:]:  # Policies that recompute more (and keep less).
      found.append(("model.remat", c.model.remat, list(more)))
    if c.packing.enabled:  # Rows per micro-batch: a multiple of the batch devices.
      shards = shape["data"] * shape["fsdp"]
      now = packed_batch.micro_rows(c, shards)
      found.append(("packing.micro_batch_rows", now, range((now - 1) // shards * shards, 0, -shards)))
    else:
      mini = c.algo.mini_batch_responses
      now = min(c.algo.micro_batch_responses or mini, mini)
      found.append(("algo.micro_batch_responses", now, _divisors_below(mini, now)))
  cap = r.max_response_tokens
  step = 1024 if cap > 4096 else 16
  found.append(("rollout.max_response_tokens", cap, range((cap - 1) // step * step, 0, -step)))
  return found


def refused(phase) -> bool:
  """Whether the compiler refused one of the phase's programs: its figure is then what the compiler tried to
  allocate, not a size to draw a line through."""
  return any(getattr(p, "memory", True) is None for p in getattr(phase, "programs", ()))


def needs(report, phase: str, changes: dict) -> tuple[float, bool] | None:
  """What `phase` needs per device compiled with `changes` to the report's config, and whether the compiler
  refused a program of it (None: not a valid config)."""
  try:
    config = overrides.replace_fields(report.config, changes)
    again = xla_report.compile_run(config, report.target, layers=report.layers, phases=(phase,))
  except (ConfigError, ValueError,
          MemoryError):  # MemoryError: the KV cache's own check (`common.check_pool`).
    return None
  found = next(p for p in again.phases if p.name == phase)
  return found.needs, refused(found)


def _said(field: str, value, phase: str, figure: float) -> str:
  text = str(value).lower() if isinstance(value, bool) else value
  return f"set {field}={text} (compiled: {phase} needs {readable_bytes(figure)})"


def _nearest(values, x: float):
  i = _first_at_most(values, x)
  return min(values[max(i - 1, 0):i + 1], key=lambda v: abs(v - x))


def search(report, phase: str, field: str, now, values) -> str | None:
  """The fix `field` gives `phase` (see the module docstring), or None where it gives none. The line runs
  through two measured figures: the current one and the second value's, or, where the compiler refused the
  current value, the second value's and a third's (about half the second)."""
  allowed, current = report.allowed, next(p for p in report.phases if p.name == phase)
  if not len(values):
    return None
  if isinstance(now, str):  # A choice: each value in its order (the first costs least) until one fits.
    for value in values:
      if (got := needs(report, phase, {field: value})) is not None and got[0] <= allowed:
        return _said(field, value, phase, got[0])
    return None
  points = {} if refused(current) else {now: current.needs}  # Value: a figure the compiler measured.

  def at(value) -> float | None:
    got = needs(report, phase, {field: value})
    if got is not None and not got[1]:
      points[value] = got[0]
    return None if got is None else got[0]

  second = _nearest(values, now / 2)
  if at(second) is None or second not in points:
    return None
  if len(points) < 2 and (third := _nearest(values, second / 2)) != second:
    at(third)
  fitting = lambda: max((v for v, f in points.items() if f <= allowed and v != now), default=None)
  if len(points) < 2:
    return _said(field, second, phase, points[second]) if points[second] <= allowed else None
  (a, fa), (b, fb) = sorted(points.items(), reverse=True)[:2]
  if fa <= fb:
    return None  # Lowering it lowers nothing.
  aim = a - (fa - allowed) * (a - b) / (fa - fb)
  if (i := _first_at_most(values, aim)) == len(values):
    return None
  value = values[i]
  figure = points[value] if value in points else at(value)
  if value in points and figure <= allowed:
    return _said(field, value, phase, figure)
  if (best := fitting()) is not None:  # The line aimed too high; a value compiled on the way fits.
    return _said(field, best, phase, points[best])
  shown = "not a valid config" if figure is None else f"compiled: {phase} needs {readable_bytes(figure)}"
  return f"{field} below {value} ({shown}; the line through two compiles aimed at {value})"


def fixes(report, phase: str) -> list[str]:
  """Each setting's fix for `phase` of `report` (one to three compiles each; see the module docstring)."""
  return [fix for field, now, values in settings(report, phase)
          if (fix := search(report, phase, field, now, values)) is not None]


def remat_policies(report, log=lambda message: None) -> list[tuple[str, float | None, float | None]]:
  """The update compiled under each `model.remat` policy, least recomputation first: (policy, bytes per device
  it needs, its programs' compiled FLOPs per device (cost analysis, a loop body once)); (policy, None, None)
  where the config refuses it. The report's own policy is read from the report, not compiled again; `log` says
  each compile as it goes."""
  rows = []
  for policy in REMAT:
    if policy == report.config.model.remat:
      phase = next(p for p in report.phases if p.name == "update")
    else:
      try:
        config = overrides.replace_fields(report.config, {"model.remat": policy})
        again = xla_report.compile_run(config, report.target, layers=report.layers, phases=("update",),
                                       log=log)
      except (ConfigError, ValueError, MemoryError):
        rows.append((policy, None, None))
        continue
      phase = next(p for p in again.phases if p.name == "update")
    rows.append((policy, phase.needs, sum(p.flops for p in phase.programs)))
  return rows


def least_recomputation(rows, allowed: float) -> str | None:
  """The first policy of `remat_policies`' rows that fits in `allowed` bytes (None: none fits)."""
  return next((policy for policy, needs_, _ in rows if needs_ is not None and needs_ <= allowed), None)
