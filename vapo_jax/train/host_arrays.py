"""Host NumPy arrays in a checkpoint as one `.npy` file each, written from the arrays themselves.

  checkpoints.RunCheckpoints.save(step, state | {"host": {"carry": {"tokens": ...}}}, meta)

Partial rollouts' carry is host data of up to `N × max_response_tokens` tokens, two log-probs and versions: 5
GiB at `aime`'s size. Orbax's pytree handler copies such arrays before a save (so that a background save reads
a snapshot) and compresses them through buffers of its own, about 1.7× their bytes more at the peak. This
handler writes each array straight from its own memory (`numpy.lib.format.write_array`: a C-contiguous array
is written by `tofile`, with no copy), blocking the save until written, and reads each one into the array it
is given to fill (`readinto`: no second copy). Its files go into the checkpoint's temporary directory like any
item's, so a checkpoint is renamed complete only with them.

Files are named by the path of each array in the nested dict (`carry.tokens.npy`). One process writes (the
arrays are the same on every process); every process reads.
"""

import dataclasses
import os
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from vapo_jax import distributed

ITEM = "host"  # The checkpoint's item (and the state tree's key) holding host arrays.


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  out = {}
  for name, value in tree.items():
    if "." in name or os.sep in name:
      raise ValueError(f"host array name {name!r} holds '.' or '{os.sep}'")
    if isinstance(value, dict):
      out |= _flat(value, f"{prefix}{name}.")
    else:
      out[f"{prefix}{name}"] = value
  return out


def _nested(flat: dict[str, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def write(directory: str, tree: dict) -> None:
  """Each array of `tree` (nested dicts of NumPy arrays) as `<path>.npy` in `directory`."""
  for path, array in _flat(tree).items():
    with open(os.path.join(directory, f"{path}.npy"), "wb") as f:
      np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)


def read_into(directory: str, target: dict) -> dict:
  """`target` (nested dicts of writable NumPy arrays) filled from `write`'s files; a file of another shape or
  dtype than its target, or one cut short, is a `ValueError` naming it."""
  flat = _flat(target)
  for path, array in flat.items():
    name = os.path.join(directory, f"{path}.npy")
    with open(name, "rb") as f:
      version = np.lib.format.read_magic(f)
      header = np.lib.format.read_array_header_1_0 if version == (1,
                                                                  0) else np.lib.format.read_array_header_2_0
      shape, fortran, dtype = header(f)
      if tuple(shape) != array.shape or np.dtype(dtype) != array.dtype or fortran:
        raise ValueError(f"{name} holds {dtype}{list(shape)}, expected {array.dtype}{list(array.shape)}")
      if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"the target of {name} is not a writable C-contiguous array")
      if array.nbytes and f.readinto(memoryview(array).cast("B")) != array.nbytes:
        raise ValueError(f"{name} is cut short: fewer than its {array.nbytes} bytes")
  return _nested(flat)


class HostArraysHandler(ocp.CheckpointHandler):
  """Orbax's handler of the `host` item: `write` on save (the main process), `read_into` on restore."""

  def save(self, directory: epath.Path, args: "HostArraysSave") -> None:
    if distributed.is_main_process():
      write(os.fspath(directory), args.tree)

  def restore(self, directory: epath.Path, args: "HostArraysRestore") -> dict:
    return read_into(os.fspath(directory), args.target)

  def metadata(self, directory: epath.Path) -> None:
    return None


@ocp.args.register_with_handler(HostArraysHandler, for_save=True)
@dataclasses.dataclass
class HostArraysSave(ocp.args.CheckpointArgs):
  tree: dict  # Nested dicts of NumPy arrays.


@ocp.args.register_with_handler(HostArraysHandler, for_restore=True)
@dataclasses.dataclass
class HostArraysRestore(ocp.args.CheckpointArgs):
  target: dict  # Nested dicts of writable NumPy arrays of the saved shapes and dtypes (filled in place).
