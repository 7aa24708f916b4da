"""The held-out evaluation's accuracy by problem level: each level's avg@k (checked against a loop over the
problems), logged as `eval/accuracy_level_{k}` and given in a finished run's summary; levels read from files
(MATH's `level`, "Level 3") and the synthetic tasks' number of terms."""

import json
from pathlib import Path

import numpy as np
import pytest

from vapo_jax.data import records as records_lib
from vapo_jax.data import tasks
from vapo_jax.train.held_out import accuracy_by_level
from vapo_jax.train.trainer import Trainer


def test_accuracy_by_level_is_each_levels_problems_mean():
  rng = np.random.default_rng(0)
  k, levels = 4, [2, 3, None, 2, 5, 3, 3]
  verdicts = rng.random(len(levels) * k) < 0.4
  expected = {}
  for level in (2, 3, 5):  # From the definition: a level's problems' accuracies, averaged.
    accuracies = [verdicts[i * k:(i + 1) * k].mean() for i, x in enumerate(levels) if x == level]
    expected[level] = sum(accuracies) / len(accuracies)
  assert accuracy_by_level(verdicts, levels, k) == pytest.approx(expected, rel=1e-12)
  assert accuracy_by_level(verdicts, [None] * len(levels), k) == {}


def test_levels_are_read_from_a_files_level_field_and_are_a_sums_number_of_terms(tmp_path):
  path = tmp_path / "p.jsonl"
  rows = [{"problem": "a", "answer": "1", "level": 3}, {"problem": "b", "answer": "2", "level": "Level 4"},
          {"problem": "c", "answer": "3", "level": "Level ?"}, {"problem": "d", "answer": "4"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert [r.level for r in records_lib.load_records(str(path))] == [3, 4, None, None]
  sums = tasks.to_records(tasks.make_problems(20, seed=0, min_terms=2, max_terms=5))
  assert all(r.level == r.prompt.count("+") + 1 for r in sums) and {r.level for r in sums} == {2, 3, 4, 5}


@pytest.mark.slow  # For time (8 s): make test holds the accuracy by level to each level's problems (above).
def test_a_finished_runs_summary_gives_the_accuracy_by_level_and_a_rerun_keeps_it(smoke_config):
  """A finished run's summary gives the logged accuracy by level; re-running it keeps summary.json as it was,
  its seconds too (not the re-run's)."""
  config = smoke_config({"sft.steps": 0, "algo.value_pretrain_steps": 0, "rl_steps": 0,
                         "eval.path": "synthetic:arithmetic?terms=2-3&count=8&seed=1"})
  summary = Trainer(config, verbose=False).run()
  path = Path(config.run_directory) / "summary.json"
  records = [json.loads(line) for line in (Path(config.run_directory) / "metrics.jsonl").read_text().splitlines()]
  before = next(r for r in records if r["stage"] == "eval_before_rl")
  assert summary["accuracy_by_level_before_rl"] == {"2": before["eval/accuracy_level_2"],
                                                     "3": before["eval/accuracy_level_3"]}
  assert json.loads(path.read_text()) == json.loads(json.dumps(summary))
  path.write_text(json.dumps(json.loads(path.read_text()) | {"seconds": 5400.0}))
  again = Trainer(config, verbose=False).run()
  assert again["seconds"] == 5400.0 and again["accuracy_by_level_before_rl"] == summary["accuracy_by_level_before_rl"]
  assert json.loads(path.read_text())["seconds"] == 5400.0
