"""The roofline (`vapo_jax/roofline`) of a smoke run compiled for a TPU topology (v5p:2x2x1) with the paged refill
engine: both engines priced at the same KV bytes under two response-length profiles, each decode itemised, and
partial rollouts in steady state. In make test-slow; skipped without libtpu."""

import pytest

from conftest import build_smoke_config
from vapo_jax.memory import topologies, xla_report
from vapo_jax.roofline import step as roofline
from vapo_jax.roofline import text as roofline_text

pytestmark = pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
TOPOLOGY = "v5p:2x2x1"
QUICK = {"eval.path": None}


@pytest.mark.slow  # make test-slow: the smoke run compiled again, with the paged refill engine.
def test_the_roofline_compares_the_paged_engine_with_the_contiguous_one(tmp_path):
  """A smoke run whose pool holds fewer sequences than it decodes compiles the paged engine; the roofline prices
  both engines at the same KV bytes under two profiles, each decode itemised, its bound without the rest below
  it, and says the paged rollout's speed against the contiguous one's."""
  from vapo_jax.roofline import profiles

  config = build_smoke_config(tmp_path, QUICK | {"rollout.slots": 8, "rollout.page_tokens": 8, "rollout.pages": 24})
  report = xla_report.compile_run(config, topologies.named(TOPOLOGY))
  assert report.refill and report.plan.pages == report.plan.queue_pages == 24
  assert roofline.engines(report) == ("paged", "contiguous")
  prompts, where = profiles.prompt_lengths(config)
  estimates = roofline.compare(report, [profiles.at_cap(config, prompts, where),
                                        profiles.log_normal(config, prompts, where)])
  assert [label for label, _ in estimates] == ["A, paged", "A, contiguous", "B, paged", "B, contiguous"]
  for label, step in estimates:
    d = step.decode
    assert d.engine == label.split(", ")[1] and 0 < d.floor_s <= d.seconds and d.steps > 0, label
    assert d.bytes >= d.steps * (d.weights + d.kv_written), label
  # Partial rollouts on profile B: rounds of half the cap, each round's carried tokens prefilled again.
  cap = config.rollout.max_response_tokens
  budgeted = roofline.estimate(report, profiles.log_normal(config, prompts, where), "paged", (cap // 2, 1))
  replay, whole = budgeted.partial, dict(estimates)["B, paged"]
  assert replay.rounds >= replay.steps and replay.load.steps == budgeted.decode_steps * replay.steps
  assert budgeted.decode_steps <= replay.rounds / replay.steps * cap // 2
  # The round's programs but its decode loop (start, finish: bytes, no FLOPs since the prefill went into the
  # loop) run once a round.
  rest = lambda step: step.phase("rollout").bytes - step.decode.bytes
  assert rest(whole) > 0 and rest(budgeted) == pytest.approx(rest(whole) * replay.rounds / replay.steps)
  assert budgeted.phase("update").flops == whole.phase("update").flops
  estimates.append((f"B, paged, budget {cap // 2}", budgeted))
  text = roofline_text.format_comparison(report, estimates)
  for letter in "AB":
    assert f"profile {letter}: the paged rollout is " in text and "with the decode's rest left out" in text
  assert f"rounds of {cap // 2}" in text and "of the trained tokens stale" in text
