"""Run logs: metrics.jsonl on resume and on a fresh start over old logs, W&B offline, the collapse monitor."""

import json
import sys
import warnings

import pytest

from vapo_jax.train import metrics


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


def test_a_fresh_start_moves_earlier_logs_aside(tmp_path):
  """No checkpoint to resume (keep_bytes=0) over an earlier run's logs: they are kept under .N names."""
  first = metrics.MetricsWriter(str(tmp_path))
  first.write(0, "rl", {"a": 1.0})
  first.close()
  records = (tmp_path / "metrics.jsonl").read_text()
  events = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
  with pytest.warns(UserWarning, match=r"no checkpoint to resume from: moved metrics\.jsonl to metrics\.jsonl\.1 "
                    r"and tensorboard to tensorboard\.1"):
    second = metrics.MetricsWriter(str(tmp_path))
  assert second.size() == 0 and (tmp_path / "metrics.jsonl.1").read_text() == records
  assert sorted(p.name for p in (tmp_path / "tensorboard.1").iterdir()) == events
  second.write(0, "rl", {"a": 2.0})
  second.close()
  with pytest.warns(UserWarning, match=r"moved metrics\.jsonl to metrics\.jsonl\.2"):
    metrics.MetricsWriter(str(tmp_path)).close()
  assert _lines(tmp_path) == [] and json.loads((tmp_path / "metrics.jsonl.2").read_text())["a"] == 2.0
  assert (tmp_path / "metrics.jsonl.1").read_text() == records
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # No records: nothing to move, nothing said.
    metrics.MetricsWriter(str(tmp_path)).close()
  assert not (tmp_path / "metrics.jsonl.3").exists()


def _three_records(run_dir):
  writer = metrics.MetricsWriter(str(run_dir))
  sizes = []
  for step in range(3):
    writer.write(step, "rl", {"a": float(step)})
    sizes.append(writer.size())
  writer.close()
  return sizes


def test_a_garbage_line_before_the_checkpoint_does_not_corrupt_the_next_record(tmp_path):
  """A line inserted after the checkpoint was saved shifts its byte count into a record."""
  kept = _three_records(tmp_path)[1]  # The checkpoint holds records 0 and 1.
  path = tmp_path / "metrics.jsonl"
  lines = path.read_text().splitlines(keepends=True)
  path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
  with pytest.warns(UserWarning) as caught:
    resumed = metrics.MetricsWriter(str(tmp_path), keep_bytes=kept)
  assert [m for m in map(str, (w.message for w in caught)) if "byte" in m and "inside a line" in m]
  assert [m for m in map(str, (w.message for w in caught)) if "1 lines are not JSON records (line 2)" in m]
  resumed.write(2, "rl", {"a": 20.0})
  resumed.close()
  assert path.read_text().splitlines() == [lines[0].strip(), "garbage", lines[1].strip(),
                                           json.dumps({"step": 2, "stage": "rl", "a": 20.0})]


def test_a_partial_or_unterminated_last_line_on_resume(tmp_path):
  sizes = _three_records(tmp_path)
  path = tmp_path / "metrics.jsonl"
  text = path.read_text()
  path.write_text(text[:sizes[1] + 5])  # Shorter than the checkpoint's count, ending mid-record.
  with pytest.warns(UserWarning) as caught:
    metrics.MetricsWriter(str(tmp_path), keep_bytes=sizes[2]).write(2, "rl", {"a": 20.0})
  messages = " | ".join(str(w.message) for w in caught)
  assert "fewer than the" in messages and "dropped a partial last line (5 bytes" in messages
  assert [r["a"] for r in _lines(tmp_path)] == [0.0, 1.0, 20.0]
  path.write_text(text[:sizes[1] - 1])  # Record 1 complete but for its newline: kept, and ended.
  with pytest.warns(UserWarning, match="fewer than the"):
    metrics.MetricsWriter(str(tmp_path), keep_bytes=sizes[1]).write(2, "rl", {"a": 20.0})
  assert [r["a"] for r in _lines(tmp_path)] == [0.0, 1.0, 20.0]


