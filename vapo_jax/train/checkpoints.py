"""Checkpoints of a whole run: one pytree of arrays plus a JSON record, with Orbax.

A checkpoint holds everything a resume needs, so that a restarted run continues exactly where
the saved one was:

  state (arrays)  the run's `state.TrainState` (`state.to_checkpoint`): actor and critic
                  parameters, both optimizer states (with optax's update counts), the supervised
                  stage's optimizer state while it runs, the reference policy when a KL term is
                  used, and the PRNG key (as its raw uint32 data);
  meta (JSON)     the run's `state.Progress` (stage and steps done in it, the prompt iterator's
                  position, the supervised stage's NumPy generator state, value-pretraining
                  progress, the evaluations), the length of metrics.jsonl at save time, and the
                  resolved config;
  host (files)    NumPy host arrays, one `.npy` file each (`host_arrays`): partial rollouts'
                  carry, when sequences are in flight.

Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
half-written checkpoint is never listed; one that is listed but unreadable (truncated, files
lost) is skipped with a warning and the next older one is used.
"""

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from vapo_jax import distributed, files
from vapo_jax.config import CheckpointConfig, ExperimentConfig
from vapo_jax.errors import ConfigError, UserError
from vapo_jax.models import hub
from vapo_jax.train import background_saves as background
from vapo_jax.train import host_arrays

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by SIGTERM after writing a checkpoint; run again to resume.
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: stopped by Ctrl-C after writing a checkpoint.
# Config fields that may change between a run and its resume. `run_dir`: the checkpoints are read from the
# run's directory, wherever it now lies (a run directory moved or copied to another parent is the same run).
NOT_COMPARED = ("checkpoint.", "log.wandb", "run_dir")
# Fields holding paths: the same file spelled differently ("runs" and "/home/me/runs") is no change.
PATH_FIELDS = ("data.train_path", "eval.path", "sft.path", "model.checkpoint", "model.critic_checkpoint",
               "model.tokenizer")


class Preempted(Exception):
  """Raised after a SIGTERM or Ctrl-C once the current step has finished and a checkpoint is written;
  `exit_code` is what the process should exit with (75 for SIGTERM, 130 for SIGINT)."""

  def __init__(self, message: str, *, exit_code: int = PREEMPTED_EXIT_CODE):
    super().__init__(message)
    self.exit_code = exit_code


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """`{"algo.eps_high": 0.28, ...}` from a nested dict of config fields."""
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out |= flatten(value, f"{prefix}{key}.")
    return out
  return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def same_path(a: Any, b: Any) -> bool:
  """Whether two path settings name the same file: equal once made absolute (relative to the
  working directory), or the same existing file (symbolic links followed)."""
  if not isinstance(a, str) or not isinstance(b, str):
    return False
  if hub.is_hub(a) or hub.is_hub(b):  # A Hub model: its name, not a file.
    return a == b
  if os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b)):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def config_differences(saved: dict, current: ExperimentConfig) -> list[str]:
  """`field: saved → now` for every compared field that differs between two resolved configs
  (a path field spelled differently for the same file does not differ)."""
  old, new = flatten(saved), flatten(dataclasses.asdict(current))
  defaults = flatten(dataclasses.asdict(ExperimentConfig(name=current.name)))
  diffs = []
  for key in sorted(old.keys() | new.keys()):
    if key.startswith(NOT_COMPARED) or old.get(key, "<absent>") == new.get(key, "<absent>"):
      continue
    if key not in old and new[key] == defaults.get(key, "<absent>"):
      continue  # A field added since the checkpoint was saved, at its default: the run is the same.
    if key in PATH_FIELDS and same_path(old.get(key), new.get(key)):
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


def _split(tree) -> tuple[Any, dict | None]:
  """(the tree without its host arrays, those arrays: a dict's `host` entry, saved by `host_arrays` beside it)."""
  if not isinstance(tree, dict):
    return tree, None
  return {k: v for k, v in tree.items() if k != host_arrays.ITEM}, tree.get(host_arrays.ITEM) or None


def complete_steps(directory: str) -> list[int]:
  """The numbers of the complete checkpoints in `directory` (Orbax renames a save to its number when it
  finishes; one being written is a temporary directory), oldest first; none when the directory does not
  exist."""
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


