"""The shipped experiments rehearsed end to end on 8 CPU devices through `cli.train --smoke` (experiments/smoke.py:
each one's own mesh, rollout groups, engine and algorithm, with small numbers): the warm start where it has one,
value pretraining, the held-out evaluation, two RL steps, a checkpoint after each, the export, and a resume from
the first RL step's checkpoint. Checked: every metric finite; every page back in the pool after every refill
rollout, which preempted where the full run's plan can; the resume logging the uninterrupted run's metrics; and
the same metrics as the experiment rehearsed on the static engine (the engine is a speed setting, never a change
of results), where the experiment can run on it (a partial rollout needs the refill engine).

`aime` runs in make test (its rollout is the one that had never run: the refill engine in tensor-parallel groups on
an `fsdp_tp` mesh), but for its static-engine run; the others, `math` (one host: FSDP, the refill engine in pairs)
among them, are in make test-slow, for time (`math`'s run is about a minute on CI's 2 cores). `test_plans_agree`
holds the rehearsal to the full run's plan for `aime`, its baselines, its budgeted variant and its int8 KV cache."""

import json
import math
import os
import shutil

import pytest

import experiments
from experiments import smoke
from vapo_jax import metric_keys
from vapo_jax.cli import resolve, train

BUDGET = ("rollout.decode_budget=6144", "rollout.max_staleness=4", "algo.tis_cap=2")
REHEARSED = {  # name: (experiment, overrides)
    "aime": ("aime", ()),
    "aime_ppo": ("aime_ppo", ()),
    "aime_grpo": ("aime_grpo", ()),
    "aime_dapo": ("aime_dapo", ()),
    "aime_budget": ("aime", BUDGET),
    "aime_bf16": ("aime", ("rollout.kv_cache_dtype=model", "rollout.weight_dtype=model", "algo.tis_cap=null")),
    "tiny": ("tiny", ()),
    "toy": ("toy", ()),
    "math": ("math", ()),
}
FAST = {"aime": ("runs", "resumes")}  # name: the tests of it that make test runs.
VARYING = ("time/", "perf/")
# The engine's own figures: how the rollout ran, not what it sampled.
ENGINE = ("rollout/decode_steps", "rollout/slots", "rollout/slot_utilization", "rollout/preemptions",
          "rollout/recomputed_tokens", "rollout/queue_pages", "rollout/queue_pages_peak",
          "rollout/queue_pages_free_after", "rollout/prefills", "rollout/prefill_chunks", "rollout/prefill_tokens")
# The engines' log-probs agree within 1e-5 (test_refill.py); metrics computed from them agree to that, relatively.
RTOL, ATOL = 1e-5, 1e-6


def _argv(name: str, run_dir, *extra) -> list[str]:
  exp, overrides = REHEARSED[name]
  return ["--exp", exp, "--smoke", *overrides, f"run_dir={run_dir}", "checkpoint.every_steps=1", "checkpoint.keep=20",
          *extra]


