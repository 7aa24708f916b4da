"""A sweep's report: runs.csv (a row per run), table.md (per member, over seeds, against the full
method and the paper's row) and plots/*.png (curves per member), rebuilt from the runs' own
metrics.jsonl and summary.json after every finished run (`cli/sweep.py`)."""

import csv
import io
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from experiments import variants
from vapo_jax import files
from vapo_jax.cli import plots

# (file name, title, y label, metric) of the sweep's plots.
FIGURES = [("heldout_accuracy", "Held-out accuracy", "avg@k accuracy", "eval/accuracy"),
           ("response_length", "Response length (training rollouts)", "tokens", "rollout/response_len_mean"),
           ("entropy", "Policy entropy", "nats per token", "actor/entropy"),
           ("explained_variance", "Critic explained variance (value pretraining at x < 0)",
            "1 − Var[R − V] / Var[R]", "critic/explained_variance")]
CSV_FIELDS = ["member", "seed", "run", "status", "rl_steps", "accuracy_before", "accuracy_final", "accuracy_best",
              "accuracy_auc", "seconds", "log"]


def run_result(run) -> tuple[dict, dict[str, plots.Curve]]:
  """A run's (a `sweep.Run`'s) CSV row (without status) and its curves on the RL-steps-done axis."""
  row = {"member": run.member, "seed": run.seed, "run": run.name, "log": run.log}
  path = os.path.join(run.directory, "metrics.jsonl")
  curves = plots.run_curves(plots.read_metrics(path)) if os.path.isfile(path) else {}
  if "eval/accuracy" in curves:
    x, y = curves["eval/accuracy"]
    during = x > 0
    row |= {"rl_steps": int(x[-1]), "accuracy_final": float(y[-1]),
            "accuracy_before": float(y[x == 0][0]) if np.any(x == 0) else None,
            "accuracy_best": float(y[during].max()) if np.any(during) else None,
            "accuracy_auc": area_under_curve(x, y)}
  summary = os.path.join(run.directory, "summary.json")
  if os.path.isfile(summary):
    with open(summary) as f:
      row["seconds"] = json.load(f).get("seconds")
  return row, curves


def area_under_curve(x: np.ndarray, y: np.ndarray) -> float | None:
  """Trapezoid area under y(x) over x ≥ 0, divided by the x range: the curve's mean height."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  keep = x >= 0
  x, y = x[keep], y[keep]
  if len(x) < 2 or x[-1] == x[0]:
    return float(y[0]) if len(y) else None
  return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))


def _stats(values: list) -> tuple[float, float, int] | None:
  values = [v for v in values if v is not None]
  if not values:
    return None
  return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else float("nan"), len(values)


def _fmt(stats, digits: int = 3) -> str:
  if stats is None:
    return "–"
  mean, std, n = stats
  return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(sweep: str, members: Sequence[str], rows: Sequence[dict]) -> str:
  """Mean ± std over seeds of each member's finished runs, and the difference of means to the first."""
  done = [r for r in rows if r.get("status") in ("done", "skipped")]
  columns = ["accuracy_before", "accuracy_final", "accuracy_best", "accuracy_auc"]
  by_member = {m: {c: _stats([r.get(c) for r in done if r["member"] == m]) for c in columns} for m in members}
  reference = by_member[members[0]]
  lines = [f"# Sweep `{sweep}`", "",
           f"Held-out accuracy of finished runs: mean ± sample std over seeds. Δ: difference of the mean to "
           f"`{members[0]}` (the full method). AUC: area under the held-out accuracy curve over the RL steps "
           "divided by their number. Paper: AIME 2024 avg@32 of the same row (Qwen2.5-32B; arXiv 2504.05118).", "",
           "| member | seeds | before RL | final | best | AUC | Δ final | Δ AUC | paper |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for member in members:
    stats = by_member[member]
    seeds = sum(1 for r in done if r["member"] == member)
    delta = []
    for column in ("accuracy_final", "accuracy_auc"):
      if member == members[0] or stats[column] is None or reference[column] is None:
        delta.append("–")
      else:
        delta.append(f"{stats[column][0] - reference[column][0]:+.3f}")
    paper = variants.paper_score(member)
    lines.append(f"| `{member}` | {seeds} | " + " | ".join(_fmt(stats[c]) for c in columns) + " | "
                 + " | ".join(delta) + f" | {'–' if paper is None else paper} |")
  missing = [r for r in rows if r.get("status") not in ("done", "skipped")]
  if missing:
    lines += ["", "Not finished (left out above):", ""]
    lines += [f"- `{r['run']}`: {r.get('status', 'not run')}; log `{r['log']}`" for r in missing]
  lines += ["", "Plots: " + ", ".join(f"[{name}](plots/{name}.png)" for name, *_ in FIGURES), ""]
  return "\n".join(lines)


def write_report(sweep: str, members: Sequence[str], runs: Sequence, status: dict[str, str],
                 sweep_dir: str, *, stream=sys.stdout) -> dict[str, str]:
  """Writes runs.csv, table.md and plots/*.png of the sweep's `Run`s; returns {what: path}."""
  rows, curves = [], {}
  for run in runs:
    row, run_curves = run_result(run)
    row["status"] = status.get(run.name, "done" if run.finished else "not run")
    rows.append(row)
    if run.finished:
      for _, _, _, metric in FIGURES:
        if metric in run_curves:
          curves.setdefault(metric, {}).setdefault(run.member, []).append(run_curves[metric])
  written = {"csv": os.path.join(sweep_dir, "runs.csv"), "table": os.path.join(sweep_dir, "table.md")}
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=CSV_FIELDS, extrasaction="ignore")
  writer.writeheader()
  writer.writerows(rows)
  with files.reporting_disk_full(sweep_dir, "writing the sweep's report", after="then report again: "
                                 f"python -m vapo_jax.cli.sweep {sweep} --report"):
    os.makedirs(sweep_dir, exist_ok=True)
    files.write_atomically(written["csv"], table.getvalue())
    files.write_atomically(written["table"], markdown_table(sweep, members, rows))
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print('note: no plots (matplotlib is missing: pip install -e ".[plot]")', file=stream)
    return written
  for filename, title, ylabel, metric in FIGURES:
    lines = {member: curves[metric][member] for member in members if member in curves.get(metric, {})}
    if lines:
      written[filename] = plots.plot_curves(lines, title=f"{sweep}: {title}", ylabel=ylabel,
                                            path=os.path.join(sweep_dir, "plots", f"{filename}.png"))
  return written
