"""Run logs: metrics.jsonl truncation on resume, TensorBoard-only records, the collapse monitor."""

import json

import pytest

from vapo_jax import metrics


def _lines(run_dir):
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_writer_keeps_only_the_checkpointed_records(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(0, "rl", {"a": 1.0})
  kept = writer.size()
  writer.write(1, "rl", {"a": 2.0})
  writer.close()
  (tmp_path / "metrics.jsonl").open("a").write('{"step": 2, "stage": "rl", "a"')  # Cut by a crash.
  resumed = metrics.MetricsWriter(str(tmp_path), keep_bytes=kept, purge_step=1)
  resumed.write(0, "eval_before_rl", {"eval/accuracy": 0.5}, jsonl=False)  # TensorBoard only.
  resumed.write(1, "rl", {"a": 3.0}, global_step=1)
  resumed.close()
  assert _lines(tmp_path) == [{"step": 0, "stage": "rl", "a": 1.0}, {"step": 1, "stage": "rl", "a": 3.0}]
  assert list((tmp_path / "tensorboard").iterdir())
  fresh = metrics.MetricsWriter(str(tmp_path))  # A fresh run (no checkpoint) starts an empty file.
  assert fresh.size() == 0
  fresh.close()


def test_collapse_monitor_warns_once_and_resumes_its_state():
  monitor = metrics.CollapseMonitor(length_frac=0.5, min_entropy=0.1)
  assert monitor.check(0, 100.0, 1.0) == []
  with pytest.warns(UserWarning, match="length collapse"):
    monitor.check(1, 40.0, 1.0)
  resumed = metrics.CollapseMonitor(length_frac=0.5, min_entropy=0.1)
  resumed.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
  assert resumed.check(2, 30.0, 1.0) == []  # Already warned; the first length (100) is kept.
  with pytest.warns(UserWarning, match="entropy collapse"):
    resumed.check(3, 90.0, 0.05)
