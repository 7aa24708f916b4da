"""Held-out accuracy's statistics, from an evaluation's verdicts (problem by problem, `k` samples each).

  accuracy_stderr(verdicts, k)              # avg@k's standard error over the problems
  accuracy_by_level(verdicts, levels, k)    # {level: avg@k of that level's problems}
"""

import numpy as np


def accuracy_by_level(verdicts: np.ndarray, levels: list[int | None], k: int) -> dict[int, float]:
  """avg@k over the problems of each level (`levels`, problem by problem; `verdicts`, `k` a problem in the same
  order); {} when no problem has a level."""
  per_problem = np.asarray(verdicts, np.float64).reshape(-1, k).mean(axis=1)
  return {level: float(per_problem[[x == level for x in levels]].mean())
          for level in sorted({x for x in levels if x is not None})}


def accuracy_stderr(verdicts: np.ndarray, k: int) -> float:
  """The standard error of avg@k over problems: the sample standard deviation of the problems' accuracies (each the
  mean of its `k` verdicts, `verdicts` problem by problem) over √problems; 0 for one problem."""
  per_problem = np.asarray(verdicts, np.float64).reshape(-1, k).mean(axis=1)
  return float(per_problem.std(ddof=1) / np.sqrt(len(per_problem))) if len(per_problem) > 1 else 0.0
