"""Saving a run and taking it up again: the part of `Trainer` that writes checkpoints and exports.

  Trainer(Saving)   # the methods below read the trainer's config, state, progress, steps, writer, log

A checkpoint is (state, progress) (`checkpoints.py`), saved every `checkpoint.every_steps` steps
(`_after_step`) and at each stage boundary (`_enter`); a new Trainer on the same run directory opens the
checkpoints (`_open_checkpoints`: refused when `checkpoint.resume` is false or the config changed) and
continues from the newest complete one (`_resume`, which reopens the logs where it left them). After SIGTERM
or Ctrl-C the current step finishes, a checkpoint is saved (or the periodic one awaited) and
`checkpoints.Preempted` is raised (`_save_or_stop`). `export` writes the policy as a Hugging Face directory.
"""

import dataclasses
import os
import warnings

import jax
from flax import nnx

from vapo_jax import distributed
from vapo_jax.errors import ConfigError
from vapo_jax.models import hf_export
from vapo_jax.train import checkpoints, host_arrays
from vapo_jax.train import metrics as metrics_lib
from vapo_jax.train.state import from_checkpoint, to_checkpoint


class Saving:
  """Checkpoints, resume, the stop on a signal, the export: mixed into `Trainer`."""

  def _resume(self, write_logs: bool):
    """Continues from the newest readable checkpoint, if any, and opens the logs where it left them."""
    config = self.config
    restored = self.checkpoints.restore_latest(self._restore_target,
                                               self._accept) if self.checkpoints else None
    if restored:
      self.log(f"resumed from {self.checkpoints.directory}/{restored[0]}: stage {self.progress.stage}, "
               f"step {self.progress.stage_step}")
      if self.progress.stage == "done":
        self._reopen_finished(restored[2]["config"]["rl_steps"])
    self.saves = max(self.checkpoints.steps(),
                     default=0) if self.checkpoints else 0  # Numbered after every one.
    logs = write_logs and distributed.is_main_process()
    self.writer = metrics_lib.MetricsWriter(
        self.run_dir, enabled=logs, keep_bytes=restored[2]["metrics_bytes"] if restored else 0,
        purge_step=self.progress.global_step, wandb=metrics_lib.wandb_init_args(
            config.log, name=config.name, config=dataclasses.asdict(config)) if logs else None)
    for name, result in (("eval_before_rl", self.progress.eval_before),
                         ("eval_after_rl", self.progress.eval_after)):
      if restored and result:  # TensorBoard purged from the checkpoint's step on, which may include these.
        self.writer.write(0, name, result, global_step=self.progress.global_step, jsonl=False)

  def _reopen_finished(self, trained: int) -> None:
    """A finished run: with more `rl_steps` than it trained, RL goes on from its last step (the held-out
    evaluation after RL and the export are redone); otherwise its summary stands, and one line says so."""
    wanted = self.config.rl_steps
    if wanted <= trained:
      self.log(f"this run finished its {trained} RL steps; its summary stands (to train more, set rl_steps= "
               f"above {trained} with checkpoint.allow_config_change=true)")
      return
    self.log(f"this run finished its {trained} RL steps; training {wanted - trained} more (rl_steps={wanted})")
    self.progress.stage, self.progress.stage_step, self.progress.eval_after = "rl", trained, None

  def _open_checkpoints(self) -> checkpoints.RunCheckpoints:
    directory = os.path.join(self.run_dir, "checkpoints")
    found = checkpoints.RunCheckpoints(directory, self.config.checkpoint)
    latest = found.latest_meta()
    if latest and not self.config.checkpoint.resume:
      raise ConfigError(f"{directory} holds checkpoints of an earlier run (newest: step {latest[0]}) and "
                        "checkpoint.resume=false: choose another name= or run_dir=, or delete the directory")
    if latest:
      checkpoints.check_layer_layout(latest[1], directory)
      checkpoints.check_resumable(self.config, latest[1]["config"], directory)
    return found

  def _restore_target(self, meta: dict):
    checkpoints.check_layer_layout(meta, self.checkpoints.directory)
    checkpoints.check_resumable(self.config, meta["config"], self.checkpoints.directory)
    saved = meta["progress"]
    target = self.state._replace(sft_opt=self.state.sft_opt if saved["stage"] == "sft" else None,
                                 ref=self.state.actor if meta["has_ref"] else None)
    return checkpoints.abstract(to_checkpoint(target), self.mesh) | self.progress.array_target(saved)

  def _accept(self, tree: dict, meta: dict) -> None:
    """Takes a restored checkpoint: its progress first (a damaged record raises before anything changes: the
    next older checkpoint is tried), then its state."""
    self.progress.load(meta["progress"], tree)
    if (carry := self.progress.carry) is not None and carry.capped:
      warnings.warn(f"{carry.capped} carried sequence(s) held rollout.max_response_tokens="
                    f"{self.config.rollout.max_response_tokens} tokens or more (the cap was lowered since "
                    "the save): they end there, finish reason \"length\"", stacklevel=2)
    arrays = {k: v for k, v in tree.items() if k != host_arrays.ITEM}
    self.state = from_checkpoint(arrays, jax.random.key_impl(self.state.key))

  def save(self, *, wait: bool = False):
    """A checkpoint of (state, progress); Orbax numbers checkpoints by a save counter."""
    if self.checkpoints is not None:
      self.saves += 1
      record, arrays = self.progress.checkpoint()
      meta = {"progress": record, "metrics_bytes": self.writer.size(),
              "has_ref": self.state.ref is not None, "config": dataclasses.asdict(self.config),
              "layer_layout": checkpoints.LAYER_LAYOUT}
      self.checkpoints.save(self.saves, to_checkpoint(self.state) | arrays, meta, wait=wait)

  def _after_step(self, *, last: bool):
    """Counts a finished step; saves every N steps; on SIGTERM saves and stops."""
    self.progress.step_done()
    every = self.config.checkpoint.every_steps
    periodic = bool(every and not last and self.progress.stage_step % every == 0)
    self._save_or_stop(f"after {self.progress.stage} step {self.progress.stage_step}", periodic=periodic)

  def _enter(self, stage: str, *, save: bool = True):
    self.progress.enter(stage)
    if save:  # Entering "done" too: a SIGTERM in the final export exits 75.
      self._save_or_stop(f"on entering {stage}", periodic=bool(self.config.checkpoint.every_steps))

  def _save_or_stop(self, where: str, *, periodic: bool):
    """Saves when `periodic`; after SIGTERM or Ctrl-C, that checkpoint finished (else one saved now), then
    `checkpoints.Preempted` saying `where` the run stopped."""
    if periodic:
      self.save()
    if not self.preemption.is_set():
      return
    if not periodic:
      self.save(wait=True)
    elif self.checkpoints is not None:
      self.checkpoints.wait()
    directory = self.checkpoints and self.checkpoints.directory
    raise checkpoints.Preempted(f"stopped by {self.preemption.signal_name} {where}; checkpoint saved in "
                                f"{directory}", exit_code=self.preemption.exit_code)

  def export(self, directory: str) -> None:
    """The current policy as a Hugging Face directory, with the tokenizer's files beside it."""
    hf_export.export(nnx.merge(self.steps.actor_def, self.state.actor), directory,
                      tokenizer_dir=getattr(self.tokenizer, "directory", None))
