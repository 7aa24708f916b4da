"""PNG plots of a run's curves from its metrics.jsonl (matplotlib; `pip install -e ".[plot]"`).

  make plot RUN=runs/tiny_vapo                # → runs/tiny_vapo/plots/*.png
  python -m vapo_jax.cli.plots runs/a runs/b --out plots/   # several runs, one line each

`plot_curves` is the drawing core, shared with the sweep plots: one line per label, and where a
label has several runs (seeds), their mean with a band from their minimum to their maximum.

The x axis counts RL steps done: a step's rollout metrics (`rollout/`, `actor/`, `adv/`, ...) are
plotted at its step s (sampled by the policy after s updates), the held-out `eval/` results at the
number of updates behind them (0 before RL, s + 1 after step s, `rl_steps` after RL), and value
pretraining (`critic/` curves) at negative steps, from −value_pretrain_steps to −1.
"""

import io
import json
import os
import sys
import warnings
from collections.abc import Sequence

import numpy as np

from vapo_jax import files, metric_keys
from vapo_jax.cli import ArgumentParser, one_line_warnings
from vapo_jax.errors import USER_ERROR_EXIT_CODE, UserError, counted

Curve = tuple[np.ndarray, np.ndarray]  # (x [N], y [N]) of one run.

# (file name, title, y label, [(label, metric)]); a metric absent from a run is left out, and a
# figure without any of its metrics is not drawn.
FIGURES = [
    ("reward_accuracy", "Reward and accuracy", "mean / fraction",
     [("training reward", "rollout/reward_mean"), ("training accuracy", "rollout/accuracy"),
      ("held-out accuracy", "eval/accuracy")]),
    ("response_length", "Response length", "tokens",
     [("mean", "rollout/response_len_mean"), ("max", "rollout/response_len_max"),
      ("held-out mean", "eval/response_len_mean")]),
    ("truncated", "Responses cut at the length limit", "fraction", [("truncated", "rollout/truncated_frac")]),
    ("entropy", "Policy entropy", "nats per token",
     [("sampling policy, on the batch", "actor/entropy"),
      ("the loss's entropy term (updated policy)", "actor/entropy_term")]),
    ("explained_variance", "Critic explained variance", "1 − Var[R − V] / Var[R]",
     [("explained variance", "critic/explained_variance")]),
    ("early_advantage", "Mean advantage over the first 10 % of each response's tokens", "advantage",
     [("as the actor sees it (whitened)", "adv/early_mean"),
      ("in reward units", "adv/early_mean_unwhitened")]),
    ("value_bias", "Critic bias V − G by decile of the response (G: Monte-Carlo return)", "V − G",
     [(f"decile {k + 1}", f"critic/value_bias_decile_{k}") for k in range(10)]),
    ("clip_fractions", "Clipped token fractions", "fraction of tokens",
     [("ratio < 1 − ε_low (Â < 0)", "actor/clip_frac_low"),
      ("ratio > 1 + ε_high (Â > 0)", "actor/clip_frac_high"),
      ("dual clip", "actor/dual_clip_frac"), ("value clip", "critic/clip_frac")]),
    ("lam_actor", "λ_actor (length-adaptive GAE)", "λ",
     [("mean", "adv/lam_actor_mean"), ("min", "adv/lam_actor_min"), ("max", "adv/lam_actor_max")]),
    ("kl_logprob_gap", "KL and log-prob gap", "nats per token",
     [("KL(π_old ‖ π), k3", "actor/approx_kl"), ("KL(π ‖ π_ref)", "actor/ref_kl"),
      ("|log π_sample − log π_train|", "rollout/logprob_gap")]),
    ("scoring", "Responses without an answer, or whose scoring failed", "fraction of responses",
     [("no answer", "reward/no_answer_frac"), ("reward function error", "reward/error_frac")]),
    ("time", "Time per step", "seconds",
     [("step", "time/step_s"), ("sampling", "time/rollout_s"), ("verifier", "time/verify_s"),
      ("log-probs and values", "time/logprobs_values_s"), ("updates", "time/update_s")]),
    ("losses", "Losses", "loss",
     [("policy gradient", "actor/pg_loss"), ("positive-example NLL", "actor/nll_loss"),
      ("value", "critic/value_loss")]),
]


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics.jsonl; lines that are not JSON records are skipped with one warning,
  and of records with the same stage and step the last is kept."""
  records, bad = {}, []
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      try:
        record = metric_keys.current(json.loads(line))
        records[(record["stage"], record["step"])] = record
      except (ValueError, KeyError, TypeError):
        if line.strip():
          bad.append(number)
  if bad:
    warnings.warn(f"{path}: skipped {counted(len(bad), 'line')} that {'is' if len(bad) == 1 else 'are'} not "
                  f"a metric record (first: line {bad[0]})", stacklevel=2)
  return list(records.values())


def run_curves(records: Sequence[dict]) -> dict[str, Curve]:
  """Each metric's (x, y) on the RL-steps-done axis (see the module docstring); non-finite y dropped."""
  vp_steps = 1 + max((r["step"] for r in records if r["stage"] == "value_pretrain"), default=-1)
  points: dict[str, list[tuple[float, float]]] = {}
  for r in records:
    stage, step = r["stage"], r["step"]
    for key, value in r.items():
      if key in ("stage", "step") or not isinstance(value, (int, float)):
        continue
      if stage == "rl":
        x = step + 1 if key.startswith("eval/") else step
      elif stage in ("eval_before_rl", "eval_after_rl"):
        x = step
      elif stage == "value_pretrain":
        x = step - vp_steps
      else:
        continue  # SFT: its own axis (`sft_curves`).
      if np.isfinite(value):
        points.setdefault(key, []).append((x, value))
  return {key: _sorted(xy) for key, xy in points.items()}


