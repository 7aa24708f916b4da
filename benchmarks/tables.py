"""The benchmarks' tables: a `Table` of measured rows, a `RatioTarget` (a measured ratio against its
target), `print_table` (aligned columns), `targets_table` (each target, measured, met or not) and
`best_seconds` (functions timed side by side, best of interleaved calls).
"""

import time
from collections.abc import Callable
from typing import NamedTuple

import jax


class Table(NamedTuple):
  title: str
  header: tuple[str, ...]
  rows: list[tuple]


class RatioTarget(NamedTuple):
  """One measured ratio against its target: `value op bound` (op "<=" or ">=")."""

  name: str
  value: float
  op: str
  bound: float

  @property
  def met(self) -> bool:
    return self.value <= self.bound if self.op == "<=" else self.value >= self.bound


def _cell(x) -> str:
  return f"{x:,.3f}" if isinstance(x, float) else str(x)


def print_table(table: Table) -> None:
  cells = [table.header] + [tuple(_cell(x) for x in row) for row in table.rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(table.header))]
  print(f"\n{table.title}")
  for i, row in enumerate(cells):
    print("  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
    if i == 0:
      print("  " + "  ".join("-" * w for w in widths))


def targets_table(targets: list[RatioTarget]) -> Table:
  rows = [(t.name, t.value, f"{t.op} {t.bound:g}", "yes" if t.met else "NO") for t in targets]
  return Table("targets", ("ratio", "measured", "target", "met"), rows)


def best_seconds(fns: dict[str, Callable], *args, repeats: int) -> dict[str, float]:
  """Best wall time of each function, calls interleaved (a, b, a, b, ...) after a warm-up call each,
  so that the ratio of two is measured side by side under the same load."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  return best
