"""Where a compile report compiles for: a TPU topology's compile-only devices, this machine's CPUs, or the
devices a run has.

  target = topologies.named("v5p:8x8x4")   # 256 v5p chips; nothing is allocated
  target = topologies.named("cpu:8")       # 8 CPU devices of this process (the tests' devices)
  target = topologies.here(jax.devices())  # a run's own devices, with the memory each reports

A TPU topology comes from libtpu (`jax.experimental.topologies.get_topology_desc`, installed by
`pip install "jax[tpu]==<jax's version>"`); its names are `<generation>:<chips per axis>` as libtpu
spells them: `v5p:2x2x1` (4 chips), `v5p:8x8x4` (256), `v6e:16x16`, `v5e:16x16`. Programs jitted on
a mesh of its devices compile with the real TPU compiler.

The chips' HBM is not exposed by the API; the TPU compiler states it when it refuses a program
("... exceeds available HBM (95.74G)"); tests/test_compile_tpu.py reads it from such a refusal and checks
the table against it. Peak bfloat16 FLOP/s, HBM bandwidth, TensorCores and clock per chip
are JAX's own table's (`pallas.tpu.get_tpu_info_for_chip`): v5p 459 TFLOP/s, 2.46e12 B/s, 2 cores;
v6e 920 TFLOP/s, 1.64e12 B/s; v5e 197 TFLOP/s, 0.82e12 B/s; inter-chip (ICI) bandwidth into a chip is
half the Cloud TPU pages' bidirectional figure: v5p 600 GB/s, v6e 400 GB/s, v5e 200 GB/s. They serve the
roofline estimates only.
"""

import contextlib
import math
import os
import re
from typing import NamedTuple

from vapo_jax.errors import ConfigError

GIB = 2**30


def readable_bytes(n: float) -> str:
  """Bytes in the largest binary unit below them: "3.20 GiB", "512.00 KiB"."""
  unit = next((u for u in ("GiB", "MiB", "KiB") if n >= 2 ** (10 * ("KMG".index(u[0]) + 1))), "B")
  return f"{n / 2 ** (10 * ('KMG'.index(unit[0]) + 1)):.2f} {unit}" if unit != "B" else f"{n:.0f} B"


class Chip(NamedTuple):
  hbm_bytes: int  # What the TPU compiler allows a program per chip (its refusal message's figure).
  peak_flops: float  # bfloat16 FLOP/s per chip.
  hbm_bandwidth: float  # Bytes/s per chip, every TensorCore reading.
  ici_bandwidth: float  # Bytes/s per chip into it over its inter-chip links (half the bidirectional figure).
  cores: int = 1  # TensorCores per chip: a kernel whose grid runs on one of them reads at hbm_bandwidth / cores.
  clock_hz: float = 0.0  # Of a TensorCore: the compiler's estimated cycles at this rate.


def _jax_chip(version: str, hbm_bytes: int, ici_bandwidth: float) -> Chip:
  """A chip from JAX's own table (`jax.experimental.pallas.tpu.get_tpu_info_for_chip`: per TensorCore, times
  the cores), the clock from it: a core's bf16 FLOP/s over its MXUs' multiply-adds per cycle."""
  from jax.experimental.pallas import tpu as pltpu

  chip = getattr(pltpu.ChipVersion, version)
  cores = chip.num_physical_tensor_cores_per_chip
  info = pltpu.get_tpu_info_for_chip(chip, cores)
  per_cycle = 2 * info.num_mxus * info.mxu_column_size ** 2
  return Chip(hbm_bytes, info.bf16_ops_per_second * cores, info.mem_bw_bytes_per_second * cores,
              ici_bandwidth, cores, info.bf16_ops_per_second / per_cycle)