def _sorted(xy: list[tuple[float, float]]) -> Curve:
  xy = sorted(xy)
  return np.array([x for x, _ in xy], np.float64), np.array([y for _, y in xy], np.float64)


def aggregate(runs: Sequence[Curve]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(x, mean, min, max) over runs: each run's y interpolated onto the union of their x values,
  within the range every run covers. Each run's x must be increasing."""
  x = np.unique(np.concatenate([np.asarray(rx, np.float64) for rx, _ in runs]))
  x = x[(x >= max(rx[0] for rx, _ in runs)) & (x <= min(rx[-1] for rx, _ in runs))]
  ys = np.stack([np.interp(x, rx, ry) for rx, ry in runs])  # [R, N]
  return x, ys.mean(0), ys.min(0), ys.max(0)


def draw_curves(ax, curves: dict[str, list[Curve]], *, markers: bool | None = None,
                colors: Sequence | None = None, band_alpha: float = 0.2) -> int:
  """Draws one line per label onto matplotlib axes `ax`; returns the most runs behind one line.

  `curves[label]` holds one (x, y) per run. One run: its points. Several (seeds): their mean over
  the x range all of them cover (each interpolated onto the union of their x there), with a band
  from their minimum to their maximum. `markers` None: dots on lines of at most 30 points.
  `colors`: one per label (None: the axes' cycle)."""
  banded = 0
  for i, (label, runs) in enumerate(curves.items()):
    runs = [(np.asarray(x, np.float64), np.asarray(y, np.float64)) for x, y in runs if len(x)]
    if not runs:
      continue
    x, mean, lo, hi = aggregate(runs)
    banded = max(banded, len(runs))
    marker = "o" if (len(x) <= 30 if markers is None else markers) else None
    color = None if colors is None else colors[i]
    (line,) = ax.plot(x, mean, marker=marker, markersize=3.5, linewidth=1.4, color=color,
                      label=label if len(runs) == 1 else f"{label} (mean of {len(runs)})")
    if len(runs) > 1 and band_alpha:
      ax.fill_between(x, lo, hi, color=line.get_color(), alpha=band_alpha, linewidth=0)
  return banded


def plot_curves(curves: dict[str, list[Curve]], *, title: str, ylabel: str, path: str,
                xlabel: str = "RL step", markers: bool | None = None, below_zero: str | None = None) -> str:
  """Draws one line per label (`draw_curves`) into a PNG at `path`; returns the path. `below_zero`
  names the stage before x = 0 (shaded, when any line reaches there)."""
  import matplotlib
  matplotlib.use("Agg")  # Files only; no display needed.
  import matplotlib.pyplot as plt

  many = len(curves) > 6  # A sweep's members: distinct colours, lighter bands, the legend beside the axes.
  fig, ax = plt.subplots(figsize=(10, 4.6) if many else (7, 4.2), dpi=110)
  if len(curves) > 10:  # The default cycle repeats after 10 colours.
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
  banded = draw_curves(ax, curves, markers=markers, band_alpha=0.08 if many else 0.2)
  if below_zero and any(len(line.get_xdata()) and min(line.get_xdata()) < 0 for line in ax.get_lines()):
    xlim = ax.get_xlim()
    ax.axvspan(xlim[0], -0.5, color="0.5", alpha=0.12, linewidth=0, label=below_zero)
    ax.set_xlim(xlim)
  _label(ax, title + ("  (bands: min–max over runs)" if banded > 1 else ""), xlabel, ylabel)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, **(dict(loc="upper left", bbox_to_anchor=(1.01, 1.0)) if many else {}))
  return _save(fig, path)


