"""The verifier pool and the rewards when things go wrong: signals to the process group, a dead
fork server, reward modules that fail or block at import, reward functions that fail on every
response, and maj@k with a user reward function."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from vapo_jax import config
from vapo_jax.cli import evaluate
from vapo_jax.errors import ConfigError, RewardFunctionError, UserError
from vapo_jax.rewards import reward
from vapo_jax.rewards.pool import VerifierPool, load_function

TESTS = Path(__file__).parent
REPO = TESTS.parent


def run_script(script: str, *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
  """Runs `script` in a fresh Python, in a process group of its own (the tests folder importable)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
  return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                        timeout=timeout, start_new_session=True, cwd=str(REPO), **kwargs)


def test_sigterm_to_the_process_group_while_scoring_loses_nothing():
  """systemd and Slurm signal the whole group: the pool's processes must leave it to the trainer.

  Before the fix the signalled workers died (their tasks scored "crash") and replacing them went
  through the dying fork server: `EOFError` from `VerifierPool._replace`, exit status 1.
  """
  result = run_script("""
      import json, signal
      from vapo_jax.rewards.pool import VerifierPool
      received = []
      signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))  # The trainer's flag.
      with VerifierPool(fn="failing_rewards:signal_own_group", workers=2, timeout_s=20) as pool:
        tasks = [("term" if i % 10 == 3 else str(i % 2), "1") for i in range(40)]
        first = pool.map(tasks)
        second = pool.map([("1", "1")] * 6)
      print(json.dumps({"statuses": [o.status for o in first], "values": [o.value for o in first],
                        "second": [o.status for o in second], "received": len(received)}))
  """)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert out["statuses"] == ["ok"] * 40
  assert out["values"] == [i % 10 != 3 and i % 2 == 1 for i in range(40)]
  assert out["second"] == ["ok"] * 6
  assert out["received"] >= 1  # The parent did get the signal (repeated signals may merge).


def test_a_killed_fork_server_is_started_again():
  """The fork server and a worker SIGKILLed mid-batch: every task still gets an outcome, the pool
  starts a new fork server and carries on."""
  result = run_script("""
      import json
      from multiprocessing import forkserver
      from vapo_jax.rewards.pool import VerifierPool
      with VerifierPool(fn="failing_rewards:kill_fork_server", workers=2, timeout_s=20) as pool:
        before = forkserver._forkserver._forkserver_pid
        tasks = [("kill" if i == 5 else "1", "1") for i in range(30)]
        first = pool.map(tasks)
        second = pool.map([("1", "1")] * 6)
        after = forkserver._forkserver._forkserver_pid
      print(json.dumps({"statuses": [o.status for o in first], "kill": first[5].value,
                        "second": [o.status for o in second], "restarted": before != after}))
  """)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert len(out["statuses"]) == 30 and out["statuses"][5] == "crash"
  assert out["kill"].startswith("the verifier process")  # Its exit code is lost with the fork server.
  assert set(out["statuses"]) <= {"ok", "crash"} and out["statuses"].count("crash") <= 2  # The other worker's task.
  assert out["second"] == ["ok"] * 6 and out["restarted"]


def test_workers_killed_while_idle_are_replaced_without_blaming_a_task():
  with VerifierPool(fn="failing_rewards:equal_slowly", workers=2, timeout_s=20) as pool:
    for worker in pool._workers:
      worker.process.kill()
      worker.process.join()
    outcomes = pool.map([("1", "1"), ("2", "1")] * 3)
  assert outcomes == [(True, "ok"), (False, "ok")] * 3