# HBM the compiler allows (its refusals); FLOP/s, HBM bandwidth, cores and clock from JAX's chip table (v5p:
# 459 TFLOP/s, 2.46e12 B/s over 2 cores at 1.75 GHz); ICI from the Cloud TPU system-architecture pages: v5p
# 1,200 GB/s bidirectional per chip (4,800 Gbps), v6e 800 GB/s bidirectional, v5e 1,600 Gbps one way. By
# `device_kind`: libtpu 0.0.42.1 calls a v5p chip "TPU v5", a v5e "TPU v5 lite", a v6e "TPU v6 lite".
CHIPS = {
    "TPU v5": _jax_chip("TPU_V5P", int(95.74 * GIB), 600e9),
    "TPU v6 lite": _jax_chip("TPU_V6E", int(31.25 * GIB), 400e9),
    "TPU v5 lite": _jax_chip("TPU_V5E", int(15.75 * GIB), 200e9),
}
_TOPOLOGY = re.compile(r"^[A-Za-z0-9_ ]+:[0-9]+(x[0-9]+)*$")


# Slice shapes each generation supports, from the Cloud TPU pages (cloud.google.com/tpu/docs/v5p, /v6e, /v5e;
# 2026-12): v5p's 2x2x1, 2x2x2 and 2x4x4, then whole 4x4x4 cubes (every side a multiple of 4) up to 16x16x24
# (6,144 chips); v6e's and v5e's 2-D shapes up to 16x16 (256 chips). libtpu builds other shapes too (a
# 320-chip v5p:8x8x5), whose programs then fail deep in the compiler; names of other generations go to libtpu.
_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
# The shapes each page's table lists (sides sorted): what an error suggests.
COMMON_SLICES = {
    "v5p": ((1, 2, 2), (2, 2, 2), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8), (8, 8, 16),
            (8, 16, 16), (16, 16, 16), (16, 16, 24)),
    "v6e": _2D,
    "v5e": _2D,
}
_CUBES = {(a, b, c) for a in range(4, 17, 4) for b in range(a, 17, 4) for c in range(b, 25, 4)}
SLICES = {"v5p": frozenset(COMMON_SLICES["v5p"]) | _CUBES, "v6e": frozenset(_2D), "v5e": frozenset(_2D)}


def check_slice(name: str) -> None:
  """A `ConfigError` naming the valid shapes nearest in chips when TPU topology `name` is not a slice its
  generation supports (`SLICES`; sides in any order); other generations are left to libtpu."""
  generation, _, shape = name.partition(":")
  if generation not in SLICES:
    return
  sides = tuple(sorted(int(n) for n in shape.split("x")))
  if sides in SLICES[generation]:
    return
  valid, chips = COMMON_SLICES[generation], math.prod
  below = max((chips(d) for d in valid if chips(d) <= chips(sides)), default=None)
  above = min((chips(d) for d in valid if chips(d) >= chips(sides)), default=None)
  near = [f"{'x'.join(map(str, d))} ({chips(d)} chips)" for d in valid if chips(d) in (below, above)]
  raise ConfigError(f"--topology {name}: not a {generation} slice ({shape}: {chips(sides)} chips); "
                    f"the nearest {generation} slices, sides in any order: {', '.join(near)} (Cloud TPU's "
                    f"{generation} page lists them)")


class Topology(NamedTuple):
  """Devices to compile for, with what a chip holds and does (None: unknown, e.g. a CPU)."""

  name: str  # "v5p:8x8x4", or "cpu:8".
  devices: tuple  # jax devices (compile-only for a topology).
  platform: str  # "tpu" or "cpu".
  device_kind: str
  chip: Chip | None
  compile_only: bool = False  # A TPU topology's devices: nothing runs, and XLA's cache cannot load them back.
  reported_bytes: int | None = None  # What each device reports it holds (`memory_stats()["bytes_limit"]`).


