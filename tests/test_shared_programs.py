"""A trainer whose programs an earlier trainer in the process already built (a resumed run, a test's second trainer)
gets that trainer's `Steps` (`steps.shared`): equal configs but for `run_dir`, the same mesh and model graphs. Any
other field gives its own; the checks and warnings of a `Steps` apply to every trainer, shared or not."""

import collections
import dataclasses
import warnings

import jax
import pytest
from flax import nnx

from vapo_jax.config import overrides
from vapo_jax.models import sharding
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.train import build
from vapo_jax.train import steps as steps_lib


def _shared(config, mesh, made: list):
  cfg = build.model_configs(config)[0]
  actor_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
  critic_def = nnx.graphdef(nnx.eval_shape(lambda: ValueModel(cfg, rngs=nnx.Rngs(1))))
  return steps_lib.shared(config, mesh, sharding.PRESETS[config.mesh.preset], actor_def=actor_def,
                          critic_def=critic_def, optimizers=lambda: made.append(config) or build.optimizers(config))


def test_equal_programs_share_one_steps_and_any_other_field_does_not(smoke_config, tmp_path, monkeypatch):
  monkeypatch.setattr(steps_lib, "_SHARED", collections.OrderedDict())  # Not the earlier tests' trainers'.
  mesh, made = sharding.make_mesh(data=8, devices=jax.devices()), []
  config = smoke_config()
  first = _shared(config, mesh, made)
  assert _shared(dataclasses.replace(config, run_dir=str(tmp_path / "elsewhere")), mesh, made) is first
  assert len(made) == 1
  for change in ({"optim.actor_lr": 2 * config.optim.actor_lr}, {"rl_steps": config.rl_steps + 1}, {"seed": 7}):
    assert _shared(overrides.replace_fields(config, change), mesh, made) is not first, change
  assert _shared(config, sharding.make_mesh(data=4, devices=jax.devices()[:4]), made) is not first
  assert len(made) == 5


def test_a_shared_steps_still_warns_of_micro_batches_mostly_padding(smoke_config):
  mesh = sharding.make_mesh(data=8, devices=jax.devices())
  config = smoke_config({"packing.enabled": True, "packing.micro_batch_rows": 128})
  for _ in range(2):  # Built, then shared.
    with pytest.warns(UserWarning, match=r"^packing.micro_batch_rows=128 is more rows than a mini-batch"):
      _shared(config, mesh, [])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _shared(overrides.replace_fields(config, {"packing.micro_batch_rows": 8}), mesh, [])
