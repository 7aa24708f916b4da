"""Checks of compiled TPU programs that only the tests make: a weight moving in a decode loop, the chip's HBM as the
TPU compiler states it."""

import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def weight_collectives(program, weight_sizes) -> list:
  """The collectives of the program's decode loop one of whose operands has as many elements as a weight matrix in
  `weight_sizes` (whole, one device's shard, or one layer of a stacked matrix: `aot.weight_elements`, the report's
  `weights`): a weight moving while decoding."""
  elements = lambda shape: math.prod(int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d)
  loop = program.decode.loop if program.decode else None
  return [c for c in program.collectives if loop in (name for name, _ in c.loops)
          and any(elements(shape) in weight_sizes for shape in c.shapes)]


def probe_hbm_bytes(target) -> float | None:
  """The per-chip HBM the TPU compiler allows, read from its refusal of a 1 TiB program (a few seconds)."""
  mesh = jax.sharding.Mesh(list(target.devices[:1]), ("x",))
  big = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  try:
    jax.jit(lambda a: a * 2 + 1).lower(big).compile()
  except Exception as error:  # noqa: BLE001  (the refusal is what is read)
    match = re.search(r"available HBM \(([\d.]+)G\)", str(error))
    return float(match.group(1)) * 2**30 if match else None
  return None
