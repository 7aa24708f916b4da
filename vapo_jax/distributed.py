"""Several processes, one program: start-up, who writes, and host ↔ global array transfers.

JAX runs multi-host as one process per host (or several per host), each driving its local
devices, all running the same program on global arrays. `initialize()` joins the processes
before anything else touches JAX:

  VAPO_COORDINATOR=host:port VAPO_NUM_PROCESSES=2 VAPO_PROCESS_ID=0 [VAPO_LOCAL_DEVICES=4] python ...
  VAPO_DISTRIBUTED=1 python ...   # TPU pods, SLURM, Open MPI: JAX finds the values itself.

Multi-host TPU slices on GKE (`TPU_WORKER_HOSTNAMES` naming several hosts) are detected from the
environment alone; a TPU VM pod slice outside GKE needs `VAPO_DISTRIBUTED=1`, since detecting it
means asking the metadata server. Without any of these, a run is single-process and
`initialize()` does nothing.

Every process must make the same calls in the same order with the same host values: collectives
(`to_host` of a sharded array, `gather_rows`, `any_process`, Orbax saves) are rendezvous points,
and a process that skips one leaves the others waiting until a time-out.
"""

import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge  # backends_are_initialized: no public form.
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

COORDINATOR = "VAPO_COORDINATOR"  # host:port of process 0's coordination service.
NUM_PROCESSES = "VAPO_NUM_PROCESSES"  # How many processes take part.
PROCESS_ID = "VAPO_PROCESS_ID"  # This process's index, 0 .. VAPO_NUM_PROCESSES - 1.
LOCAL_DEVICES = "VAPO_LOCAL_DEVICES"  # CPU only: how many CPU devices this process provides.
HOST_DEVICE_COUNT = "--xla_force_host_platform_device_count"  # XLA_FLAGS' CPU device count.
DISTRIBUTED = "VAPO_DISTRIBUTED"  # 1: let `jax.distributed.initialize()` detect the cluster.
_EXPLICIT = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
_OWNER = "VAPO_DISTRIBUTED_PID"  # Set by `initialize`: the process of the run that its children descend from.


def initialize(*, environ: Mapping[str, str] | None = None, cpu_devices: int | None = None,
               initialization_timeout_s: int = 300,
               heartbeat_timeout_s: int = 100, shutdown_timeout_s: int = 300,
               exit_on_error: bool = True) -> bool:
  """Joins this process to the others when launched as several; returns whether it did.

  Call it first, before any JAX computation or `jax.devices()` (JAX refuses afterwards).
  Calling it again is a no-op, and so is calling it in a process that a member of the run
  started: spawn and forkserver children of `multiprocessing` (the verifier pool) import the
  main module again with the parent's environment, and joining a second time aborts the run.

  `cpu_devices` (`mesh.cpu_devices`) is the CPU devices to make where nothing else says how many:
  `VAPO_LOCAL_DEVICES` and XLA_FLAGS' `--xla_force_host_platform_device_count` come first, and a
  process whose JAX has already started keeps its devices. It changes nothing on an accelerator.

  `initialization_timeout_s` bounds the wait for every process to connect;
  `heartbeat_timeout_s` how soon a dead peer is noticed; `shutdown_timeout_s` how long a
  finished process waits at exit for the others. With `exit_on_error`, an uncaught exception
  ends the process right after its traceback (status 1): JAX's exit handler would otherwise wait
  at a barrier for the other processes (which are stuck waiting for this one) until a time-out.
  """
  env = os.environ if environ is None else environ
  if jax.distributed.is_initialized():
    return True
  if os.environ.get(_OWNER, str(os.getpid())) != str(os.getpid()):
    return False  # A helper (e.g. a verifier) that a member of the run started, re-running its main module.
  if env.get(LOCAL_DEVICES):
    cpu_devices = _positive_int(env, LOCAL_DEVICES)
  elif (HOST_DEVICE_COUNT in env.get("XLA_FLAGS", "") or cpu_devices is None
        or xla_bridge.backends_are_initialized()):
    cpu_devices = None
  flag = env.get(DISTRIBUTED, "")
  if flag not in ("", "0", "1"):
    raise ValueError(f"{DISTRIBUTED}={flag!r} must be 1 (initialise from the cluster environment) or 0")
  explicit = _explicit_settings(env)
  if cpu_devices is not None:
    try:
      jax.config.update("jax_num_cpu_devices", cpu_devices)  # Overrides XLA_FLAGS' host device count.
    except RuntimeError as e:
      raise RuntimeError(f"{LOCAL_DEVICES}={cpu_devices} needs distributed.initialize() to run before any "
                         f"JAX computation or jax.devices() call: {e}") from None
  timeouts = dict(initialization_timeout=initialization_timeout_s,
                  heartbeat_timeout_seconds=heartbeat_timeout_s, shutdown_timeout_seconds=shutdown_timeout_s)
  if explicit is not None:
    coordinator, num_processes, process_id = explicit
    if num_processes == 1:
      return False
    _use_cpu_collectives()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, **timeouts)
  elif flag == "1" or (flag != "0" and _multi_host_tpu(env)):
    jax.distributed.initialize(**timeouts)
  else:
    return False
  os.environ[_OWNER] = str(os.getpid())  # Inherited by every process this one starts.
  if exit_on_error:
    _exit_at_once_on_error()
  return True


