"""The memory margin (`mesh.memory_margin`, default 8 %): the hand plan's refusal, the trainer's start-up
check, `make memory` and the compile report each refuse a phase that needs more than (1 − margin) of the
device memory, naming the phase, the margin and a setting to change; a phase under it passes."""

import dataclasses
import math

import jax
import pytest

from vapo_jax.cli import memory as memory_cli
from vapo_jax.cli import preflight, resolve
from vapo_jax.config import AlgoConfig, ExperimentConfig, RolloutConfig
from vapo_jax.config.sections import MeshConfig, ModelConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import advice, hand_plan, topologies, xla_report, xla_report_text

GIB = 2**30


def _config(**mesh) -> ExperimentConfig:
  return ExperimentConfig(
      name="margin_test", model=ModelConfig(preset="tiny", dtype="float32", random_init=True),
      algo=AlgoConfig(value_pretrain_steps=0, mini_batch_responses=8),
      rollout=RolloutConfig(prompts_per_step=4, samples_per_prompt=2, max_prompt_tokens=32, max_response_tokens=64),
      mesh=MeshConfig(preset="fsdp", **mesh))


def _device_gib(needs: int, share: float) -> float:
  """Device memory in GiB of which `needs` bytes are `share`."""
  return needs / share / GIB


def test_the_margin_is_checked_and_defaults_to_8_percent():
  assert MeshConfig().memory_margin == 0.08
  for bad in (-0.01, 1.0):
    with pytest.raises(ConfigError, match=r"MeshConfig\.memory_margin must be in \[0\.0, 1\.0\)"):
      MeshConfig(memory_margin=bad)
  assert hand_plan.allowed_bytes(100 * GIB, 0.08) == int(92 * GIB) and hand_plan.allowed_bytes(None, 0.08) is None


def test_a_plan_over_the_margin_is_refused_naming_the_phase_and_the_margin():
  plan = hand_plan.plan_memory(_config(), {"data": 8})
  peak = max(plan.phase_bytes(), key=plan.phase_bytes().get)
  device = math.ceil(plan.peak_bytes / 0.95)  # The peak is 95 % of the device: fits whole, not within 92 %.
  advice.refuse(plan, device, margin=0.0)
  advice.refuse(plan, math.ceil(plan.peak_bytes / 0.92) + 1, margin=0.08)
  with pytest.raises(ConfigError) as error:
    advice.refuse(plan, device, margin=0.08)
  message = str(error.value)
  assert "92% of the" in message and "mesh.memory_margin=0.08" in message, message
  assert f"\n  {peak} needs " in message and "no single setting fits" not in message, message
  assert "does NOT fit" in plan.format(device, margin=0.08) and "fits (" in plan.format(device)


def test_the_start_up_check_refuses_a_phase_over_the_margin():
  devices = jax.devices()
  plan = hand_plan.plan_memory(_config(), {"data": len(devices)})
  gib = _device_gib(plan.peak_bytes, 0.95)
  with pytest.raises(ConfigError, match=r"mesh\.memory_margin=0\.08"):
    preflight.check_memory(_config(device_memory_gib=gib), devices, show=False)
  preflight.check_memory(_config(device_memory_gib=gib, memory_margin=0.0), devices, show=False)


def test_make_memory_refuses_a_plan_over_the_margin(capsys):
  config, _ = resolve.resolve(["--exp", "tiny"])
  plan = hand_plan.plan_memory(config, {"data": 8})
  args = ["--exp", "tiny", "--mesh", "data=8", "--device-gib", f"{_device_gib(plan.peak_bytes, 0.95):.9f}"]
  assert memory_cli.main(args) == 1
  out = capsys.readouterr().out
  assert "(92% of" in out and "does NOT fit" in out and "refused: " in out and "mesh.memory_margin=0.08" in out
  assert memory_cli.main(args + ["mesh.memory_margin=0.0"]) == 0
  assert "fits (" in capsys.readouterr().out


def test_the_compile_report_refuses_a_phase_over_the_margin(smoke_config):
  """XLA's figure for the rollout at 93 % of a given device memory: refused at the default margin, naming
  the phase, the margin and a setting; accepted with no margin."""
  config = smoke_config({"eval.path": None, "mesh.device_memory_gib": 1.0, "rollout.slots": 24})  # 3 per device.
  target = topologies.named("cpu:8")
  report = xla_report.compile_run(config, target, phases=("rollout",))
  needs = report.phases[0].needs

  def at(**mesh):
    c = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, device_memory_gib=_device_gib(needs, 0.93),
                                                             **mesh))
    return dataclasses.replace(report, config=c, budget=xla_report.budget(c, target))
  over = at()
  assert [p.name for p in over.over()] == ["rollout"] and needs <= over.budget
  message = xla_report_text.refusal(over)
  assert "92% of" in message and "mesh.memory_margin=0.08" in message, message
  assert message.splitlines()[1].startswith("  rollout needs ") and "rollout.pages=4 (now 7;" in message, message
  assert "does NOT fit (rollout over)" in xla_report_text.table(over)
  whole = at(memory_margin=0.0)
  assert not whole.over() and xla_report_text.refusal(whole) is None and "fits (" in xla_report_text.table(whole)