def test_each_record_starts_a_line_of_its_own(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(0, "rl", {"a": 1.0})
  (tmp_path / "metrics.jsonl").open("a").write("not json, no newline")  # Something else wrote to it.
  writer.write(1, "rl", {"a": 2.0})
  writer.close()
  assert (tmp_path / "metrics.jsonl").read_text().splitlines()[1:] == [
      "not json, no newline", json.dumps({"step": 1, "stage": "rl", "a": 2.0})]


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


def _wandb_records(path):
  """Records of W&B's offline transaction log (LevelDB log format: a 7-byte header, then 32 KiB blocks
  of chunks, each with a 7-byte header: crc32, length, type full=1 / first=2 / middle=3 / last=4)."""
  import struct

  from wandb.proto import wandb_internal_pb2

  data = path.read_bytes()
  assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
  pos, pending = 7, b""
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # Block trailer.
      pos += 32768 - pos % 32768
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record
      pending = b""


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
  pytest.importorskip("wandb", reason="the optional wandb package is not installed (pip install -e '.[wandb]')")
  for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
  for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / name.lower()))


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_wandb_offline_run_holds_the_metrics_and_resumes_the_same_run(tmp_path, wandb_env):
  import wandb

  from vapo_jax.config import LogConfig

  args = metrics.wandb_init_args(LogConfig(wandb=True, wandb_project="p"), name="exp", config={"seed": 3})
  assert args["mode"] == "offline"  # "auto" with no API key anywhere.
  run_dir = tmp_path / "run"
  writer = metrics.MetricsWriter(str(run_dir), wandb=args)
  writer.write(0, "value_pretrain", {"critic/loss": 2.5}, global_step=0)
  writer.write(0, "rl", {"rollout/reward_mean": 0.25, "actor/entropy": float("nan")}, global_step=1)
  kept = writer.size()
  writer.close()
  wandb.teardown()  # What the process's exit does: wait until W&B's service has written everything.
  resumed = metrics.MetricsWriter(str(run_dir), keep_bytes=kept, wandb=args)
  resumed.write(1, "rl", {"rollout/reward_mean": 0.75}, global_step=2)
  resumed.close()
  wandb.teardown()
  run_id = (run_dir / metrics.WANDB_ID_FILE).read_text().strip()
  logs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
  assert len(logs) == 2  # The first start and the resume, one W&B run.
  runs, rows = [], []
  for log in logs:
    for record in _wandb_records(log):
      if record.WhichOneof("record_type") == "run":
        runs.append((record.run.run_id, record.run.project, record.run.display_name,
                     {item.key: item.value_json for item in record.run.config.update}["seed"]))
      if record.WhichOneof("record_type") == "history":
        rows.append({"/".join(item.nested_key) or item.key: item.value_json for item in record.history.item})
  assert runs == [(run_id, "p", "exp", "3")] * 2
  got = [{k: float(v) for k, v in row.items() if not k.startswith("_")} for row in rows]
  assert got == [{"value_pretrain/critic/loss": 2.5, "global_step": 0.0},
                 {"rollout/reward_mean": 0.25, "global_step": 1.0},  # NaN left out, as in TensorBoard.
                 {"rollout/reward_mean": 0.75, "global_step": 2.0}]


def test_wandb_mode_and_a_missing_package(tmp_path, wandb_env, monkeypatch):
  from vapo_jax.config import LogConfig
  from vapo_jax.errors import ConfigError

  assert metrics.wandb_init_args(LogConfig(), name="x") is None
  on = LogConfig(wandb=True)
  (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
  monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # What `wandb login` writes.
  assert metrics.wandb_init_args(on, name="x")["mode"] == "online"
  assert metrics.wandb_init_args(LogConfig(wandb=True, wandb_mode="offline"), name="x")["mode"] == "offline"
  monkeypatch.setenv("WANDB_MODE", "disabled")  # The variable wins: no mode passed to wandb.init.
  assert "mode" not in metrics.wandb_init_args(on, name="x")
  monkeypatch.setitem(sys.modules, "wandb", None)  # As if not installed.
  with pytest.raises(ConfigError, match=r"log\.wandb=true needs the optional wandb package: pip install"):
    metrics.wandb_init_args(on, name="x")