def plot_panels(panels: Sequence[tuple[str, str, dict[str, list[Curve]]]], *, title: str, path: str,
                columns: int = 3) -> str:
  """Several `draw_curves` panels, each (title, y label, curves), in one PNG at `path`; returns the
  path. A panel of more than 6 lines colours them along a colour map (ordered lines: deciles)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = -(-len(panels) // columns)
  fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), dpi=100, squeeze=False)
  for ax, (panel_title, ylabel, curves) in zip(axes.flat, panels):
    ordered = len(curves) > 6
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.95, len(curves))) if ordered else None
    draw_curves(ax, curves, colors=colors, band_alpha=0 if ordered else 0.2)
    if ordered:
      ax.axhline(0.0, color="0.6", linewidth=0.6)
    _label(ax, panel_title, "RL step", ylabel)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=6 if ordered else 7, ncol=2 if ordered else 1)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(title + "  (mean over seeds; bands: min–max)")
  return _save(fig, path)


def _label(ax, title: str, xlabel: str, ylabel: str) -> None:
  ax.set_title(title, fontsize=10)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)


def _save(fig, path: str) -> str:
  import matplotlib.pyplot as plt

  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png")
  plt.close(fig)
  directory = os.path.dirname(os.path.abspath(path))
  with files.reporting_write_failures(directory, f"writing {os.path.basename(path)}", elsewhere="--out=",
                                 after="then draw the plots again"):
    os.makedirs(directory, exist_ok=True)
    files.write_atomically(path, png.getvalue())  # Whole or not at all.
  return path


def plot_runs(runs: dict[str, str], out_dir: str, *, only: tuple[str, ...] | None = None) -> list[str]:
  """The FIGURES (and SFT's loss, "sft") of runs given as {name: metrics.jsonl path}, or those named in
  `only`; returns the PNGs written. With several runs each line is labelled `run: metric`."""
  per_run = {name: read_metrics(path) for name, path in runs.items()}
  curves = {name: run_curves(records) for name, records in per_run.items()}
  written = []
  for filename, title, ylabel, metrics in FIGURES:
    if only is not None and filename not in only:
      continue
    lines = {}
    for name, run in curves.items():
      for label, key in metrics:
        if key in run:
          lines[label if len(runs) == 1 else f"{name}: {label}"] = [run[key]]
    if lines:
      written.append(plot_curves(lines, title=title, ylabel=ylabel,
                                 path=os.path.join(out_dir, f"{filename}.png"),
                                 below_zero="value pretraining"))
  sft = {name: _sorted([(r["step"], r["sft/nll"]) for r in records if r["stage"] == "sft" and "sft/nll" in r])
         for name, records in per_run.items()}
  sft = {name: [xy] for name, xy in sft.items() if len(xy[0])}
  if sft and (only is None or "sft" in only):
    written.append(plot_curves(sft, title="Supervised warm-up", ylabel="NLL per token", xlabel="SFT step",
                               path=os.path.join(out_dir, "sft.png")))
  return written


def main(argv: Sequence[str]) -> int:
  parser = ArgumentParser(prog="python -m vapo_jax.cli.plots", description=__doc__.split("\n\n")[0])
  parser.add_argument("runs", nargs="+", help="run directories (runs/<name>) or their metrics.jsonl files")
  parser.add_argument("--out", help="where to write the PNGs (default: <run>/plots for one run, else plots/)")
  args = parser.parse_args(argv)
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print('error: plotting needs matplotlib: pip install -e ".[plot]" (make plot installs it)',
          file=sys.stderr)
    return 2
  runs = {}
  for run in args.runs:
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
      print(f"error: {path}: no such file (give a run directory holding metrics.jsonl, e.g. runs/tiny_vapo)",
            file=sys.stderr)
      return 2
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    runs[name if name not in runs else run] = path
  out = args.out or (os.path.join(os.path.dirname(next(iter(runs.values()))),
                                  "plots") if len(runs) == 1 else "plots")
  try:
    written = plot_runs(runs, out)
  except UserError as e:  # A full disk.
    print(f"error: {e}", file=sys.stderr)
    return USER_ERROR_EXIT_CODE
  if not written:
    print(f"error: no metric records in {', '.join(runs.values())} to plot", file=sys.stderr)
    return 2
  print("\n".join(written))
  return 0


if __name__ == "__main__":
  with one_line_warnings():
    sys.exit(main(sys.argv[1:]))
