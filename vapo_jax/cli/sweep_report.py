"""A sweep's report: runs.csv (a row per run), table.md (per member over seeds: accuracy, paired
differences to the full method, the paper's row, and the mechanism metrics) and plots/*.png (a
figure per metric with a line per member, and a panel figure per member), rebuilt from the runs' own
metrics.jsonl and summary.json after every finished run (`cli/sweep.py`).

Paired statistics. The members of one seed share the warm start, the reward model, the data order,
the first rollout's keys and every evaluation's keys (`train/held_out.evaluation_key`), so their
difference on that seed, d_s = x_member,s − x_reference,s, is free of much of the noise each carries.
Over the n seeds both finished: Δ = mean(d), SE = sd(d)/√n (sample sd), and the minimum detectable
effect MDE = (t_{1−α/2, n−1} + t_{power, n−1})·SE with α = 0.05 and power 0.8: the smallest true Δ a
two-sided paired t-test finds 80 % of the time, were the seeds' spread what this sample shows.
"""

import csv
import io
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from experiments import variants
from vapo_jax import files
from vapo_jax.cli import plots

# (file name, title, y label, metric) of the sweep's figures: one line per member.
FIGURES = [("heldout_accuracy", "Held-out accuracy", "avg@k accuracy", "eval/accuracy"),
           ("response_length", "Response length (training rollouts)", "tokens", "rollout/response_len_mean"),
           ("entropy", "Policy entropy", "nats per token", "actor/entropy"),
           ("explained_variance", "Critic explained variance (value pretraining at x < 0)",
            "1 − Var[R − V] / Var[R]", "critic/explained_variance"),
           ("early_advantage", "Mean advantage over the first 10 % of response tokens (unwhitened)",
            "advantage",
            "adv/early_mean_unwhitened"),
           ("value_bias_first_decile", "Critic bias V − G over the first 10 % of response tokens", "V − G",
            "critic/value_bias_decile_0"),
           ("clip_frac_high", "Tokens clipped above (ratio > 1 + ε_high, Â > 0)", "fraction",
            "actor/clip_frac_high"),
           ("clip_frac_low", "Tokens clipped below (ratio < 1 − ε_low, Â < 0)", "fraction",
            "actor/clip_frac_low")]
DECILES = [f"critic/value_bias_decile_{k}" for k in range(10)]
# (column, label in table.md, metric): each averaged over a run's first and last WINDOW RL steps.
MECHANISMS = [("early_adv", "early Â (reward units)", "adv/early_mean_unwhitened"),
              ("early_adv_whitened", "early Â (whitened)", "adv/early_mean"),
              ("bias_first_decile", "V − G, first decile", DECILES[0]),
              ("bias_last_decile", "V − G, last decile", DECILES[-1]),
              ("clip_low", "clip low", "actor/clip_frac_low"),
              ("clip_high", "clip high", "actor/clip_frac_high"),
              ("length", "length", "rollout/response_len_mean")]
WINDOW = 10
ACCURACY = ["accuracy_before", "accuracy_final", "accuracy_best", "accuracy_auc"]
CSV_FIELDS = (["member", "seed", "run", "status", "rl_steps", *ACCURACY]
              + [f"{c}_{end}" for c, _, _ in MECHANISMS for end in ("start", "end")] + ["seconds", "log"])


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
  for column, _, metric in MECHANISMS:
    if metric in curves:
      x, y = curves[metric]
      y = y[x >= 0]  # RL steps only (value pretraining is at x < 0).
      row |= {f"{column}_start": float(np.mean(y[:WINDOW])),
              f"{column}_end": float(np.mean(y[-WINDOW:]))} if len(y) else {}
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


class Paired(NamedTuple):
  """A member's difference to the reference over the seeds both finished (module docstring)."""

  delta: float  # Mean of the per-seed differences.
  se: float  # Their standard error, sd/√n (NaN for n = 1).
  n: int  # Seeds.
  mde: float  # Minimum detectable effect (NaN for n = 1).