class RunCheckpoints:
  """The run directory's checkpoints: save every N steps, keep K, restore the newest readable one.

  A full disk or an unwritable directory while saving (found when the save, or the run, waits for it) is
  a `SetupError` naming the directory; the partial checkpoint is removed and the complete ones stay, so a
  resume works.
  """

  def __init__(self, directory: str, config: CheckpointConfig):
    self.directory, self.config, self.failed, self._unchecked = os.path.abspath(directory), config, False, False
    self._skipped: set[int] = set()  # Checkpoints found unreadable (warned once each).
    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep,
                                           enable_async_checkpointing=config.async_save,
                                           create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    absl_log = logging.getLogger("absl")
    if not any(isinstance(f, background.NoDiskFullTracebacks) for f in absl_log.filters):
      absl_log.addFilter(background.NoDiskFullTracebacks())
    background.quiet_noise()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  @contextlib.contextmanager
  def _saving(self, what: str) -> Iterator[None]:
    """A full disk (or an unwritable directory) in the block: the background saves are let finish, the
    partial checkpoint removed, and a `SetupError` says what to do and what a resume starts from."""
    try:
      yield
    except Exception as e:
      if files.disk_full_cause(e) is None and files.unwritable_cause(e) is None:
        raise
      self.failed = True
      background.quiet_after_failure()
      background.wait_at_most(self.manager, background.WAIT_AFTER_FAILURE_S)  # A stuck save: not waited out.
      background.join()
      complete = complete_steps(self.directory)
      if distributed.is_main_process():
        for name in os.listdir(self.directory):
          if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      resume = (f"it resumes from checkpoint {complete[-1]}, which is intact" if complete else
                "no checkpoint was complete yet, so it starts afresh")
      raise files.write_failure(e, self.directory, what,
                                after=f"then run the same command again: {resume}") from None

  def save(self, step: int, state, meta: dict, *, wait: bool = False) -> None:
    """Saves (in the background when configured: arrays are copied to host before this returns). A dict
    `state`'s `host` entry (nested dicts of NumPy arrays) is written as files before this returns
    (`host_arrays`)."""
    with self._saving("saving a checkpoint"):
      if distributed.is_main_process():
        background.probe(self.directory)  # Each save: a directory turned read-only stops the run now, in one line.
      state, host = _split(state)
      items = {"meta": ocp.args.JsonSave(meta)} | ({"state": ocp.args.StandardSave(state)} if state else {})
      if host:  # Host arrays: written now, from themselves (`host_arrays`).
        items[host_arrays.ITEM] = host_arrays.HostArraysSave(host)
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
      self._unchecked = True  # `check` probes the directory once after it.
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
    """The arrays of checkpoint `step`, placed as `target` (a pytree of ShapeDtypeStructs) says; its `host`
    entry, if any, is NumPy arrays filled in place from the checkpoint's host arrays."""
    target, host = _split(target)
    items = {"state": ocp.args.StandardRestore(target)} if target else {}
    if host:
      items[host_arrays.ITEM] = host_arrays.HostArraysRestore(host)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    return (restored.state if target else {}) | (
        {host_arrays.ITEM: restored[host_arrays.ITEM]} if host else {})

  def restore_latest(self, make_target, accept=None) -> tuple[int, Any, dict] | None:
    """(step, state, meta) of the newest fully readable checkpoint; `make_target(meta)` gives the target, and
    `accept(state, meta)` takes it (a damaged record it raises on: the next older one is tried)."""
    for step in reversed(self.steps()):
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        target = make_target(meta)  # A refusal (changed config) is raised, not skipped.
      except UserError:
        raise
      except Exception as e:  # Orbax raises several types for missing or corrupt files.
        self._skip(step, e)
        continue
      try:
        state = self.restore(step, target)
        if accept is not None:
          accept(state, meta)
        return step, state, meta
      except UserError:
        raise
      except Exception as e:
        self._skip(step, e)
    return None

  def _skip(self, step: int, error: Exception) -> None:
    if step in self._skipped:  # Found by `latest_meta`, then by `restore_latest`: said once.
      return
    self._skipped.add(step)
    path = os.path.join(self.directory, str(step))
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    warnings.warn(f"checkpoint {path} is incomplete or unreadable ({type(error).__name__}: "
                  f"{first_line[:300]}); skipping it", stacklevel=3)

  def check(self) -> None:
    """Between steps, before anything else writes in the run directory: a background save that failed, or one
    in flight into a directory no longer writable, is its one-line error now (naming this directory), not a
    wait of minutes (Orbax's) at the next save or at the end."""
    if self.failed:
      return
    with self._saving("saving a checkpoint"):
      self.manager.check_for_errors()
      if (self._unchecked or self.manager.is_saving_in_progress()) and distributed.is_main_process():
        background.probe(self.directory)  # Orbax reports no error of a save whose directory went read-only under it.
      self._unchecked = False

  def wait(self) -> None:
    self.check()
    with self._saving("saving a checkpoint"):
      self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save and closes; after a failed save, only closes (its error was raised)."""
    try:
      if not self.failed:
        self.check()
        with self._saving("saving the last checkpoint"):
          self.manager.wait_until_finished()
    finally:
      with contextlib.suppress(Exception) if self.failed else contextlib.nullcontext():
        self.manager.close()
      if not self.failed:  # (After a failure `_saving` gave them their time.)
        background.join()  # Its metadata writers too: nothing writes here once closed.


class PreemptionFlag:
  """Set by SIGTERM (the signal a TPU VM or a scheduler sends before taking the machine away) or
  SIGINT (Ctrl-C): the run finishes its step, saves and stops. A SIGINT after the first signal
  raises KeyboardInterrupt at once (abort without saving). `signum` is the first signal received;
  `exit_code` is 130 after SIGINT, else 75."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.event = threading.Event()
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def install(self) -> None:
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)

  def uninstall(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}

  def _handle(self, signum: int, frame) -> None:
    if self.event.is_set():
      if signum == signal.SIGINT:
        with contextlib.suppress(OSError):
          os.write(2, b"\nsecond Ctrl-C: aborting now, without saving\n")
        raise KeyboardInterrupt
      return  # A repeated SIGTERM: already stopping.
    self.signum = signum
    self.event.set()
    how = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
    again = "; press Ctrl-C again to abort at once without saving" if signum == signal.SIGINT else ""
    with contextlib.suppress(OSError):  # Nobody reads stderr any more (make and its pipe gone): save all the same.
      os.write(2, f"\n{how} received: finishing the current step, then saving a checkpoint and stopping "
                  f"(exit {self.exit_code}{again})\n".encode())

  @property
  def exit_code(self) -> int:
    return INTERRUPTED_EXIT_CODE if self.signum == signal.SIGINT else PREEMPTED_EXIT_CODE

  @property
  def signal_name(self) -> str:
    """What stopped the run, for messages: "SIGTERM", "Ctrl-C (SIGINT)" (a signal on another process: "SIGTERM")."""
    return "Ctrl-C (SIGINT)" if self.signum == signal.SIGINT else "SIGTERM"

  def is_set(self) -> bool:
    """Whether any process of the run got the signal (all processes must then stop together)."""
    return distributed.any_process(self.event.is_set())


