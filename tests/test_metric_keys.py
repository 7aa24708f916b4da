"""Metric keys: declared once (`vapo_jax/metric_keys.py`), listed once in docs/logs.md, the keys the plots draw all
declared, older runs' keys read under today's names, and the verifier's metrics over dynamic sampling's rounds
against a loop over the rounds. (Every key a trainer run logs is declared: tests/test_trainer.py.)"""

import os

import pytest

from vapo_jax import metric_keys
from vapo_jax.cli import plots, sweep_report
from vapo_jax.train.experience import verifier_rounds

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "logs.md")


def test_docs_logs_lists_every_key_once():
  text = open(DOCS, encoding="utf-8").read()
  assert metric_keys.table() in text
  rows = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
  assert sorted(rows) == sorted(metric_keys.KEYS) and len(rows) == len(set(rows))


def test_declared_keys_and_patterns():
  assert metric_keys.declared("critic/value_bias_decile_3") and metric_keys.declared("actor/clip_frac_high")
  assert metric_keys.declared("stage") and metric_keys.declared("global_step")
  for key in ("critic/value_bias_decile_x", "critic/value_bias_decile_", "time/scoring_s", "reward/mean", "actor/x"):
    assert not metric_keys.declared(key), key
  assert not set(metric_keys.OLD_NAMES) & set(metric_keys.KEYS)  # An old name is not a name today.
  assert all(new is None or metric_keys.declared(new) for new in metric_keys.OLD_NAMES.values())


def test_every_plotted_key_is_declared():
  keys = [key for *_, metrics in plots.FIGURES for _, key in metrics]
  keys += [f[3] for f in sweep_report.FIGURES] + [m[2] for m in sweep_report.MECHANISMS]
  assert [key for key in keys if not metric_keys.declared(key)] == []


def test_an_older_runs_keys_are_read_under_todays_names():
  current = metric_keys.current
  assert current({"step": 1, "time/scoring_s": 2.0, "time/verify_s": 2.0}) == {"step": 1, "time/verify_s": 2.0}
  assert current({"time/scoring_s": 3.0}) == {"time/verify_s": 3.0}
  assert current({"reward/mean": 0.5, "rollout/reward_mean": 0.25}) == {"rollout/reward_mean": 0.25}
  assert current({"user/own_key": 1.0}) == {"user/own_key": 1.0}  # Unknown keys pass through.


def test_the_verifiers_metrics_over_rounds_against_a_loop():
  rounds = [(8, 2.0, {"reward/no_answer_frac": 0.25, "reward/verifier_timeouts": 1.0, "time/verify_s": 0.5,
                      "perf/verify_responses_per_s": 16.0}),
            (4, -4.0, {"reward/no_answer_frac": 1.0, "reward/verifier_timeouts": 0.0, "time/verify_s": 1.5,
                       "perf/verify_responses_per_s": 2.667})]
  got = verifier_rounds(rounds)
  no_answer = 0.0
  for n, _, m in rounds:  # Responses without an answer, counted round by round.
    no_answer += n * m["reward/no_answer_frac"]
  assert got["reward/no_answer_frac"] == pytest.approx(no_answer / 12)
  assert got["reward/sampled_mean"] == pytest.approx((2.0 - 4.0) / 12)
  assert got["reward/verifier_timeouts"] == 1.0 and got["time/verify_s"] == 2.0
  assert got["perf/verify_responses_per_s"] == pytest.approx(12 / 2.0)
  assert sorted(got) == sorted(set(rounds[0][2]) | {"reward/sampled_mean"})