def _records(run: str) -> list[dict]:
  with open(os.path.join(run, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _progress(checkpoint: str) -> dict:
  with open(os.path.join(checkpoint, "meta", "metadata")) as f:
    data = json.load(f)
  return data.get("progress", data)


def _run(argv: list[str]) -> str:
  config, _ = resolve.resolve(argv)
  assert train.main(argv) == 0, f"cli.train {' '.join(argv)} failed"
  return config.run_directory


def _after_first_rl_step(run: str) -> None:
  """Removes every checkpoint after the first RL step's, so that the next start resumes from it."""
  directory = os.path.join(run, "checkpoints")
  removed = 0
  for step in os.listdir(directory):
    progress = _progress(os.path.join(directory, step))
    if progress["stage"] == "done" or (progress["stage"] == "rl" and progress["stage_step"] > 1):
      shutil.rmtree(os.path.join(directory, step))
      removed += 1
  assert removed, "expected the finished run's checkpoint"


def _comparable(records: list[dict], drop=()) -> list[dict]:
  return [{k: v for k, v in r.items() if not k.startswith(VARYING + tuple(drop))} for r in records]


def _assert_close(a: list[dict], b: list[dict]) -> None:
  assert [(r["stage"], r["step"]) for r in a] == [(r["stage"], r["step"]) for r in b]
  for x, y in zip(a, b):
    assert x.keys() == y.keys(), (x["stage"], sorted(set(x) ^ set(y)))
    for key in x:
      if isinstance(x[key], float):
        assert math.isclose(x[key], y[key], rel_tol=RTOL, abs_tol=ATOL), (x["stage"], x["step"], key, x[key], y[key])
      else:
        assert x[key] == y[key], (x["stage"], key)


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
  """name → (its resolved config, its run directory, its records), each run once per module."""
  done = {}

  def rehearse(name: str):
    if name not in done:
      argv = _argv(name, tmp_path_factory.mktemp(name))
      done[name] = resolve.resolve(argv)[0], _run(argv)
    config, run = done[name]
    return config, run, _records(run)
  return rehearse


def _rehearsed(name: str, test: str):
  return pytest.param(name, marks=() if test in FAST.get(name, ()) else pytest.mark.slow)


@pytest.mark.parametrize("name", [_rehearsed(name, "runs") for name in REHEARSED])
def test_a_rehearsal_runs_every_stage_with_finite_metrics_and_every_page_back(name, rehearsals):
  config, run, records = rehearsals(name)
  stages = [r["stage"] for r in records]
  assert stages.count("rl") == 2 and "eval_before_rl" in stages and "eval_after_rl" in stages
  assert ("value_pretrain" in stages) == (config.algo.uses_critic and config.algo.value_pretrain_steps > 0)
  for r in records:
    bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, (r["stage"], r["step"], bad)
  paged = [r for r in records if "rollout/queue_pages" in r]
  expected = smoke.plans(config, devices=8 // config.rollout.tensor_parallel, platform="cpu")
  refill = any(not isinstance(p, str) and p.engine == "refill" for p in expected.values())
  assert bool(paged) == refill, "the refill engine ran where its plan says, and only there"
  for r in paged:
    assert r["rollout/queue_pages_free_after"] == r["rollout/queue_pages"], (r["stage"], r["step"], "pages kept")
  if any(not isinstance(p, str) and p.preempts for p in expected.values()):
    assert sum(r["rollout/preemptions"] for r in paged) > 0, "the pool never ran out: nothing rehearsed preemption"
  assert os.path.isdir(os.path.join(run, "export")) == config.checkpoint.export_final
  logged = {key for r in records for key in r}  # Every key the run logs is declared (metric_keys.py).
  assert [key for key in sorted(logged) if not metric_keys.declared(key)] == []
  rl = [r for r in records if r["stage"] == "rl"]
  assert all("actor/clip_frac_high" in r and "time/rollout_s" in r for r in rl)
  # float32: the trainer's log-probs are the sampler's, but for tokens an older policy sampled (partial rollouts)
  # or sampled from an int8 cache, which moves them by more than rounding (the micro model: about 7e-5).
  fresh = [r for r in rl if not r.get("rollout/stale_token_frac")]
  int8 = config.rollout.kv_cache_dtype == "int8"
  assert fresh and all((1e-6 < r["rollout/logprob_gap"] < 1e-3) if int8 else r["rollout/logprob_gap"] < 1e-4
                       for r in fresh)
  assert os.listdir(os.path.join(run, "tensorboard"))
  assert os.path.getsize(os.path.join(run, "plots", "reward_accuracy.png")) > 0  # Drawn at the end (matplotlib).
  assert os.listdir(os.path.join(run, "plots")) == ["reward_accuracy.png"]  # make plot draws the others.


@pytest.mark.parametrize("name", [_rehearsed(name, "resumes") for name in REHEARSED])
def test_a_rehearsal_resumed_after_its_first_rl_step_logs_the_same_metrics(name, rehearsals, tmp_path):
  _, run, records = rehearsals(name)
  copy = tmp_path / "resumed"
  shutil.copytree(os.path.dirname(run), copy)
  resumed = os.path.join(copy, os.path.basename(run))
  _after_first_rl_step(resumed)
  shutil.rmtree(os.path.join(resumed, "export"), ignore_errors=True)
  _run(_argv(name, copy))
  assert _comparable(_records(resumed)) == _comparable(records)


@pytest.mark.slow  # For time (15 s).
def test_a_finished_rehearsal_given_more_rl_steps_trains_them(rehearsals, tmp_path, capsys):
  """A finished run resumed with more `rl_steps` (a config change it allows) trains the new steps, evaluates and
  exports again, and writes a new summary; one line says the run had finished and what it trains."""
  config, run, records = rehearsals("aime")
  copy = tmp_path / "more"
  shutil.copytree(os.path.dirname(run), copy)
  more = os.path.join(copy, os.path.basename(run))
  with open(os.path.join(more, "summary.json")) as f:
    before = json.load(f)
  capsys.readouterr()
  _run(_argv("aime", copy, f"rl_steps={config.rl_steps + 1}", "checkpoint.allow_config_change=true"))
  assert (f"this run finished its {config.rl_steps} RL steps; training 1 more (rl_steps={config.rl_steps + 1})"
          in capsys.readouterr().out)
  extended = _records(more)
  assert _comparable(extended[:len(records)]) == _comparable(records)  # The first evaluation after RL included.
  assert [(r["stage"], r["step"]) for r in extended[len(records):]] == [
      ("rl", config.rl_steps), ("eval_after_rl", config.rl_steps + 1)]
  with open(os.path.join(more, "summary.json")) as f:
    assert json.load(f)["seconds"] != before["seconds"]


@pytest.mark.slow  # For time (18 s): make test holds the engines equal call by call (test_refill.py, test_pages.py).
@pytest.mark.parametrize("name", [name for name in REHEARSED if "rollout.decode_budget" not in
                                  " ".join(REHEARSED[name][1])])
def test_a_rehearsal_logs_the_static_engines_metrics(name, rehearsals, tmp_path):
  _, _, records = rehearsals(name)
  static = _run(_argv(name, tmp_path, "rollout.engine=static"))
  assert "rollout/queue_pages" not in {k for r in _records(static) for k in r}
  _assert_close(_comparable(_records(static), ENGINE), _comparable(records, ENGINE))


@pytest.mark.parametrize("name", ["aime", "aime_ppo", "aime_grpo", "aime_dapo", "aime_budget", "aime_bf16", "math"])
def test_plans_agree(name):
  """The rehearsal's plans (8 CPU devices) and the full run's (its mesh's devices, on a TPU) agree on the engine,
  on one queue per data-parallel group, and on whether the pool can run out of pages."""
  exp, overrides = REHEARSED[name]
  full, _ = resolve.full_run(experiments.get_experiment(exp), list(overrides))
  small = smoke.smoke(full)
  ours = smoke.plans(small, devices=8 // small.rollout.tensor_parallel, platform="cpu")
  theirs = smoke.plans(full, devices=None, platform="tpu")
  assert ours.keys() == theirs.keys()
  for call, plan in theirs.items():
    assert not isinstance(plan, str), f"the full run's {call} cannot run: {plan}"
    assert not isinstance(ours[call], str), f"the rehearsal's {call} cannot run: {ours[call]}"
    assert (ours[call].engine, ours[call].queues == ours[call].devices, ours[call].preempts) == (
        plan.engine, plan.queues == plan.devices, plan.preempts), call
