"""The prompt sampler: endless, resumable batches of training problems.

  prompts = PromptIterator(records, prompts_per_step=P, seed=0)
  batch = next(prompts)                  # P records
  state = prompts.state_dict()           # saved with the checkpoint; `load_state_dict` resumes

Each epoch draws the records in a permutation fixed by (seed, epoch); a batch that crosses an
epoch's end continues in the next epoch's order, so a resumed run draws exactly what an
uninterrupted one would.
"""

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vapo_jax.data.records import Record
from vapo_jax.errors import DataError


def permutation(num_records: int, *, seed: int, epoch: int) -> np.ndarray:
  """The order of epoch `epoch`: a permutation of `range(num_records)` fixed by (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_records)


class SamplerState(NamedTuple):
  epoch: int  # Passes over the data completed.
  position: int  # Records of the current epoch's permutation already drawn.


def next_prompts(records: Sequence[Record], state: SamplerState, *, count: int,
                 seed: int) -> tuple[list[Record], SamplerState]:
  """The next `count` records and the state after them; epochs are reshuffled by (seed, epoch)."""
  batch, (epoch, position) = [], state
  order = permutation(len(records), seed=seed, epoch=epoch)
  while len(batch) < count:
    if position == len(records):
      epoch, position = epoch + 1, 0
      order = permutation(len(records), seed=seed, epoch=epoch)
    take = min(count - len(batch), len(records) - position)
    batch.extend(records[i] for i in order[position:position + take])
    position += take
  return batch, SamplerState(epoch, position)


def fingerprint(records: Sequence[Record]) -> str:
  """A short hash of the records' ids and answers, to check that a resume sees the same data."""
  digest = hashlib.sha1()
  for record in records:
    digest.update(f"{record.id}\x00{record.answer}\x01".encode())
  return digest.hexdigest()[:16]


class PromptIterator:
  """Endless batches of `prompts_per_step` prompts; each epoch is a fresh permutation of the records."""

  def __init__(self, records: Sequence[Record], *, prompts_per_step: int, seed: int):
    if not records:
      raise DataError("PromptIterator needs at least one record")
    self.records, self.seed, self.prompts_per_step = list(records), seed, prompts_per_step
    self.state = SamplerState(0, 0)
    self._fingerprint = fingerprint(self.records)

  def __iter__(self) -> "PromptIterator":
    return self

  def __next__(self) -> list[Record]:
    batch, self.state = next_prompts(self.records, self.state, count=self.prompts_per_step, seed=self.seed)
    return batch

  def take(self, count: int) -> list[Record]:
    """The next `count` records (the batches after them continue where these end)."""
    batch, self.state = next_prompts(self.records, self.state, count=count, seed=self.seed)
    return batch

  def state_dict(self) -> dict[str, Any]:
    """The position, JSON-serialisable, with what identifies the data and the order."""
    return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed,
            "num_records": len(self.records), "fingerprint": self._fingerprint}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Resumes at a saved position; the data and the seed must be the ones it was saved with."""
    expected = {"seed": self.seed, "num_records": len(self.records), "fingerprint": self._fingerprint}
    for key, value in expected.items():
      if state.get(key) != value:
        raise DataError(f"cannot resume the prompt iterator: saved {key}={state.get(key)!r}, "
                        f"but the data now has {key}={value!r}")
    if not 0 <= state["position"] <= len(self.records):
      raise DataError(f"cannot resume the prompt iterator: position {state['position']} out of range")
    self.state = SamplerState(int(state["epoch"]), int(state["position"]))