def minimum_detectable_effect(se: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
  """(t_{1−α/2, n−1} + t_{power, n−1})·SE: the smallest true difference a two-sided paired t-test at
  level α detects with probability `power` (NaN for n < 2)."""
  from scipy import stats  # A dependency of JAX; only the report needs it.

  if n < 2 or not math.isfinite(se):
    return float("nan")
  return float((stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * se)


def paired_difference(rows: Sequence[dict], member: str, reference: str, column: str) -> Paired | None:
  """`member` − `reference` in `column`, seed by seed, over the seeds where both have a value."""
  by_seed = lambda m: {int(r["seed"]): r[column] for r in rows if r["member"] == m and r.get(column) is not None}
  mine, theirs = by_seed(member), by_seed(reference)
  d = np.array([mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())], np.float64)
  if not len(d):
    return None
  se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
  return Paired(float(np.mean(d)), se, len(d), minimum_detectable_effect(se, len(d)))


def _stats(values: list) -> tuple[float, float, int] | None:
  values = [v for v in values if v is not None]
  if not values:
    return None
  return float(np.mean(values)), float(np.std(values,
                                              ddof=1)) if len(values) > 1 else float("nan"), len(values)


def _fmt(stats, digits: int = 3) -> str:
  if stats is None:
    return "–"
  mean, std, n = stats
  return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_paired(paired: Paired | None) -> tuple[str, str]:
  """(Δ ± SE, MDE) cells."""
  if paired is None:
    return "–", "–"
  if paired.n == 1:
    return f"{paired.delta:+.3f} (1 seed)", "–"
  return f"{paired.delta:+.3f} ± {paired.se:.3f}", f"{paired.mde:.3f}"


def markdown_table(sweep: str, members: Sequence[str], rows: Sequence[dict],
                   plotted: Sequence[str] = ()) -> str:
  """Accuracy per member (mean ± std over seeds), paired differences to the first member with their
  SE and MDE, the paper's row, the mechanism metrics at the start and end of RL, and links to the
  plots written (`plotted`: their names, `plots/<name>.png`)."""
  done = [r for r in rows if r.get("status") in ("done", "skipped")]
  reference = members[0]
  lines = [f"# Sweep `{sweep}`", "",
           "Held-out accuracy of finished runs: mean ± sample std over seeds. Δ: the difference to "
           f"`{reference}` (the full method) on the same seed, averaged over the seeds both finished, ± its "
           "standard error; MDE: the smallest true Δ a two-sided paired t-test (α = 0.05) detects with 80 % "
           "power at that SE, (t_{0.975,n−1} + t_{0.8,n−1})·SE. AUC: area under the held-out accuracy curve "
           "over the RL steps divided by their number. Paper: AIME 2024 avg@32 of the same row (Qwen2.5-32B; "
           "arXiv 2504.05118).", "",
           "| member | seeds | before RL | final | AUC | Δ final | MDE final | Δ AUC | MDE AUC | paper |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for member in members:
    mine = [r for r in done if r["member"] == member]
    cells = [_fmt(_stats([r.get(c) for r in mine])) for c in ("accuracy_before", "accuracy_final",
                                                              "accuracy_auc")]
    for column in ("accuracy_final", "accuracy_auc"):
      paired = None if member == reference else paired_difference(done, member, reference, column)
      cells += ["–", "–"] if paired is None else _fmt_paired(paired)
    paper = variants.paper_score(member)
    lines.append(f"| `{member}` | {len(mine)} | " + " | ".join(cells) + f" | {'–' if paper is None else paper} |")
  lines += ["", f"Mechanisms: each run's mean over its first → last {WINDOW} RL steps, then the mean over "
            "seeds. Early Â: the mean advantage over the first 10 % of each response's tokens (0 in "
            "expectation under an unbiased critic, in reward units); V − G: the critic's bias against the "
            "Monte-Carlo return.", "",
            "| member | " + " | ".join(label for _, label, _ in MECHANISMS) + " |",
            "| --- |" + " ---: |" * len(MECHANISMS)]
  for member in members:
    mine = [r for r in done if r["member"] == member]
    cells = []
    for column, _, _ in MECHANISMS:
      start, end = (_stats([r.get(f"{column}_{e}") for r in mine]) for e in ("start", "end"))
      digits = 1 if column == "length" else 3
      cells.append("–" if start is None else f"{start[0]:.{digits}f} → {end[0]:.{digits}f}")
    lines.append(f"| `{member}` | " + " | ".join(cells) + " |")
  missing = [r for r in rows if r.get("status") not in ("done", "skipped")]
  if missing:
    lines += ["", "Not finished (left out above):", ""]
    lines += [f"- `{r['run']}`: {r.get('status', 'not run')}; log `{r['log']}`" for r in missing]
  figures = [name for name, *_ in FIGURES if name in plotted]
  panels = [m for m in members if f"mechanism_{m}" in plotted]
  if figures or panels:
    lines += ["", "Plots: " + ", ".join(f"[{name}](plots/{name}.png)" for name in figures)
              + ("; per member: " + ", ".join(f"[{m}](plots/mechanism_{m}.png)" for m in panels) if panels else "")]
  return "\n".join(lines + [""])


def read_rows(path: str) -> list[dict]:
  """The rows of a runs.csv, numbers as floats (the seed and RL steps as ints), empty cells as None."""
  def value(key, text):
    if text == "" or key in ("member", "run", "status", "log"):
      return text or None
    return int(text) if key in ("seed", "rl_steps") else float(text)
  with open(path, newline="") as f:
    return [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def _member_panels(member: str, curves: dict[str, list]) -> list:
  """The mechanism figure's panels of one member: accuracy beside what the critic does to the actor."""
  pick = lambda pairs: {label: curves[metric] for label, metric in pairs if metric in curves}
  return [("Held-out accuracy", "avg@k", pick([("held-out", "eval/accuracy")])),
          ("Response length", "tokens", pick([("mean", "rollout/response_len_mean")])),
          ("Advantage over the first 10 % of tokens", "Â", pick([("unwhitened", "adv/early_mean_unwhitened"),
                                                                  ("whitened", "adv/early_mean")])),
          ("Critic bias V − G by decile (x < 0: value pretraining)", "V − G",
           pick([(f"decile {k + 1}", metric) for k, metric in enumerate(DECILES)])),
          ("Clipped tokens", "fraction", pick([("low (Â < 0)", "actor/clip_frac_low"),
                                               ("high (Â > 0)", "actor/clip_frac_high")])),
          ("Critic explained variance", "EV", pick([("EV", "critic/explained_variance")]))]


def write_report(sweep: str, members: Sequence[str], runs: Sequence, status: dict[str, str],
                 sweep_dir: str, *, stream=sys.stdout) -> dict[str, str]:
  """Writes runs.csv, table.md and plots/*.png of the sweep's `Run`s; returns {what: path}."""
  rows, curves = [], {}  # curves[member][metric]: one curve per finished run.
  for run in runs:
    row, run_curves = run_result(run)
    row["status"] = status.get(run.name, "done" if run.finished else "not run")
    rows.append(row)
    if run.finished:
      for metric, curve in run_curves.items():
        curves.setdefault(run.member, {}).setdefault(metric, []).append(curve)
  written = {"csv": os.path.join(sweep_dir, "runs.csv"), "table": os.path.join(sweep_dir, "table.md")}
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=CSV_FIELDS, extrasaction="ignore")
  writer.writeheader()
  writer.writerows(rows)
  report = lambda: files.reporting_write_failures(sweep_dir, "writing the sweep's report",
                                                  after="then report "
                                                  f"again: python -m vapo_jax.cli.sweep {sweep} --report")
  with report():
    os.makedirs(sweep_dir, exist_ok=True)
    files.write_atomically(written["csv"], table.getvalue())
  plotted = _write_plots(sweep, members, curves, sweep_dir, stream)
  with report():  # Last: it links only the plots written.
    files.write_atomically(written["table"], markdown_table(sweep, members, rows, plotted))
  return written | plotted


def _write_plots(sweep: str, members: Sequence[str], curves: dict, sweep_dir: str, stream) -> dict[str, str]:
  """The sweep's figures and each member's mechanism panels (members with a finished run): {name: path}."""
  written = {}
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print('note: no plots (matplotlib is missing: pip install -e ".[plot]")', file=stream)
    return written
  for filename, title, ylabel, metric in FIGURES:
    lines = {m: curves[m][metric] for m in members if metric in curves.get(m, {})}
    if lines:
      written[filename] = plots.plot_curves(lines, title=f"{sweep}: {title}", ylabel=ylabel,
                                            path=os.path.join(sweep_dir, "plots", f"{filename}.png"))
  for member in [m for m in members if m in curves]:
    written[f"mechanism_{member}"] = plots.plot_panels(
        _member_panels(member, curves[member]), title=f"{sweep}: {member}",
        path=os.path.join(sweep_dir, "plots", f"mechanism_{member}.png"))
  return written
