"""The start-up memory check: XLA's figures for the run's own programs on the run's own devices, before
the first step.

  verdict.check(config, jax.devices())   # prints the compile report; ConfigError naming each phase over it

Every program the run executes is compiled ahead of time on the devices it will run on
(`xla_report.compile_run` on `topologies.here(devices)`), and a phase that needs more than (1 −
`mesh.memory_margin`) of the device memory refuses the run, naming the phase, its largest program and
the settings, each compiled, that bring it under (`what_if`). The device memory is the least of what the
device reports and `mesh.device_memory_gib`; a CPU reports none, so without `mesh.device_memory_gib`
nothing is compiled and one line says so. `mesh.check_memory=false` skips the check.

A verdict that fits is kept in `$JAX_COMPILATION_CACHE_DIR/vapo-memory-<key>.json`: the key is the sha256
of the config (less its name and run_dir), the models' architectures as read from their checkpoints (the
same path holding another model compiles again), the devices (platform, kind, count, memory), the versions of
jax and jaxlib, `XLA_FLAGS`, `LIBTPU_INIT_ARGS` and every source file of the package, so that a second
start of the same run reads it back in well under a second, and any change to what is compiled misses.
A refusal is never kept: the run is refused again, with its fixes, at the next start.
"""

import dataclasses
import functools
import hashlib
import json
import pathlib

from vapo_jax import compile_cache
from vapo_jax.errors import ConfigError
from vapo_jax.memory import topologies, xla_report, xla_report_text

PREFIX = "vapo-memory-"


@functools.cache
def _sources() -> str:
  """sha256 of every source file of the package (the programs are the code's)."""
  digest = hashlib.sha256()
  root = pathlib.Path(__file__).resolve().parents[1]
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
  return digest.hexdigest()


def key(config, target: topologies.Topology) -> str:
  """The key of `config`'s verdict on `target` (see the module docstring)."""
  from vapo_jax.train import build
  fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("name", "run_dir")}
  models = [dataclasses.asdict(cfg) for cfg in build.model_configs(config)]  # What the checkpoints hold now.
  text = json.dumps([fields, models, target.platform, target.device_kind, len(target.devices),
                     target.reported_bytes,
                     compile_cache.compiler_salt(), _sources()], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()


def _load(digest: str) -> str | None:
  """The kept report's text of this key, or None (not kept, unreadable, another key's: `compile_cache.load_keyed`)."""
  data = compile_cache.load_keyed(PREFIX, digest)
  table = data.get("table") if data else None
  return table if isinstance(table, str) else None  # A file of another shape: compiled again, then replaced.


def _store(digest: str, table: str) -> None:
  compile_cache.store_keyed(PREFIX, digest, {"table": table})  # Unwritable: a compile at the next start.


def check(config, devices: list, *, show: bool = True, log=None) -> str:
  """XLA's verdict on `config`'s programs on `devices` (see the module docstring): prints it (with `show`)
  and returns it; raises `ConfigError` when a phase does not fit."""
  say = (lambda message: print(message, flush=True)) if show else (lambda message: None)
  if not config.mesh.check_memory:
    say("memory: not checked (mesh.check_memory=false)")
    return ""
  target = topologies.here(devices)
  if xla_report.device_bytes(config, target) is None:
    many = len(devices) > 1
    line = (f"memory: not checked ({len(devices)} {target.platform} device{'s' * many} "
            f"report{'s' * (not many)} no memory size; mesh.device_memory_gib=<GiB> gives one; make memory "
            "prints XLA's figures)")
    say(line)
    return line
  digest = key(config, target)
  if (kept := _load(digest)) is not None:
    say(kept + f"\n  (XLA's figures kept from an earlier start: {compile_cache.keyed_path(PREFIX, digest)})")
    return kept
  say(f"memory: compiling the run's programs on {target.name} for XLA's figures (kept for the next start)")
  report = xla_report.compile_run(config, target, log=log or say)
  table = xla_report_text.table(report)
  say(table)
  if message := xla_report_text.refusal(report):
    raise ConfigError(message + "\n(mesh.check_memory=false skips this check)")
  _store(digest, table)
  return table
