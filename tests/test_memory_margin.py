"""The memory margin (`mesh.memory_margin`, default 8 %): the trainer's start-up check, `make memory` and
the compile report each refuse a phase whose XLA figure needs more than (1 − margin) of the device memory,
naming the phase, the margin and a setting to change; a phase under it passes."""

import dataclasses
import re

import jax
import pytest

from vapo_jax.cli import memory as memory_cli
from vapo_jax.cli import preflight
from vapo_jax.config.sections import MeshConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import topologies, verdict, xla_report, xla_report_text
from vapo_jax.rollout import common
from vapo_jax.train import build, responses

GIB = 2**30
ROLLOUT = {"eval.path": None, "sft.steps": 0, "algo.value_pretrain_steps": 0}


def _device_gib(needs: float, share: float) -> float:
  """Device memory in GiB of which `needs` bytes are `share`."""
  return needs / share / GIB


def test_the_margin_is_checked_and_defaults_to_8_percent():
  assert MeshConfig().memory_margin == 0.08
  for bad in (-0.01, 1.0):
    with pytest.raises(ConfigError, match=r"MeshConfig\.memory_margin must be in \[0\.0, 1\.0\)"):
      MeshConfig(memory_margin=bad)
  assert xla_report.allowed_bytes(100 * GIB, 0.08) == int(92 * GIB) and xla_report.allowed_bytes(None,
                                                                                                 0.08) is None


@pytest.mark.slow  # For time (45 s): make test covers make train's refusal (test_trainer_failures.py).
def test_the_start_up_check_and_make_memory_refuse_a_phase_over_the_margin(smoke_config, capsys, monkeypatch,
                                                                           tmp_path):
  """The run's peak phase at 95 % of a given device memory: the start-up check (on the run's own devices) and
  `make memory` (without TOPOLOGY: this machine's devices) refuse it at the default margin, naming the margin;
  with no margin both pass, and the start-up check's verdict is kept: the next start reads it, compiling nothing."""
  config = smoke_config(ROLLOUT)
  report = xla_report.compile_run(config, topologies.here(jax.devices()))
  peak = max(p.needs for p in report.phases)
  gib = _device_gib(peak, 0.95)
  at = lambda **mesh: dataclasses.replace(config,
                                          mesh=dataclasses.replace(config.mesh, device_memory_gib=gib,
                                                                   **mesh))
  with monkeypatch.context() as patch:
    patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))  # Where a verdict that fits is kept.
    with pytest.raises(ConfigError, match=r"mesh\.memory_margin=0\.08"):
      preflight.check_memory(at(), jax.devices(), show=False)
    fits = verdict.check(at(memory_margin=0.0), jax.devices(), show=False)
    patch.setattr(xla_report, "compile_run", lambda *a,
                  **k: pytest.fail("compiled again"))  # Kept: read back.
    assert verdict.check(at(memory_margin=0.0), jax.devices(), show=False) == fits and "fits (" in fits
    assert verdict.key(at(memory_margin=0.0), topologies.here(jax.devices())) != \
        verdict.key(at(memory_margin=0.01), topologies.here(jax.devices()))
  args = ["--smoke", f"run_dir={tmp_path}", "eval.path=None", "sft.steps=0", "algo.value_pretrain_steps=0",
          f"mesh.device_memory_gib={gib:.12f}"]
  capsys.readouterr()
  assert memory_cli.main(args) == 1
  out = capsys.readouterr().out
  assert "(92%: mesh.memory_margin=0.08): does NOT fit" in out and "\nrefused: the run does not fit cpu:8" in out
  assert memory_cli.main(args + ["mesh.memory_margin=0.0"]) == 0
  assert "fits (" in capsys.readouterr().out


@pytest.mark.slow  # For time (18 s): make train's refusal (test_trainer_failures.py) names phase, margin, pages.
def test_the_compile_report_refuses_a_phase_over_the_margin(smoke_config):
  """XLA's figure for the rollout at 93 % of a given device memory: refused at the default margin, naming
  the phase, the margin and a setting; accepted with no margin."""
  config = smoke_config({"eval.path": None, "mesh.device_memory_gib": 1.0,
                         "rollout.slots": 24})  # 3 per device.
  target = topologies.named("cpu:8")
  report = xla_report.compile_run(config, target, phases=("rollout",))
  needs = report.phases[0].needs

  def at(**mesh):
    c = dataclasses.replace(config,
                            mesh=dataclasses.replace(config.mesh, device_memory_gib=_device_gib(needs, 0.93),
                                                             **mesh))
    return dataclasses.replace(report, config=c, device_bytes=xla_report.device_bytes(c, target))
  over = at()
  assert [p.name for p in over.over()] == ["rollout"] and needs <= over.device_bytes
  message = xla_report_text.refusal(over)
  assert "92% of" in message and "mesh.memory_margin=0.08" in message, message
  named = re.search(r"set rollout\.pages=(\d+) \(compiled: rollout needs ([\d.]+) KiB\)", message)
  assert message.splitlines()[1].startswith("  rollout needs ") and named, message
  allowed = re.search(r"([\d.]+) KiB per device allowed", message)
  plan = responses.plan(config, build.model_configs(config)[0], prompts=config.rollout.prompts_per_step,
                         samples_per_prompt=config.rollout.samples_per_prompt, devices=8,
                         prompt_tokens=common.prompt_bucket(config.rollout.max_prompt_tokens))
  # Fewer pages than the run's own, and at least a prompt and a response's; compiled, they fit the margin.
  assert plan.least_pages <= int(named[1]) < plan.pages and float(named[2]) <= float(allowed[1]), message
  assert "does NOT fit (rollout over)" in xla_report_text.table(over)
  whole = at(memory_margin=0.0)
  assert not whole.over() and xla_report_text.refusal(whole) is None and "fits (" in xla_report_text.table(whole)


def test_a_kept_verdict_is_keyed_by_the_model_the_checkpoint_holds_and_a_file_of_another_shape_is_compiled_again(
    tmp_path, monkeypatch):
  """The same `model.checkpoint` path with another model behind it is another key (compiled again); a kept file
  whose table is not text is read as not kept."""
  import json

  from vapo_jax.config import ExperimentConfig
  from vapo_jax.config.sections import ModelConfig
  from vapo_jax.models.config import preset

  checkpoint = tmp_path / "ckpt"
  checkpoint.mkdir()
  write = lambda cfg: (checkpoint / "config.json").write_text(json.dumps(cfg.to_hf()))
  config = ExperimentConfig(name="k", model=ModelConfig(checkpoint=str(checkpoint)))
  target = topologies.here(jax.devices())
  write(preset("tiny"))
  small = verdict.key(config, target)
  assert verdict.key(config, target) == small  # The same model: the same key.
  write(dataclasses.replace(preset("tiny"), num_layers=preset("tiny").num_layers + 2))
  assert verdict.key(config, target) != small
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
  (tmp_path / "cache").mkdir()
  for content in ({"key": small, "table": 3}, [small], {"key": small}, "text"):
    (tmp_path / "cache" / f"{verdict.PREFIX}{small}.json").write_text(json.dumps(content))
    assert verdict._load(small) is None, content


def test_make_memorys_profile_is_read_before_anything_compiles(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(xla_report, "compile_run", lambda *a, **k: pytest.fail("compiled before reading "
                                                                             "--profile"))
  assert memory_cli.main(["--exp", "tiny", "--profile", str(tmp_path / "no_such_run")]) == 2
  assert "no_such_run/metrics.jsonl: cannot read the run's logged response lengths" in capsys.readouterr().err