WINDOWED_EINSUM_OFF = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
                       "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")


def tpu_compiler_flags(mesh, environ=None) -> None:
  """Adds the TPU compiler's flags a `MeshConfig` asks for to `LIBTPU_INIT_ARGS` (before libtpu starts: the
  run's and the compile report's first step); flags already there are kept, none is added twice."""
  environ = os.environ if environ is None else environ
  if mesh.windowed_einsum:
    return
  present = environ.get("LIBTPU_INIT_ARGS", "").split()
  environ["LIBTPU_INIT_ARGS"] = " ".join(present + [f for f in WINDOWED_EINSUM_OFF if f not in present])


def is_main_process() -> bool:
  """Whether this process is the one that writes logs, metrics and exported files."""
  return jax.process_index() == 0


def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array placed by `sharding` from a host array that is the same on every process.

  Each process copies only the blocks its own devices hold; nothing checks that the processes
  agree. A declared host-to-device transfer:
  allowed under `jax.transfer_guard("disallow")`, which catches every undeclared one.
  """
  x = np.asarray(x)
  with jax.transfer_guard_host_to_device("allow"):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def replicate_local(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Leaves held by this process alone, as arrays replicated over `mesh`; others as they are.

  A jitted function's output that depends on no sharded input (an optimizer's step count,
  `jax.random.key(seed)`) lives on one local device. Orbax refuses to save such an array in a
  multi-process run, and `jax.device_put` cannot move it onto a mesh spanning other processes.
  Every process must hold the same value (as it does when all run the same program).
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  mesh_devices = set(mesh.devices.flat)

  def place(x):
    if isinstance(x, jax.Array) and x.sharding.device_set == mesh_devices:
      return x
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = global_array(np.asarray(jax.random.key_data(x)), replicated)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return global_array(np.asarray(x), replicated)
  return jax.tree.map(place, tree)


def to_host(tree: Any) -> Any:
  """Every array leaf of `tree` as a full numpy array, on every process.

  An array split over other processes' devices is gathered (a collective: every process must
  call this with the same tree); replicated or process-local arrays are copied as they are.
  """
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(fetch, tree)


def local_share(n_items: int, sharding: NamedSharding | None = None) -> slice:
  """The rows of a batch of `n_items` that this process's devices hold, as one slice.

  With `sharding` (the batch's sharding; only its first dimension matters), the rows are read
  from where it places them. Without, the batch is split into `jax.process_count()` equal
  contiguous parts in process order, which is what a batch sharded over the data-like axes of a
  mesh built from `jax.devices()` in order does (`sharding.make_mesh`): every process's devices
  come after the previous process's. A process holding replicated rows shares them with others.
  """
  if sharding is None:
    count = jax.process_count()
    if n_items % count:
      raise ValueError(f"a batch of {n_items} cannot be split evenly over {count} processes")
    size = n_items // count
    return slice(jax.process_index() * size, (jax.process_index() + 1) * size)
  rows = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
  starts_stops = sorted({_row_range(index[0], n_items) for index in
                         rows.addressable_devices_indices_map((n_items,)).values()})
  start, stop = starts_stops[0][0], starts_stops[0][1]
  for lo, hi in starts_stops[1:]:
    if lo > stop:
      raise ValueError(f"this process holds rows {starts_stops} of {n_items}, not one contiguous range: "
                       "build the mesh so that each process's devices are neighbours along the batch axes")
    stop = max(stop, hi)
  return slice(start, stop)


def global_array_from_share(local: np.ndarray, sharding: NamedSharding, n_items: int) -> jax.Array:
  """A global array of `n_items` rows from each process's own rows `local` (its `local_share`).

  Every process must pass the same trailing shape (pad to a global width, not a local one). A
  declared host-to-device transfer, like `global_array`.
  """
  local = np.asarray(local)
  with jax.transfer_guard_host_to_device("allow"):
    return jax.make_array_from_process_local_data(sharding, local, (n_items, *local.shape[1:]))


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process (a collective), e.g. "a process got SIGTERM"."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def _exit_at_once_on_error():
  report = sys.excepthook

  def hook(kind, value, traceback):
    report(kind, value, traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  sys.excepthook = hook


def _use_cpu_collectives():
  # Gloo is the default from jax 0.5 on; older versions default to no cross-process CPU collectives.
  if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # CPU computations otherwise run asynchronously on a thread pool, so two in flight at once can
  # start their cross-process collectives in a different order on each process and wait on each
  # other for ever (seen here: a hang inside the trainer's per-step statistics). Synchronous
  # dispatch runs them in program order, the same on every process. TPU/GPU keep theirs ordered.
  jax.config.update("jax_cpu_enable_async_dispatch", False)


def _explicit_settings(env: Mapping[str, str]) -> tuple[str, int, int] | None:
  """(coordinator, number of processes, process id) from the environment, checked; None if unset."""
  given = [name for name in _EXPLICIT if env.get(name)]
  if not given:
    return None
  missing = [name for name in _EXPLICIT if name not in given]
  if missing:
    raise ValueError(f"{', '.join(given)} set but {', '.join(missing)} not: a multi-process run needs all of "
                     f"{', '.join(_EXPLICIT)} (or none of them for a single process)")
  coordinator = env[COORDINATOR]
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{COORDINATOR}={coordinator!r} must be host:port, e.g. localhost:12355")
  num_processes, process_id = _positive_int(env, NUM_PROCESSES), _int(env, PROCESS_ID)
  if not 0 <= process_id < num_processes:
    raise ValueError(f"{PROCESS_ID}={process_id} must be in 0 .. {num_processes - 1} "
                     f"({NUM_PROCESSES}={num_processes})")
  return coordinator, num_processes, process_id


def _multi_host_tpu(env: Mapping[str, str]) -> bool:
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  return len([h for h in hosts.split(",") if h.strip()]) > 1


def _row_range(index: slice, n_items: int) -> tuple[int, int]:
  start, stop, _ = index.indices(n_items)
  return start, stop


def _int(env: Mapping[str, str], name: str) -> int:
  try:
    return int(env[name])
  except ValueError:
    raise ValueError(f"{name}={env[name]!r} must be an integer") from None


def _positive_int(env: Mapping[str, str], name: str) -> int:
  value = _int(env, name)
  if value < 1:
    raise ValueError(f"{name}={value} must be at least 1")
  return value


def local_rows(x: jax.Array) -> tuple[slice, np.ndarray]:
  """(this process's rows of a batch-sharded global array as a slice, those rows as numpy).

  Only this process's own shards are copied to the host: no collective. A single process gets
  every row.
  """
  n = x.shape[0]
  if x.is_fully_addressable:
    return slice(0, n), np.asarray(x)
  share = local_share(n, x.sharding)
  rows = np.empty((share.stop - share.start, *x.shape[1:]), x.dtype)
  for shard in x.addressable_shards:
    start, stop = _row_range(shard.index[0], n)
    rows[start - share.start:stop - share.start] = np.asarray(shard.data)
  return share, rows


def gather_rows(local: np.ndarray) -> np.ndarray:
  """Every process's `local` rows, concatenated in process order (a collective with several)."""
  if jax.process_count() == 1:
    return np.asarray(local)
  return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def combine_metrics(metrics: dict[str, float]) -> dict[str, float]:
  """Per-process host metrics combined over processes: `time/` the slowest, `perf/` and counts
  (`verifier_`) summed, the rest averaged (processes score equal shares). A collective with several."""
  if jax.process_count() == 1:
    return metrics
  keys = sorted(metrics)
  table = gather_rows(np.asarray([[metrics[k] for k in keys]], np.float64))  # [processes, K]
  return {k: float(table[:, i].max() if k.startswith("time/") else
                   table[:, i].sum() if k.startswith("perf/") or "verifier_" in k else table[:, i].mean())
          for i, k in enumerate(keys)}
