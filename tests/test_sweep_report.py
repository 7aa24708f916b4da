"""The sweep's table from a synthetic runs.csv with a known answer: paired differences to the full
method by seed, their standard error and the minimum detectable effect, and the mechanism columns."""

import csv
import math

import pytest

from vapo_jax.cli import sweep_report

# Closed forms of Student's t quantiles: 1 degree of freedom, tan(π(p − ½)); 2, (2p − 1)/√(2p(1 − p)).
T1 = {0.975: math.tan(math.pi * 0.475), 0.8: math.tan(math.pi * 0.3)}
T2 = {p: (2 * p - 1) / math.sqrt(2 * p * (1 - p)) for p in (0.975, 0.8)}
MEMBERS = ["toy_vapo", "toy_ppo", "toy_grpo", "toy_dapo"]


def write_csv(path):
  """toy_vapo and toy_ppo: 3 seeds; toy_grpo: seeds 0 and 1 (its seed 2 failed); toy_dapo: seed 0."""
  finals = {"toy_vapo": [0.30, 0.40, 0.50], "toy_ppo": [0.35, 0.41, 0.58], "toy_grpo": [0.20, 0.36, None],
            "toy_dapo": [0.33, None, None]}
  rows = []
  for member, values in finals.items():
    for seed, final in enumerate(values):
      status = "done" if final is not None else "failed (exit 1)"
      rows.append({"member": member, "seed": seed, "run": f"{member}_seed{seed}", "status": status,
                   "accuracy_before": 0.25, "accuracy_final": final,
                   "accuracy_auc": None if final is None else final - 0.1,
                   "early_adv_start": 0.1 * (seed + 1), "early_adv_end": -0.2, "length_start": 60.0, "length_end": 30.0,
                   "log": f"logs/{member}_seed{seed}.log"})
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=sweep_report.CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


def test_paired_differences_and_minimum_detectable_effect(tmp_path):
  write_csv(tmp_path / "runs.csv")
  rows = sweep_report.read_rows(str(tmp_path / "runs.csv"))
  assert rows[0]["seed"] == 0 and rows[0]["accuracy_final"] == 0.30 and rows[-1]["accuracy_final"] is None
  done = [r for r in rows if r["status"] == "done"]
  # PPO − VAPO by seed: 0.05, 0.01, 0.08.
  d = [0.05, 0.01, 0.08]
  mean = sum(d) / 3
  se = math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)
  ppo = sweep_report.paired_difference(done, "toy_ppo", "toy_vapo", "accuracy_final")
  assert ppo.n == 3 and ppo.delta == pytest.approx(0.14 / 3) and ppo.se == pytest.approx(se)
  assert ppo.se == pytest.approx(0.0202759, abs=1e-7)
  assert ppo.mde == pytest.approx((T2[0.975] + T2[0.8]) * se) and ppo.mde == pytest.approx(0.1087459, abs=1e-7)
  # GRPO on the seeds both finished (0 and 1): −0.10, −0.04; SE = |d₀ − d₁|/2 = 0.03.
  grpo = sweep_report.paired_difference(done, "toy_grpo", "toy_vapo", "accuracy_final")
  assert grpo.n == 2 and grpo.delta == pytest.approx(-0.07) and grpo.se == pytest.approx(0.03)
  assert grpo.mde == pytest.approx((T1[0.975] + T1[0.8]) * 0.03)
  dapo = sweep_report.paired_difference(done, "toy_dapo", "toy_vapo", "accuracy_final")
  assert dapo.n == 1 and dapo.delta == pytest.approx(0.03) and math.isnan(dapo.se) and math.isnan(dapo.mde)
  # The AUC column is final − 0.1 here: the same differences.
  assert sweep_report.paired_difference(done, "toy_ppo", "toy_vapo", "accuracy_auc").delta == pytest.approx(0.14 / 3)


def test_the_table_shows_paired_deltas_their_error_and_the_mde(tmp_path):
  write_csv(tmp_path / "runs.csv")
  table = sweep_report.markdown_table("toy", MEMBERS, sweep_report.read_rows(str(tmp_path / "runs.csv")))
  line = lambda member: next(row for row in table.splitlines() if row.startswith(f"| `{member}` | "))
  assert line("toy_vapo").startswith("| `toy_vapo` | 3 | 0.250 ± 0.000 | 0.400 ± 0.100 | 0.300 ± 0.100 "
                                     "| – | – | – | – |")
  assert "| +0.047 ± 0.020 | 0.109 | +0.047 ± 0.020 | 0.109 | 5.0 |" in line("toy_ppo")
  assert (line("toy_grpo").startswith("| `toy_grpo` | 2 |")
          and f"| -0.070 ± 0.030 | {(T1[0.975] + T1[0.8]) * 0.03:.3f} |" in line("toy_grpo"))
  assert "| +0.030 (1 seed) | – |" in line("toy_dapo")
  assert "`toy_grpo_seed2`: failed (exit 1)" in table
  # Mechanisms: the first window's mean over seeds (0.1, 0.2, 0.3 → 0.2) → the last's.
  mechanisms = table[table.index("Mechanisms:"):]
  ppo = next(row for row in mechanisms.splitlines() if row.startswith("| `toy_ppo` |"))
  assert ppo.startswith("| `toy_ppo` | 0.200 → -0.200 | – |") and ppo.endswith("| 60.0 → 30.0 |")


def test_the_table_links_only_the_plots_written(tmp_path):
  """No link to a plot that was not made (a member that never finished has none)."""
  write_csv(tmp_path / "runs.csv")
  rows = sweep_report.read_rows(str(tmp_path / "runs.csv"))
  first = sweep_report.FIGURES[0][0]
  table = sweep_report.markdown_table("toy", MEMBERS, rows, plotted=[first, "mechanism_toy_vapo"])
  links = [line for line in table.splitlines() if line.startswith("Plots: ")]
  assert links == [f"Plots: [{first}](plots/{first}.png); per member: [toy_vapo](plots/mechanism_toy_vapo.png)"]
  assert "Plots:" not in sweep_report.markdown_table("toy", MEMBERS, rows)  # None written (no matplotlib).
