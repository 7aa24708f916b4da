"""Checkpoints of a whole run: one pytree of arrays plus a JSON record, with Orbax.

A checkpoint holds everything a resume needs, so that a restarted run continues exactly where
the saved one was:

  state (arrays)  actor and critic parameters, both optimizer states, the supervised stage's
                  optimizer state while it runs, the reference policy when a KL term is used,
                  and the JAX PRNG key;
  meta (JSON)     stage and steps done in it, optimizer step counters, the prompt iterator's
                  position, the supervised stage's NumPy generator state, value-pretraining
                  progress, the evaluation before RL, the length of metrics.jsonl at save time,
                  and the resolved config.

Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
half-written checkpoint is never listed; one that is listed but unreadable (truncated, files
lost) is skipped with a warning and the next older one is used.
"""

import dataclasses
import os
import signal
import threading
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from vapo_jax.config import CheckpointConfig, ConfigError, ExperimentConfig

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by SIGTERM after writing a checkpoint; run again to resume.
NOT_COMPARED = ("checkpoint.",)  # Config fields that may change between a run and its resume.


class Preempted(Exception):
  """Raised after a SIGTERM once the current step has finished and a checkpoint is written."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """`{"algo.eps_high": 0.28, ...}` from a nested dict of config fields."""
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out |= flatten(value, f"{prefix}{key}.")
    return out
  return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def config_differences(saved: dict, current: ExperimentConfig) -> list[str]:
  """`field: saved → now` for every compared field that differs between two resolved configs."""
  old, new = flatten(saved), flatten(dataclasses.asdict(current))
  diffs = []
  for key in sorted(old.keys() | new.keys()):
    if key.startswith(NOT_COMPARED) or old.get(key, "<absent>") == new.get(key, "<absent>"):
      continue
    diffs.append(f"{key}: {old.get(key, '<absent>')!r} → {new.get(key, '<absent>')!r}")
  return diffs


def abstract(tree, mesh: jax.sharding.Mesh | None = None):
  """Shapes, dtypes and shardings of a pytree of arrays: the restore target.

  With a mesh, arrays not laid out on it (an optimizer's step count, placed on one device by
  `jit`) are restored replicated over it, so that every restored array lives on the same devices.
  """
  def target(x):
    sharding = x.sharding
    if mesh is not None and not isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(target, tree)


class RunCheckpoints:
  """The run directory's checkpoints: save every N steps, keep K, restore the newest readable one."""

  def __init__(self, directory: str, config: CheckpointConfig):
    self.directory, self.config = os.path.abspath(directory), config
    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep, enable_async_checkpointing=config.async_save,
                                           create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict, *, wait: bool = False) -> None:
    """Saves (in the background when configured: arrays are copied to host before this returns)."""
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
      self.manager.wait_until_finished()

  def latest_meta(self) -> tuple[int, dict] | None:
    """The newest checkpoint whose JSON record reads, without its arrays."""
    for step in reversed(self.steps()):
      try:
        return step, self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      except Exception as e:  # Orbax raises several types for missing or corrupt files.
        self._skip(step, e)
    return None

  def restore(self, step: int, target) -> Any:
    """The arrays of checkpoint `step`, placed as `target` (a pytree of ShapeDtypeStructs) says."""
    return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state

  def restore_latest(self, make_target) -> tuple[int, Any, dict] | None:
    """(step, state, meta) of the newest fully readable checkpoint; `make_target(meta)` gives the target."""
    for step in reversed(self.steps()):
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        target = make_target(meta)  # A refusal (changed config) is raised, not skipped.
      except ConfigError:
        raise
      except Exception as e:  # Orbax raises several types for missing or corrupt files.
        self._skip(step, e)
        continue
      try:
        return step, self.restore(step, target), meta
      except Exception as e:
        self._skip(step, e)
    return None

  def _skip(self, step: int, error: Exception) -> None:
    path = os.path.join(self.directory, str(step))
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    warnings.warn(f"checkpoint {path} is incomplete or unreadable ({type(error).__name__}: {first_line[:300]}); "
                  "skipping it", stacklevel=3)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


class PreemptionFlag:
  """Set by SIGTERM (the signal a TPU VM or a scheduler sends before taking the machine away)."""

  def __init__(self):
    self.event = threading.Event()
    self._previous = None

  def install(self) -> None:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self.event.set())

  def uninstall(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def is_set(self) -> bool:
    """Whether any process of the run got the signal (all processes must then stop together)."""
    flag = self.event.is_set()
    if jax.process_count() > 1:
      flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
    return flag


def check_resumable(config: ExperimentConfig, saved_config: dict, checkpoint_dir: str) -> None:
  """Refuses a resume whose resolved config differs from the saved one, unless allowed."""
  diffs = config_differences(saved_config, config)
  if diffs and not config.checkpoint.allow_config_change:
    raise ConfigError(
        f"the run in {checkpoint_dir} was saved with a different config; refusing to resume. Fields that differ "
        f"(saved → now):\n  " + "\n  ".join(diffs) +
        "\nUse the saved values, another experiment name, or pass checkpoint.allow_config_change=true.")
  if diffs:
    warnings.warn("resuming with a changed config (checkpoint.allow_config_change=true):\n  " + "\n  ".join(diffs))