def _module(tmp_path, name: str, source: str) -> str:
  (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
  return str(tmp_path)


def test_a_reward_module_that_blocks_at_import_is_named_after_the_time_limit(tmp_path):
  """Imported by the workers under a time limit, never by the parent (which would hang)."""
  folder = _module(tmp_path, "blocks_at_import", """
      import time
      time.sleep(3600)  # Waits for a server, a lock, input...
      def reward(response, answer):
        return True
  """)
  result = run_script(f"""
      import sys, time
      sys.path.insert(0, {folder!r})
      from vapo_jax.rewards.pool import VerifierPool
      start = time.perf_counter()
      try:
        VerifierPool(fn="blocks_at_import:reward", workers=2, import_timeout_s=3)
      except Exception as e:
        print(type(e).__name__, round(time.perf_counter() - start), e)
  """, timeout=60)
  assert result.returncode == 0, result.stderr[-3000:]
  name, seconds, message = result.stdout.strip().split(" ", 2)
  assert name == "RewardFunctionError" and 3 <= int(seconds) < 20
  assert "importing module 'blocks_at_import'" in message and "did not finish within 3 s" in message


@pytest.mark.parametrize("source, fn, expected", [
    ("raise RuntimeError('needs a GPU')\n", "raises_at_import:f",
     "importing module 'raises_at_import' failed with RuntimeError: needs a GPU"),
    ("def g(response, answer):\n  return True\n", "raises_at_import:f", "has no attribute 'f'"),
    ("f = 3\n", "raises_at_import:f", "'f' is a int, not a function"),
    (None, "no_such_module_here:f", "ModuleNotFoundError: No module named 'no_such_module_here'"),
])
def test_a_reward_function_that_cannot_be_imported_is_a_user_error(tmp_path, monkeypatch, source, fn, expected):
  if source is not None:
    monkeypatch.syspath_prepend(_module(tmp_path, "raises_at_import", source))
  with pytest.raises(RewardFunctionError, match="cannot load function") as info:
    VerifierPool(fn=fn, workers=1, import_timeout_s=30)
  assert expected in str(info.value) and isinstance(info.value, UserError)
  with pytest.raises(RewardFunctionError, match="not of the form"):
    VerifierPool(fn="nodots", workers=1)


@pytest.fixture(scope="module")
def raising_pool():
  with VerifierPool(fn="failing_rewards:always_raises", workers=2, timeout_s=5) as pool:
    yield pool


def test_a_reward_function_failing_on_every_response_stops_with_its_error(raising_pool):
  """The run stops with the exception rather than training on a constant "incorrect" reward."""
  batch = reward.compute_rewards(raising_pool, ["a", "b", "c"], ["1", "2", "3"])  # No check asked: a batch.
  assert batch.statuses == ["error"] * 3 and batch.metrics["reward/error_frac"] == 1.0
  assert batch.first_error == "response 0: error: ZeroDivisionError: division by zero"
  with pytest.raises(RewardFunctionError) as info:
    reward.compute_rewards(raising_pool, ["a", "b", "c"], ["1", "2", "3"], max_error_frac=0.5)
  message = str(info.value)
  assert "'failing_rewards:always_raises' (reward.reward_fn) failed on all 3 responses" in message
  assert "ZeroDivisionError: division by zero" in message


def test_failures_above_the_fraction_warn_with_the_first_error():
  with VerifierPool(fn="failing_rewards:raises_on_odd_length", workers=2, timeout_s=5) as pool:
    with pytest.warns(UserWarning, match=r"failed to score a response: response 1: error: KeyError") as caught:
      batch = reward.compute_rewards(pool, ["aa", "b", "cc", "dd"], ["aa"] * 4, max_error_frac=0.5)  # 25%: once.
    assert len(caught) == 1 and batch.metrics["reward/error_frac"] == 0.25
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # Shown once per pool; the fraction is under the limit.
      reward.compute_rewards(pool, ["aa", "b", "cc", "dd"], ["aa"] * 4, max_error_frac=0.5)
    with pytest.warns(UserWarning, match=r"75% of the batch's responses failed to score with the reward function "
                                         r"'failing_rewards:raises_on_odd_length' \(reward.reward_fn\), more than "
                                         r"reward.max_error_frac=0.5.*response 0: error: KeyError: \"no key for 'a'\""):
      batch = reward.compute_rewards(pool, ["a", "b", "c", "dd"], ["dd"] * 4, max_error_frac=0.5)
    np.testing.assert_array_equal(batch.rewards, [-1, -1, -1, 1])


def test_invalid_values_and_time_outs_name_what_went_wrong():
  with VerifierPool(fn="failing_rewards:returns_text", workers=1, timeout_s=5) as pool:
    with pytest.raises(RewardFunctionError, match=r"response 0: returned 'yes' \(str\), expected a bool or a finite"):
      reward.compute_rewards(pool, ["a", "b"], ["1", "1"], max_error_frac=0.5)
  with VerifierPool(workers=2, timeout_s=1.0) as pool:  # sympy evaluates 9^(9^(9^9)) forever.
    with pytest.raises(RewardFunctionError, match=r"built-in verifier failed on all 2 .*timed out after 1 s.*"
                                                  r"raise reward.verifier_timeout_s"):
      reward.compute_rewards(pool, [r"\boxed{9^{9^{9^{9}}}}"] * 2, ["1", "2"], max_error_frac=0.5)


def test_max_error_frac_is_validated():
  assert config.RewardConfig().max_error_frac == 0.5
  with pytest.raises(ConfigError, match=r"RewardConfig.max_error_frac must be in \[0.0, 1.0\], got 1.5"):
    config.RewardConfig(max_error_frac=1.5)


def test_verifier_memory_mb_is_validated():
  """-5, 0 and 1.5 are refused."""
  for value in (-5, 0, 1.5):
    with pytest.raises(ConfigError, match=rf"verifier_memory_mb must be an integer in \[1, 2147483647\], got {value}"):
      config.RewardConfig(verifier_memory_mb=value)
  assert config.RewardConfig(verifier_memory_mb=None).verifier_memory_mb is None


def test_majority_vote_is_not_available_for_a_user_reward_function(tmp_path, capsys):
  """`make eval` with a user function reports maj@k as not available (not 0 beside avg@k = 1): there
  are no extracted answers to vote on."""
  responses = tmp_path / "r.jsonl"
  responses.write_text("".join(json.dumps({"id": f"p{i}", "response": "so \\boxed{7}", "answer": 7}) + "\n"
                               for i in range(3) for _ in range(2)))
  summary = evaluate.evaluate_responses(str(responses), problems=None, out_dir=str(tmp_path / "out"),
                                        reward_config=config.RewardConfig(verifier_workers=2,
                                                                          reward_fn="failing_rewards:contains_answer"))
  overall = summary["overall"]
  assert overall["avg@2"] == 1.0 and overall["pass@2"] == 1.0 and overall["maj@2"] is None
  evaluate._print_summary(summary)
  assert "maj@2 n/a" in capsys.readouterr().out
  # The built-in verifier still votes.
  builtin = evaluate.evaluate_responses(str(responses), problems=None, out_dir=str(tmp_path / "b"),
                                        reward_config=config.RewardConfig(verifier_workers=2))
  assert builtin["overall"]["maj@2"] == 1.0


def test_load_function_still_loads():
  assert load_function("failing_rewards:equal_slowly").__name__ == "equal_slowly"


@pytest.mark.slow  # A trainer run (its evaluation before RL); make test covers the fractions' source, compute_rewards.
def test_the_trainers_held_out_evaluation_counts_the_responses_that_failed_to_score(tmp_path):
  """Responses that fail to score count as incorrect, and the evaluation's records say how many."""
  from conftest import build_smoke_config
  from vapo_jax.train.trainer import Trainer

  run = build_smoke_config(tmp_path, {"reward.reward_fn": "failing_rewards:raises_on_odd_length", "rl_steps": 0,
                                      "sft.steps": 0, "algo.value_pretrain_steps": 0, "reward.max_error_frac": 1.0,
                                      "checkpoint.export_final": False})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # The function's first failure, reported once.
    Trainer(run).run()
  records = [json.loads(line) for line in open(os.path.join(run.run_directory, "metrics.jsonl"))]
  before = next(r for r in records if "eval/error_frac" in r)  # The evaluation before RL.
  assert 0 < before["eval/error_frac"] < 1 and 0 <= before["eval/no_answer_frac"] <= 1, before