def _quiet_libtpu() -> None:
  """Settings for a compile-only libtpu client on a machine without TPUs: no probe of a TPU VM's
  environment (it prints errors otherwise) and no exclusive lock (other processes here may hold it)."""
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def libtpu_missing() -> str | None:
  """Why TPU topologies cannot be compiled for here (None: they can)."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return "libtpu is not installed (make memory TOPOLOGY= installs it: pip install -e \".[tpu]\")"
  return None


def tpu(name: str) -> Topology:
  """The compile-only devices of TPU topology `name`; a bad name is a `ConfigError`."""
  if not _TOPOLOGY.match(name):
    raise ConfigError(f"--topology {name!r} is not a TPU topology name: use <generation>:<chips per axis> as "
                      "libtpu spells them, e.g. v5p:2x2x1, v5p:8x8x4, v6e:16x16, v5e:16x16 (or 'cpu')")
  check_slice(name)
  if reason := libtpu_missing():
    raise ConfigError(f"--topology {name}: {reason}")
  _quiet_libtpu()
  from jax.experimental import topologies
  try:
    devices = tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
  except Exception as error:  # noqa: BLE001  (libtpu raises its own status errors)
    raise ConfigError(f"--topology {name}: libtpu refused it ({str(error).strip().splitlines()[0][:200]}); "
                      "e.g. v5p:2x2x1, v5p:8x8x4, v6e:16x16, v5e:16x16") from None
  kind = devices[0].device_kind
  return Topology(name, devices, "tpu", kind, CHIPS.get(kind), compile_only=True)


def cpu(count: int | None = None) -> Topology:
  """This process's CPU devices (`count` of them, checked: `cpu_flags` makes them before JAX starts)."""
  import jax
  devices = tuple(jax.devices("cpu"))
  if count is not None and len(devices) != count:
    raise ConfigError(f"--topology cpu:{count}: JAX has {len(devices)} CPU devices; set XLA_FLAGS="
                      f"--xla_force_host_platform_device_count={count} before JAX starts "
                      "(python -m vapo_jax.cli.memory does)")
  return Topology(f"cpu:{len(devices)}", devices, "cpu", devices[0].device_kind, None)


def here(devices) -> Topology:
  """A run's own `devices` (of one platform), with the memory the first reports (None: it reports none, as a
  CPU does)."""
  first = devices[0]
  try:
    stats = first.memory_stats()
  except (RuntimeError, NotImplementedError):  # Backends without memory statistics.
    stats = None
  limit = int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
  return Topology(f"{first.platform}:{len(devices)}", tuple(devices), first.platform, first.device_kind,
                  CHIPS.get(first.device_kind) if first.platform == "tpu" else None, reported_bytes=limit)


def cpu_count(name: str) -> int | None:
  """N of a target named `cpu:N` (None: not a CPU target of a given size)."""
  match = re.fullmatch(r"cpu:(\d+)", name)
  return int(match.group(1)) if match else None


def cpu_flags(name: str) -> None:
  """Before JAX starts: the XLA flag that gives this process the CPU devices target `name` needs."""
  if (count := cpu_count(name)) is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count}").strip()


def named(name: str) -> Topology:
  """`cpu` (this process's CPU devices), `cpu:N`, or a TPU topology name."""
  if name == "cpu" or cpu_count(name) is not None:
    return cpu(cpu_count(name))
  return tpu(name)


def refused_bytes(error: BaseException | str) -> float | None:
  """The bytes a TPU compiler's out-of-memory refusal (the error, or its message) says the program needs
  ("... (155.78G) exceeds available HBM"), or None when `error` is no such refusal."""
  match = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM", str(error))
  if not match:
    return None
  return float(match.group(1)) * 1024 ** "KMGT".index(match.group(2)) * 1024


@contextlib.contextmanager
def persistent_cache_for(target: Topology):
  """XLA's persistent compilation cache keeps no program compiled for a TPU topology's compile-only
  devices: JAX cannot load one back without a TPU client (it warns at each read). Programs for devices that
  run are kept."""
  if not target.compile_only:
    yield
    return
  import jax
  previous = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))  # Written by no compile.
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
