"""What the TPU compiler said about a program, kept beside XLA's compilation cache.

XLA's persistent cache keeps no program compiled for a TPU topology's compile-only devices (JAX cannot
load one back without a TPU: `topologies.persistent_cache_for`), so each compile report compiled every
TPU program again: minutes a program at 64 layers. A report reads only a few things from a compiled
program: its memory analysis, its cost analysis, its optimised HLO text and its output shardings, or
the compiler's refusal. `Said` holds exactly those; `keeping(target)` stores each one in
`$JAX_COMPILATION_CACHE_DIR/vapo-tpu-<key>.json` (a keyed file of `compile_cache`, bounded with XLA's files),
and a later compile of the same program loads it instead. Everything a report derives from them (the
collectives, the decode loop's traffic, the refused bytes) is derived again at each load.

The key is the sha256 of the lowered module's text with the topology, the device kind, the versions of
jax, jaxlib and libtpu, and `XLA_FLAGS` and `LIBTPU_INIT_ARGS`: a change to the program, the compiler or
its flags misses. Each file holds its key, compared at every load: a file whose contents are another
program's (copied over it) is a miss, and the compile that follows rewrites it. Without
`JAX_COMPILATION_CACHE_DIR`, or for devices that run (XLA's cache keeps those), nothing is kept.
"""

import base64
import contextlib
import hashlib
import json
import os
import zlib
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from vapo_jax import compile_cache

PREFIX = "vapo-tpu-"
FORMAT = 3  # Of the files: part of the key, so a file of another format is never read (3: op_names in the HLO
# carry the named scopes the walk finds loops by, which the lowered text that keys a file does not show).
_active: list = []  # [(directory, {device id: device}, key salt)] inside `keeping`.


class Said(NamedTuple):
  """What the compiler said: figures of the compiled program, or its refusal (`refusal`, else None)."""
  memory: tuple[int, int, int, int] | None  # Arguments, outputs, aliased, temporaries.
  cost: dict[str, float]  # flops, bytes accessed.
  text: str  # The optimised HLO ("" when refused).
  shardings: tuple | None  # The outputs' NamedShardings, in the order of their leaves (None when refused).
  refusal: str | None


def said_by(compiled) -> Said:
  """`Said` of a compiled program (`jax.stages.Compiled`)."""
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return Said((m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes),
              {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}, compiled.as_text(),
              tuple(jax.tree.leaves(compiled.output_shardings)), None)


def refused(error: BaseException) -> Said:
  return Said(None, {}, "", None, str(error))


@contextlib.contextmanager
def keeping(target):
  """Inside: `load` and `store` keep what the compiler says about `target`'s programs (a TPU topology's,
  with a cache directory set)."""
  directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not target.compile_only or not directory:
    yield
    return
  salt = json.dumps([FORMAT, target.name, target.device_kind, *compile_cache.compiler_salt()])
  _active.append((directory, {d.id: d for d in target.devices}, salt))
  try:
    yield
  finally:
    _active.pop()


def _key(text: str) -> str | None:
  """The key of this lowered program inside `keeping` (None outside)."""
  if not _active:
    return None
  return hashlib.sha256((_active[-1][2] + "\n" + text).encode()).hexdigest()


def _sharding(s: NamedSharding) -> dict:
  mesh = s.mesh
  return {"devices": [d.id for d in mesh.devices.flat], "shape": list(mesh.devices.shape),
          "axes": list(mesh.axis_names), "types": [t.name for t in mesh.axis_types],
          "spec": [list(p) if isinstance(p, tuple) else p for p in s.spec], "memory_kind": s.memory_kind}


def _named(data: dict, devices: dict) -> NamedSharding:
  grid = np.array([devices[i] for i in data["devices"]], dtype=object).reshape(data["shape"])
  mesh = Mesh(grid, tuple(data["axes"]), axis_types=tuple(AxisType[t] for t in data["types"]))
  spec = PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in data["spec"]))
  return NamedSharding(mesh, spec, memory_kind=data["memory_kind"])


def load(lowered_text: str) -> Said | None:
  """What the compiler said of this lowered program before, or None (not kept, unreadable, another key's)."""
  if (key := _key(lowered_text)) is None or (data := compile_cache.load_keyed(PREFIX, key)) is None:
    return None
  try:
    shardings = None if data["refusal"] else tuple(_named(s, _active[-1][1]) for s in data["shardings"])
    text = zlib.decompress(base64.b64decode(data["text"])).decode()
    return Said(tuple(data["memory"]) if data["memory"] else None, data["cost"], text, shardings,
                data["refusal"])
  except (ValueError, KeyError, TypeError, zlib.error):  # Written by another version: compile again.
    return None


def store(lowered_text: str, said: Said) -> None:
  """Keeps `said` for this lowered program (inside `keeping`; written whole or not at all: a full or read-only
  cache directory costs a compile next time, nothing else)."""
  if (key := _key(lowered_text)) is None:
    return
  shardings = [_sharding(s) if isinstance(s, NamedSharding) else None for s in said.shardings or ()]
  if any(s is None or _named(s, _active[-1][1]) != original for s,
         original in zip(shardings, said.shardings or ())):
    return  # A sharding this file would not rebuild equal: such a program compiles each time.
  compile_cache.store_keyed(PREFIX, key, {"memory": said.memory, "cost": said.cost, "refusal": said.refusal,
                                          "text": base64.b64encode(zlib.compress(said.text.encode(),
                                                                                 6)).decode(),
                                          "shardings": shardings})
