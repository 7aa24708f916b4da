"""The state of a run: one immutable pytree of arrays (`TrainState`) and a small host record beside
it (`Progress`). A checkpoint is the two of them; nothing else is saved or restored.

  TrainState  actor and critic parameters, their AdamW states, the supervised stage's optimizer
              state while it runs, the reference policy when a KL term is used, the PRNG key.
              Passed into and returned by the jitted steps (`steps.Steps`).
  Progress    the stage and steps done in it, value-pretraining progress, evaluation results,
              the prompt iterator's position, the supervised stage's host RNG and the collapse
              monitor, and partial rollouts' carry: a JSON record in checkpoints, the carry's tokens and
              log-probs as host arrays beside the state's (`host_arrays`).
"""

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from vapo_jax.data.prompt_iterator import PromptIterator
from vapo_jax.train.host_arrays import ITEM
from vapo_jax.train.metrics import CollapseMonitor

STAGES = ("sft", "value_pretrain", "rl", "done")


class TrainState(NamedTuple):
  """Every array of a run. Optimizer update counts are optax's own (in the optimizer states)."""

  actor: Any  # nnx.State of the policy.
  critic: Any  # nnx.State of the value model.
  actor_opt: Any  # optax state of the policy's optimizer.
  critic_opt: Any  # optax state of the critic's optimizer.
  key: jax.Array  # PRNG key (typed), replicated over the mesh.
  sft_opt: Any = None  # optax state of the supervised warm start while it runs, else None.
  ref: Any = None  # nnx.State of the reference policy when algo.kl_coef > 0, else None.

  def split_key(self) -> tuple["TrainState", jax.Array]:
    """(the state with a fresh key, a key for one use)."""
    key, sub = jax.random.split(self.key)
    return self._replace(key=key), sub


def to_checkpoint(state: TrainState) -> dict:
  """The arrays to save: absent parts left out, the key as its raw uint32 data."""
  tree = {k: v for k, v in state._asdict().items() if v is not None}
  tree["key"] = jax.random.key_data(state.key)
  return tree


def from_checkpoint(tree: dict, impl) -> TrainState:
  """The inverse of `to_checkpoint` (`impl`: the key's implementation, `jax.random.key_impl`)."""
  return TrainState(**(tree | {"key": jax.random.wrap_key_data(tree["key"], impl=impl)}))


@dataclasses.dataclass
class Progress:
  """Host-side progress of a run: what a resume needs besides the arrays."""

  stage: str
  prompts: PromptIterator
  sft_rng: np.random.Generator
  monitor: CollapseMonitor
  stage_step: int = 0  # Steps finished in the current stage.
  global_step: int = 0  # Steps finished in all stages.
  vp_best: float | None = None  # Value pretraining: best explained variance so far (early stopping).
  vp_since_best: int = 0  # Value pretraining: steps since it last improved.
  eval_before: dict | None = None  # Held-out evaluation before RL.
  eval_after: dict | None = None  # Held-out evaluation after RL.
  nonfinite_steps: int = 0  # Steps in a row with an update skipped for a non-finite loss or gradient.
  carry: Any = None  # Partial rollouts' groups in flight (`rollout.partial.Carry`), or None.

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"unknown stage {self.stage!r}; stages: {', '.join(STAGES)}")

  def checkpoint(self) -> tuple[dict, dict]:
    """(the JSON record, the arrays saved beside the state's: partial rollouts' carry, if any)."""
    counters, arrays = (None, None) if self.carry is None else self.carry.state_dict()
    if counters is not None and not counters["groups"]:
      arrays = None  # Nothing in flight (Orbax saves no empty array): the counters say so.
    record = {"stage": self.stage, "stage_step": self.stage_step, "global_step": self.global_step,
              "nonfinite_steps": self.nonfinite_steps,
              "vp_best": self.vp_best, "vp_since_best": self.vp_since_best, "eval_before": self.eval_before,
              "eval_after": self.eval_after, "prompts": self.prompts.state_dict(),
              "sft_rng": self.sft_rng.bit_generator.state, "monitor": self.monitor.state_dict(),
              "carry": counters}
    return record, ({} if arrays is None else {ITEM: {"carry": arrays}})

  def array_target(self, saved: dict) -> dict:
    """What `checkpoint`'s arrays were, from a saved record: NumPy arrays of their shapes (the restore's target)."""
    if self.carry is None or not (saved.get("carry") or {}).get("groups"):
      return {}
    shapes = self.carry.array_shapes(saved["carry"], self.carry.samples_per_prompt)
    return {ITEM: {"carry": {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}}}

  def load(self, saved: dict, arrays: dict) -> None:
    """The progress of a checkpoint's record and arrays. A damaged record (a field missing or of the wrong
    shape) is a `ValueError` (or `KeyError`, `TypeError`) before anything changes; data that no longer match
    the record is the prompt iterator's `DataError`."""
    scalars = {name: saved[name] for name in ("stage", "stage_step", "global_step", "nonfinite_steps",
                                              "vp_best",
                                              "vp_since_best", "eval_before", "eval_after")}
    if scalars["stage"] not in STAGES or not all(isinstance(scalars[n], int) for n in (
        "stage_step", "global_step", "nonfinite_steps", "vp_since_best")):
      raise ValueError(f"the progress record's stage or step counters are damaged: {scalars}")
    rng, monitor, prompts = dict(saved["sft_rng"]), dict(saved["monitor"]), dict(saved["prompts"])
    if self.carry is None and (saved.get("carry") or {}).get("groups"):  # Saved under a budget, resumed without.
      warnings.warn(f"the checkpoint holds {saved['carry']['groups']} group(s) of partial rollouts in "
                    "flight; without rollout.decode_budget they are dropped and the run samples anew",
                    stacklevel=2)
    if self.carry is not None and saved.get("carry") is not None:
      counters = saved["carry"]
      self.carry.load_state_dict(counters, arrays[ITEM]["carry"] if counters["groups"] else {})
    self.prompts.load_state_dict(prompts)
    self.sft_rng.bit_generator.state = rng
    self.monitor.load_state_dict(monitor)
    for name, value in scalars.items():
      setattr(self, name, value)

  def enter(self, stage: str) -> None:
    self.stage, self.stage_step = stage, 0

  def step_done(self) -> None:
    self.stage_step += 1
    self.global_step += 1
