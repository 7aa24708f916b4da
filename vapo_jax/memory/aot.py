"""Compiling one jitted program ahead of time on abstract inputs, and what XLA says about it.

  program, outputs = aot.compile_program("decode", fn, (model, prompts, slots, key), resident=(state.critic,))

`fn` is the very jitted object a run calls (a `Steps` program, a rollout engine's program); its
inputs are `jax.ShapeDtypeStruct`s carrying `NamedSharding`s, so nothing is allocated and the mesh's
devices may be a TPU topology's compile-only ones. `Program` keeps XLA's per-device figures
(`memory_analysis()`: arguments, outputs, outputs aliased to donated arguments, temporaries; XLA
counts only the arguments it reads, so what a device holds is reckoned from the inputs passed),
`cost_analysis()` (FLOPs and bytes accessed per device; a loop body counts once, and Pallas kernels
count nearly nothing), the HBM bytes and compiler cycles walked from its HLO (`hlo_walk`: loops by their
trips, in-place writes as their updates), the collectives of its decode loop (`decode_traffic`), the attention
implementations traced into it, the lower and compile seconds, and the bytes of the arrays a run holds
beside it (`resident`: live, but not its arguments). A program the TPU compiler refuses for memory
keeps the compiler's figure instead (`refused_bytes`). The abstract outputs feed the next program.
Inside `tpu_said.keeping` (a compile report for a TPU topology), what the compiler said is kept
on disk and loaded by a later compile of the same program.
"""

import contextlib
import hashlib
import math
import time
from typing import Any, NamedTuple

import jax

from vapo_jax.memory import hlo, hlo_walk, topologies, tpu_said
from vapo_jax.models import attention
from vapo_jax.rollout.common import DECODE_LOOP

_walking = [None]  # Inside `walking(chip)`: programs are walked (`Program.walked`) for that chip.


@contextlib.contextmanager
def walking(chip):
  """Inside, with a chip (`topologies.Chip`; None: nothing walked): `compile_program` walks each program's HLO
  (`hlo_walk`, each instruction bound at the chip's ridge point), which only the roofline reads (a compile
  report for a chip it knows); elsewhere (the start-up check) it is not spent."""
  before, _walking[0] = _walking[0], chip
  try:
    yield
  finally:
    _walking[0] = before


class Memory(NamedTuple):
  """XLA's bytes per device of one compiled program."""

  arguments: int
  outputs: int
  aliased: int  # Outputs written into donated arguments' buffers.
  temporaries: int

  @property
  def total(self) -> int:
    """Live at once on a device: arguments, outputs not aliased to them, temporaries."""
    return self.arguments + self.outputs - self.aliased + self.temporaries


class DecodeTraffic(NamedTuple):
  """What one iteration of a program's decode loop communicates, per device."""

  loop: str  # The while instruction.
  bytes: int  # The collectives every iteration runs (nested loops: times their known trip counts).
  count: int  # How many of them.
  branch_bytes: int  # More on iterations that take a conditional branch (the refill engine's insert).
  largest: int  # The largest single collective, branches included.


def decode_traffic(found: list[hlo.Collective], op_names: dict[str, str]) -> DecodeTraffic | None:
  """The traffic of the while loop traced under `DECODE_LOOP` (None: the program has no such loop)."""
  loops = [name for name, op in op_names.items() if op.endswith(f"{DECODE_LOOP}/while")]
  if not loops:
    return None
  inside = [c for c in found if loops[0] in (name for name, _ in c.loops)]
  every = hlo.bytes_per_iteration(found, loops[0], branches=False)
  return DecodeTraffic(loops[0], every, sum(not c.conditional for c in inside),
                       hlo.bytes_per_iteration(found, loops[0]) - every,
                       max((c.moved for c in inside), default=0))


class Program(NamedTuple):
  """One compiled program of a run (see the module docstring)."""

  name: str
  memory: Memory | None  # None: the compiler refused it (`refused_bytes`).
  refused_bytes: float | None
  inputs: int  # Bytes per device of the arrays passed to it (XLA leaves out those it does not read).
  resident: int  # Bytes per device of the run's arrays live beside it, not passed to it.
  flops: float  # cost_analysis, per device (loop bodies once).
  bytes_accessed: float
  lower_s: float
  compile_s: float
  attention: tuple[str, ...]  # Implementations traced into it (models/attention.py `recording`).
  decode: DecodeTraffic | None  # Per-iteration collectives of its decode loop, if it has one.
  collectives: tuple[hlo.Collective, ...]
  fingerprint: str  # sha256 of the lowered module: equal fingerprints, the same program.
  kept: bool = False  # Loaded from what the compiler said before (`tpu_said`), not compiled now.
  walked: hlo_walk.Walked | None = None  # Its HBM bytes, FLOPs, cycles walked from its HLO (inside `walking`).

  @property
  def needs(self) -> float:
    """Bytes per device while it runs: every array the run holds (its inputs, read or not, and the
    resident ones), its outputs not written over a donated input, and its temporaries; for a refused
    program, the compiler's figure and the resident arrays."""
    if self.memory is None:
      return self.refused_bytes + self.resident
    m = self.memory
    return self.inputs + self.resident + m.outputs - m.aliased + m.temporaries