# How a checkpoint's decoder-layer parameters (and their optimizer states) are laid out: "stacked", one
# `[L, ...]` array per parameter (models/transformer.py). Checkpoints without the record were written by
# the per-layer code (`model.layers.{i}.*`), whose arrays do not map onto this state's.
LAYER_LAYOUT = "stacked"


def check_layer_layout(meta: dict, checkpoint_dir: str) -> None:
  """A `ConfigError` (one line) for a checkpoint whose layer layout is not this code's: resuming from
  it would otherwise fail to restore and start the run afresh."""
  layout = meta.get("layer_layout", "per-layer")
  if layout != LAYER_LAYOUT:
    raise ConfigError(
        f"the checkpoints in {checkpoint_dir} hold {layout} decoder-layer parameters (model.layers.N.*), and "
        "this code stacks them (model.layers.* of shape [L, ...]); refusing to resume (it would start "
        "afresh): resume them with the code that wrote them, or start a new run (another name= or run_dir=)")


def check_resumable(config: ExperimentConfig, saved_config: dict, checkpoint_dir: str) -> None:
  """Refuses a resume whose resolved config differs from the saved one, unless allowed."""
  diffs = config_differences(saved_config, config)
  if diffs and not config.checkpoint.allow_config_change:
    raise ConfigError(
        f"the run in {checkpoint_dir} was saved with a different config; refusing to resume. Fields that "
        f"differ (saved → now):\n  " + "\n  ".join(diffs) +
        "\nUse the saved values, another experiment name, or pass checkpoint.allow_config_change=true.")
  if diffs and (checkpoint_dir,
                tuple(diffs)) not in _WARNED_CHANGES:  # Checked at start and at the restore: said once.
    _WARNED_CHANGES.add((checkpoint_dir, tuple(diffs)))
    warnings.warn("resuming with a changed config (checkpoint.allow_config_change=true):\n  " + "\n  ".join(diffs),
                  stacklevel=2)


_WARNED_CHANGES: set[tuple[str, tuple[str, ...]]] = set()
