"""`make sweep`: runs are real `python -m vapo_jax.cli.train` subprocesses (one CPU device each).

The micro sweep (two members of the toy sweep × two seeds × two RL steps, at smoke-test size) checks
the files written (runs, logs, runs.csv, table.md, plots), that a rerun skips finished runs and
still runs an unfinished one after a failure; it is marked slow (about 3 minutes on 2 free cores:
each run is a fresh process that imports JAX and compiles or loads its programs). Runs that fail
at once (a refused configuration) check, in the fast suite, that failures are reported with their
logs and do not stop the others.
"""

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import experiments
from multiprocess_launch import without_device_count
from vapo_jax import paths
from vapo_jax.cli import sweep, sweep_report, sweep_runs
from vapo_jax.config import overrides
from vapo_jax.errors import ConfigError

pytest.importorskip("matplotlib")

MEMBERS = "toy_vapo,toy_vapo_no_clip_higher"
# Smoke-test size (experiments/smoke.py), one held-out evaluation during RL, and value pretraining on.
MICRO = ["--smoke", "eval.every_steps=1", "algo.value_pretrain_steps=1"]


def run_sweep(tmp_path, *args):
  out = io.StringIO()
  code = sweep.main(["toy", "--seeds", "0,1", "--root", str(tmp_path), *args, *MICRO], stream=out)
  return code, out.getvalue()


def mtimes(sweep_dir):
  return {name: os.path.getmtime(sweep_dir / name / "summary.json")
          for name in os.listdir(sweep_dir) if (sweep_dir / name / "summary.json").exists()}