def chip_bytes(tree) -> int:
  """Bytes per device of a tree of arrays or abstract arrays with shardings (the largest shard)."""
  total = 0
  for x in (x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x,
                                                                                "dtype")):  # Not static arguments.
    shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shard) * x.dtype.itemsize
  return total


def _outputs(lowered, shardings, fallback):
  """The program's outputs as abstract arrays laid out as compiled (`shardings`, in the order of the
  leaves; refused, None: `fallback(shape)`)."""
  shardings = (jax.tree.unflatten(jax.tree.structure(lowered.out_info), shardings) if shardings is not None
               else jax.tree.map(lambda info: fallback(info.shape), lowered.out_info))
  return jax.tree.map(lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
                      lowered.out_info, shardings)


def lowered_fingerprint(lowered, text: str | None = None) -> str:
  """A short hash of a lowered module's text (`text`, if given): equal for the same program on the same
  input layouts."""
  return hashlib.sha256((lowered.as_text() if text is None else text).encode()).hexdigest()[:16]


def _compile(lowered, text: str) -> tuple[tpu_said.Said, bool]:
  """What the compiler says of `lowered`, and whether it was loaded (inside `tpu_said.keeping`:
  kept, or loaded). A refusal for memory is recorded; any other compile error propagates."""
  if (said := tpu_said.load(text)) is not None:
    return said, True
  try:
    said = tpu_said.said_by(lowered.compile())
  except Exception as error:  # noqa: BLE001  (XLA's runtime error type is private)
    if topologies.refused_bytes(error) is None:
      raise
    said = tpu_said.refused(error)
  tpu_said.store(text, said)
  return said, False


def compile_program(name: str, fn, args: tuple, *, resident: int = 0, fallback=None) -> tuple[Program, Any]:
  """Lowers and compiles `fn(*args)` (a jitted function of abstract arrays): (`Program`, its outputs
  as abstract arrays). `resident`: bytes per device held beside it. A refusal for memory is
  recorded; any other compile error propagates. `fallback(shape)`: the sharding assumed for a
  refused program's outputs."""
  start = time.perf_counter()
  with attention.recording() as used:
    lowered = fn.lower(*args)
  text = lowered.as_text()
  lowered_at = time.perf_counter()
  said, kept = _compile(lowered, text)
  done = time.perf_counter()
  memory, found, traffic, walked = None, (), None, None
  if said.refusal is None:
    memory = Memory(*said.memory)
    chip = _walking[0]
    walked = None if chip is None else hlo_walk.walk(said.text, chip=chip)
    found = tuple(hlo.collectives(said.text))
    traffic = decode_traffic(list(found), hlo.while_op_names(said.text))
  refused = topologies.refused_bytes(said.refusal) if said.refusal is not None else None
  program = Program(name, memory, refused, chip_bytes(args), resident, said.cost.get("flops", 0.0),
                    said.cost.get("bytes accessed", 0.0), lowered_at - start, done - lowered_at,
                    tuple(sorted(used)), traffic, found, lowered_fingerprint(lowered, text), kept, walked)
  return program, _outputs(lowered, said.shardings, fallback)


def weight_elements(params, layers: int) -> frozenset:
  """The element counts of the weight matrices of `params` (abstract arrays with shardings), whole and per
  device, and of one layer's slice of a stacked decoder-layer matrix (`[L, ...]`, three axes or more):
  what a scanned program gathers one layer at a time (tests/test_compile_tpu.py finds a weight moving while
  decoding by these counts)."""
  matrices = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  sizes = {x.size for x in matrices} | {math.prod(x.sharding.shard_shape(x.shape)) for x in matrices}
  stacked = [x for x in matrices if x.ndim >= 3 and x.shape[0] == layers]
  return frozenset(sizes | {x.size // layers for x in stacked}
                   | {math.prod(x.sharding.shard_shape(x.shape)[1:]) for x in stacked})
