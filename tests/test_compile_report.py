"""The compile report on the tests' 8 CPU devices, for every sharding preset: it compiles the very
programs the trainer runs (the same lowered modules as the trainer's, lowered on its real arrays), and
XLA's figures are the real arrays' bytes."""

import jax
import numpy as np
import pytest

from vapo_jax.memory import aot, topologies, xla_report, xla_report_text
from vapo_jax.train.trainer import Trainer

QUICK = {"sft.steps": 0, "eval.path": None}
# fsdp (aime's preset) with aime's remat and scoring in micro-batches (a module made outside the micro-batch
# loop once failed there under nnx.remat).
# dp pads every sequence; the others pack rows (packing.enabled, the default).
LAYOUTS = {"dp": {"mesh.data": -1, "packing.enabled": False},
           "fsdp": {"mesh.data": 2, "mesh.fsdp": 4, "model.remat": "minimal", "algo.micro_batch_responses": 8,
                    "packing.fill_micro_batches": True},
           "fsdp_tp": {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}}


def _trainer_programs(trainer: Trainer, update: bool):
  """One step's rollout, scoring (and update) on the trainer's real arrays: {program name: (lowered, args)}.
  Packed, at the most rows a plan can need (every sequence in a row of its own), as the report compiles."""
  state, key = trainer.state.split_key()
  out, rewards, correct, *_ = trainer.experience.sample(state, trainer.progress.prompts, key)
  steps, size = trainer.steps, rewards.shape[0]
  plan = steps.plan_packing(state, out)
  placement = plan and plan.placement
  rows = steps.largest_rows
  score = steps.score_program(critic_only=False, rows=rows(size))
  args = (state, out, rewards, correct, placement)
  programs = {"score": (score.lower(*args), args)}
  if update:
    batch, _ = score(*args)
    mini = min(trainer.config.algo.mini_batch_responses, size)
    ppo = steps.ppo_program(state, actor=True, critic=True, rows=rows(mini))
    members = plan and plan.members
    assert members is None or members.shape[2] == 2 * mini  # As the report compiles them.
    args = (state, batch, placement, members)
    programs["update (critic + actor)"] = (ppo.lower(*args), args)
  return programs, (out, rewards, correct)


# Every preset's scoring; fsdp's (the aime preset's) update too (the slowest compile of the smoke run). dp
# (padded) in make test; fsdp and fsdp_tp (packed) in make test-slow, for time (tests/test_compile_tpu.py
# compiles the packed smoke run's every phase in make test).
@pytest.mark.parametrize("preset", [p if p == "dp" else pytest.param(p, marks=pytest.mark.slow) for p in LAYOUTS])
def test_the_report_compiles_the_trainers_programs(smoke_config, preset):
  config = smoke_config(QUICK | {"mesh.preset": preset} | LAYOUTS[preset])
  update = preset == "fsdp"
  report = xla_report.compile_run(config, topologies.named("cpu:8"), phases=("update",) if update else ("scoring",))
  assert [p.name for p in report.phases] == ["rollout", "scoring"] + ["update"] * update
  trainer = Trainer(config, write_logs=False, verbose=False)
  real, verified = _trainer_programs(trainer, update)
  trainer.close()  # Its verifier's workers, which would otherwise die at exit with a traceback.
  for name, (lowered, args) in real.items():
    program = report.program(name)
    assert program.fingerprint == aot.lowered_fingerprint(lowered), name
    compiled = lowered.compile().memory_analysis()
    assert program.memory.arguments == compiled.argument_size_in_bytes, name
    assert program.memory.temporaries == compiled.temp_size_in_bytes, name
    assert program.inputs == aot.chip_bytes(args), name  # Every array passed, XLA reading it or not.
    assert program.needs == program.inputs + program.resident + compiled.output_size_in_bytes - \
        compiled.alias_size_in_bytes + compiled.temp_size_in_bytes
  if update:  # The rollout, its rewards and verdicts are held beside the update.
    assert report.program("update (critic + actor)").resident == aot.chip_bytes(verified)
  assert report.device_bytes is None and "no device memory known" in xla_report_text.table(report)


def test_a_device_memory_refuses_the_phase_over_it(smoke_config):
  """On CPU devices with a given memory (mesh.device_memory_gib), a phase over it is named with what to change."""
  config = smoke_config(QUICK | {"mesh.device_memory_gib": 1e-4})
  report = xla_report.compile_run(config, topologies.named("cpu:8"), phases=("rollout",))
  assert report.device_bytes == int(1e-4 * 2**30) and [p.name for p in report.over()] == ["rollout"]
  message = xla_report_text.refusal(report)
  assert message.splitlines()[1].startswith("  rollout needs ") and "generate" in message
  assert "does NOT fit (rollout over)" in xla_report_text.table(report)


def test_a_device_memory_that_holds_every_phase_passes(smoke_config):
  report = xla_report.compile_run(smoke_config(QUICK | {"mesh.device_memory_gib": 1.0}), topologies.named("cpu:8"),
                                  phases=("rollout",))
  assert not report.over() and xla_report_text.refusal(report) is None
  assert "fits (" in xla_report_text.table(report)
  program = report.program("generate")
  assert program.decode is not None and program.attention == ("chunked", "decode")
  assert 0 < program.memory.total < 2**30 and program.lower_s > 0 and program.compile_s > 0


def test_unknown_phase_and_cpu_count_are_user_errors(smoke_config):
  with pytest.raises(ValueError, match="unknown phase"):
    xla_report.compile_run(smoke_config(QUICK), topologies.named("cpu:8"), phases=("rollouts",))
  with pytest.raises(ValueError, match="device_count=3"):
    topologies.named("cpu:3")
  assert len(topologies.named("cpu:8").devices) == 8 == len(jax.devices())
  assert np.isclose(topologies.refused_bytes(RuntimeError("... temporaries (155.78G) exceeds available HBM (95.74G)")),
                    155.78 * 2**30)