@pytest.mark.slow
def test_micro_sweep_writes_resumes_and_reports_failures(tmp_path, monkeypatch):
  # The runs: one CPU device each (the tests' 8 are for this process), at this process's XLA flags otherwise.
  monkeypatch.setenv("XLA_FLAGS", without_device_count().get("XLA_FLAGS", ""))
  sweep_dir = tmp_path / "toy"
  runs = ["toy_vapo_seed0", "toy_vapo_no_clip_higher_seed0", "toy_vapo_seed1", "toy_vapo_no_clip_higher_seed1"]

  code, out = run_sweep(tmp_path, "--members", MEMBERS, "--jobs", "2")
  assert code == 0, out
  # One warm start (seed 0), exported, then one reward model from its policy; every run starts from
  # both, without SFT of its own.
  assert (sweep_dir / "toy_warm_start_seed0" / "export" / "model.safetensors").exists(), out
  assert (sweep_dir / "toy_reward_model_seed0" / "critic_pretrained" / "model.safetensors").exists(), out
  assert (f"model.checkpoint={sweep_dir}/toy_warm_start_seed0/export sft.steps=0"
          in (sweep_dir / "logs" / "toy_reward_model_seed0.log").read_text())
  for name in runs:
    assert (sweep_dir / name / "summary.json").exists(), out
    assert (sweep_dir / name / "metrics.jsonl").exists()
    log = (sweep_dir / "logs" / f"{name}.log").read_text()
    assert "=== " in log  # The command line, then its output.
    assert (f"model.checkpoint={sweep_dir}/toy_warm_start_seed0/export sft.steps=0 "
            f"model.critic_checkpoint={sweep_dir}/toy_reward_model_seed0/critic_pretrained") in log
    stages = {json.loads(line)["stage"] for line in open(sweep_dir / name / "metrics.jsonl")}
    assert "sft" not in stages and "rl" in stages
  with open(sweep_dir / "runs.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["run"] for r in rows] == runs  # Seed by seed.
  assert {r["status"] for r in rows} == {"done"}
  for row in rows:
    assert row["seed"] == row["run"][-1] and row["rl_steps"] == "2"
    before, final, best, auc = (float(row[k])
                                for k in ("accuracy_before", "accuracy_final", "accuracy_best", "accuracy_auc"))
    assert 0 <= min(before, final, best, auc) and max(before, final, best, auc) <= 1
    assert best >= final
  table = (sweep_dir / "table.md").read_text()
  assert "| `toy_vapo` | 2 |" in table and "| `toy_vapo_no_clip_higher` | 2 |" in table
  for name in [name for name, *_ in sweep_report.FIGURES] + ["mechanism_toy_vapo", "mechanism_toy_vapo_no_clip_higher"]:
    assert (sweep_dir / "plots" / f"{name}.png").stat().st_size > 1000, name

  # Rerun with a third member whose runs fail when they start (a file where each run's directory goes), placed
  # before the others, and one run made unfinished: the failures are reported with their logs, the finished runs
  # are skipped, and the unfinished one still runs.
  (sweep_dir / "toy_vapo_seed1" / "summary.json").unlink()
  for seed in (0, 1):
    (sweep_dir / f"toy_ppo_seed{seed}").write_text("in the way")
  before = mtimes(sweep_dir)
  code, out = run_sweep(tmp_path, "--members", "toy_ppo," + MEMBERS)
  assert code == 1, out
  for name in ("toy_warm_start_seed0", "toy_reward_model_seed0", "toy_vapo_seed0", "toy_vapo_no_clip_higher_seed0",
               "toy_vapo_no_clip_higher_seed1"):
    assert f"skip    {name}" in out
  assert mtimes(sweep_dir).keys() - before.keys() == {"toy_vapo_seed1"}  # Ran again after ppo failed.
  assert all(mtimes(sweep_dir)[name] == t for name, t in before.items())
  for seed in (0, 1):
    log = sweep_dir / "logs" / f"toy_ppo_seed{seed}.log"
    assert f"failed: toy_ppo_seed{seed}: failed (exit 2); log: {log}" in out
    assert "cannot write to the run directory" in log.read_text()
  table = (sweep_dir / "table.md").read_text()
  assert "| `toy_ppo` | 0 |" in table and "`toy_ppo_seed0`: failed (exit 2)" in table
  assert "| `toy_vapo` | 2 |" in table  # The first member is still the reference (the sweep's order).


@pytest.mark.slow  # For time (20 s: four processes).
def test_failed_runs_are_reported_and_do_not_stop_the_others(tmp_path):
  """Runs that fail when they start (their training data missing: a valid config, checked before the sweep)."""
  out, missing = io.StringIO(), tmp_path / "missing.jsonl"
  code = sweep.main(["toy", "--seeds", "0,1", "--root", str(tmp_path), "--members", "toy_grpo,toy_dapo",
                     "--no-shared-stages", "--smoke", f"data.train_path={missing}"], stream=out)
  out = out.getvalue()
  assert code == 1, out
  names = ["toy_grpo_seed0", "toy_dapo_seed0", "toy_grpo_seed1", "toy_dapo_seed1"]
  assert [line.split()[1] for line in out.splitlines() if line.startswith("FAILED")] == names
  for name in names:
    log = tmp_path / "toy" / "logs" / f"{name}.log"
    assert f"failed: {name}: failed (exit 2); log: {log}" in out
    assert f"{missing}: no such file" in log.read_text()
    failed = next(line for line in out.splitlines() if line.startswith(f"FAILED  {name} "))
    assert re.search(r"\(exit 2\) after \d+s: error: .*missing\.jsonl: no such file.*; log: ",
                     failed), failed  # The run's own error line, not only where its log is.
  with open(tmp_path / "toy" / "runs.csv") as f:
    assert [(r["run"], r["status"]) for r in csv.DictReader(f)] == [(n, "failed (exit 2)") for n in names]
  table = (tmp_path / "toy" / "table.md").read_text()
  assert "| `toy_grpo` | 0 |" in table and "`toy_dapo_seed1`: failed (exit 2)" in table


def test_print_commands_and_bad_arguments(tmp_path, capsys):
  out = io.StringIO()
  assert sweep.main(["toy", "--seeds", "0,2", "--root", "runs/sweeps", "--print-commands", "rl_steps=5"],
                    stream=out) == 0
  lines = out.getvalue().splitlines()
  assert len(lines) == 2 + 11 * 2  # The warm start, the reward model, then each seed's 11 members from both.
  assert lines[0] == ("make train EXP=toy_warm_start ARGS='seed=0 model.init_seed=0 data.seed=0 "
                      "name=toy_warm_start_seed0 run_dir=runs/sweeps/toy rl_steps=5'")
  warm = "model.checkpoint=runs/sweeps/toy/toy_warm_start_seed0/export sft.steps=0"
  critic = "model.critic_checkpoint=runs/sweeps/toy/toy_reward_model_seed0/critic_pretrained"
  assert lines[1] == ("make train EXP=toy_reward_model ARGS='seed=0 model.init_seed=0 data.seed=0 "
                      f"name=toy_reward_model_seed0 run_dir=runs/sweeps/toy {warm} rl_steps=5'")
  assert lines[2] == ("make train EXP=toy_vapo ARGS='seed=0 model.init_seed=0 data.seed=0 name=toy_vapo_seed0 "
                      f"run_dir=runs/sweeps/toy {warm} {critic} rl_steps=5'")
  assert lines[13].startswith("make train EXP=toy_vapo ARGS='seed=2 ") and lines[13].endswith(
      f"{warm} {critic} rl_steps=5'")
  out = io.StringIO()
  assert sweep.main(["toy", "--seeds", "1", "--members", "toy_ppo", "--smoke", "--print-commands",
                     "--no-shared-stages"], stream=out) == 0
  assert out.getvalue() == ("make train EXP=toy_ppo ARGS='seed=1 model.init_seed=1 data.seed=1 name=toy_ppo_seed1 "
                            "run_dir=runs/sweeps/toy --smoke'\n")
  assert lines[-1].startswith("make train EXP=toy_vapo_no_group_sampling ARGS='seed=2 ")
  assert sweep.main(["no_such_sweep"]) == 2
  capsys.readouterr()
  for name in ("toy_mechanism_v3", "toy_mechanism_prefix_critic"):  # A former name: the same runs, in its directory.
    out = io.StringIO()
    assert sweep.main([name, "--seeds", "0", "--root", "runs/sweeps", "--print-commands"], stream=out) == 0
    assert len(out.getvalue().splitlines()) == 2 + 3 and f"run_dir=runs/sweeps/{name} " in out.getvalue()
    assert "toy_reward_model_prefix" in out.getvalue().splitlines()[1]
    assert ("is now 'toy_mechanism_prefix_critic'" in capsys.readouterr().err) == (name == "toy_mechanism_v3")
  assert sweep.main(["toy", "--members", "toy_vapo,nope"]) == 2
  assert "nope" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep.main(["toy", "--seeds", "0,0"])


def test_every_runs_config_is_checked_before_the_first_run_starts(tmp_path, capsys, monkeypatch):
  """A field's typo, or a value one member refuses, is found before any run (shared stages included) starts."""
  monkeypatch.setattr(sweep, "execute", lambda *a, **k: pytest.fail("a run started"))
  assert sweep.main(["toy", "--seeds", "0", "--root", str(tmp_path), "algo.eps_hi=0.3"]) == 2
  err = capsys.readouterr().err
  assert "nothing has run" in err and "unknown config field 'algo.eps_hi'" in err and "(every run)" in err
  # A group of 1 is refused by GRPO's group-normalised advantages alone of the members.
  assert sweep.main(["toy", "--seeds", "0", "--root", str(tmp_path), "--members", "toy_vapo,toy_grpo",
                     "rollout.samples_per_prompt=1", "algo.mini_batch_responses=16"]) == 2
  err = capsys.readouterr().err
  assert "(toy_grpo_seed0)" in err and "toy_vapo_seed0" not in err, err
  assert not os.path.exists(tmp_path / "toy")


def test_a_failed_shared_stage_fails_the_later_runs_without_starting_them(tmp_path):
  sweep_dir = str(tmp_path / "toy")
  warm, reward = experiments.TOY_STAGES
  first = sweep_runs.Run("no_such_experiment", 0, sweep_dir)  # Exits 2 at once: unknown experiment.
  second = sweep_runs.Run("toy_reward_model", 0, sweep_dir, ((warm, first),))
  starts = ((warm, first), (reward, second))
  runs = [first, second, sweep_runs.Run("toy_vapo", 0, sweep_dir, starts),
          sweep_runs.Run("toy_ppo", 0, sweep_dir, starts)]
  out = io.StringIO()
  status = sweep_runs.execute(runs, jobs=2, stream=out)
  assert status["no_such_experiment_seed0"] == "failed (exit 2)", out.getvalue()
  assert status["toy_reward_model_seed0"] == "failed (shared stage no_such_experiment_seed0: failed (exit 2))"
  for run in runs[1:]:
    assert status[run.name].startswith("failed (shared stage no_such_experiment_seed0")
    assert not os.path.exists(run.log)  # Never started, although two runs may run at once.
  assert "unknown experiment 'no_such_experiment'" in open(first.log).read()
  # A shared stage that is not among the runs and has not finished: its runs fail at once, not wait forever.
  status = sweep_runs.execute(runs[2:], stream=io.StringIO())
  assert status["toy_vapo_seed0"].startswith("failed (shared stage no_such_experiment_seed0")


def test_shared_stages_are_registered_experiments_feeding_real_fields():
  for sweep_name, stages in experiments.SHARED_STAGES.items():
    assert sweep_name in experiments.SWEEPS
    member = next(iter(experiments.SWEEPS[sweep_name]().values()))
    for stage in stages:
      assert stage.experiment in experiments.EXPERIMENTS
      overrides.apply_overrides(member, [f"{stage.field}=/some/dir", *stage.overrides])  # Each a real field.
  with pytest.raises(ConfigError, match="must be a registered experiment"):
    experiments.SharedStage(experiment="nope", output="export", field="model.checkpoint")


def test_area_under_curve_is_the_mean_height():
  x, y = np.array([0.0, 10.0, 20.0, 40.0]), np.array([0.2, 0.4, 0.4, 0.8])
  # Trapezoids: 10·0.3 + 10·0.4 + 20·0.6 = 19 over 40 steps.
  assert sweep_report.area_under_curve(x, y) == pytest.approx(19 / 40)
  assert sweep_report.area_under_curve(np.array([-2.0, 0.0, 4.0]), np.array([9.0, 0.5, 0.5])) == pytest.approx(0.5)
  assert sweep_report.area_under_curve(np.array([0.0]), np.array([0.3])) == pytest.approx(0.3)


def test_sigterm_stops_the_sweep_and_its_runs(tmp_path):
  """A scheduler's SIGTERM (or `kill`) stops the runs in progress, not only the sweep."""
  argv = [sys.executable, "-m", "vapo_jax.cli.sweep", "toy", "--seeds", "0", "--members", "toy_vapo",
          "--no-shared-stages", "--root", str(tmp_path), *MICRO]
  sweep_process = subprocess.Popen(argv, cwd=paths.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=without_device_count())
  assert sweep_process.stdout.readline().startswith("sweep toy:")
  assert sweep_process.stdout.readline().startswith("start   toy_vapo_seed0")
  sweep_process.send_signal(signal.SIGTERM)  # The run is starting: once under way, the trainer saves and exits 75
  out, err = sweep_process.communicate(timeout=180)  # (test_resume's slow tests); before that, SIGTERM ends it.
  assert sweep_process.returncode == 130, err
  assert "stopped toy_vapo_seed0 (exit " in out, out + err
  assert "the same command resumes the sweep" in err
  assert not subprocess.run(["pgrep", "-f", f"run_dir={tmp_path}"], capture_output=True).stdout  # Not left running.


# A run as the sweep launches it, in miniature: on SIGTERM it takes a second to save, marks that it stopped, and
# exits 75 (the trainer's preemption exit); a further SIGTERM while saving is ignored, as the trainer ignores it.
FAKE_RUN = """
import os, signal, sys, time
name = sys.argv[1]
def stop(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  time.sleep(1.0)
  open(os.path.join(sys.argv[2], name + ".stopped"), "w").close()
  sys.exit(75)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(sys.argv[2], name + ".started"), "w").close()
time.sleep(float(sys.argv[3]))
os.makedirs(sys.argv[4], exist_ok=True)
open(os.path.join(sys.argv[4], "summary.json"), "w").close()
"""

HARNESS = """
import signal, subprocess, sys
from vapo_jax.cli import sweep, sweep_runs
marks, seconds = sys.argv[1], sys.argv[2]
def launch(run, extra, env):
  process = subprocess.Popen([sys.executable, "-c", {fake!r}, run.name, marks, seconds, run.directory])
  process.log = open("/dev/null", "w")
  return process
sweep_runs._launch = launch
signal.signal(signal.SIGTERM, sweep._terminate)
runs = [sweep_runs.Run(name, 0, marks) for name in ("one", "two")]
try:
  sweep_runs.execute(runs, jobs=2)
except sweep_runs.SweepStopped as e:
  print(e.message, flush=True)
  sys.exit(130)
"""


def _harness(tmp_path, seconds: float):
  return subprocess.Popen([sys.executable, "-c", HARNESS.format(fake=FAKE_RUN), str(tmp_path), str(seconds)],
                          cwd=paths.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


def test_a_stopped_sweep_waits_for_every_run_whatever_signals_follow(tmp_path):
  """SIGTERM to the sweep's process group (its runs get it too), then another to the sweep (make passes its own
  on): the sweep exits only after both runs have saved and stopped, each run's end printed before the closing
  line, which says what happened."""
  harness = _harness(tmp_path, 60)
  deadline = time.time() + 60
  while not all((tmp_path / f"{n}_seed0.started").exists() for n in ("one", "two")) and time.time() < deadline:
    time.sleep(0.1)
  os.killpg(harness.pid, signal.SIGTERM)
  time.sleep(0.3)
  harness.send_signal(signal.SIGTERM)
  out, _ = harness.communicate(timeout=60)
  assert harness.returncode == 130, out
  assert all((tmp_path / f"{n}_seed0.stopped").exists() for n in ("one", "two")), out  # Both ended before the sweep.
  lines = out.splitlines()
  ends = [i for i, line in enumerate(lines) if line.startswith("stopped ") and "(exit 75)" in line]
  assert len(ends) == 2 and lines[-1].startswith("sweep stopped: 2 run(s) in progress saved checkpoints"), out
  assert max(ends) < len(lines) - 1


def test_a_rerun_waits_for_a_run_still_held_and_prints_ends_before_starts(tmp_path):
  """A run whose directory another process still holds (a stopped run still saving) is waited for, said once,
  and started after; with one run at a time, each run's end is printed before the next one starts."""
  from vapo_jax.train import runlock

  held = sweep_runs.Run("one", 0, str(tmp_path))
  lock = runlock.RunLock(held.directory).acquire()
  out = io.StringIO()
  runs = [held, sweep_runs.Run("two", 0, str(tmp_path))]

  def launch(run, extra, env):
    process = subprocess.Popen([sys.executable, "-c", FAKE_RUN, run.name, str(tmp_path), "0.2", run.directory])
    process.log = open(os.devnull, "w")
    return process
  original = sweep_runs._launch
  sweep_runs._launch = launch
  try:
    import threading
    threading.Timer(1.5, lock.release).start()
    status = sweep_runs.execute(runs, jobs=1, stream=out)
  finally:
    sweep_runs._launch = original
  text = out.getvalue()
  assert status == {"one_seed0": "done", "two_seed0": "done"}, text
  lines = [line.split()[0] + " " + line.split()[1].rstrip(":") for line in text.splitlines()]
  assert lines == ["wait one_seed0", "start two_seed0", "done two_seed0", "start one_seed0", "done one_seed0"], text
