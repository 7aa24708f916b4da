"""Logical axis names → mesh axes: the parallelism presets, the mesh, and sharded creation.

Every parameter carries `logical_axes` metadata (names such as "embed", "mlp", "heads") and the
model constrains its main activations with logical names ("batch", "seq", "embed", ...). A preset
is a small table mapping each logical name to mesh axes of a `Mesh` with axes
(data, fsdp, tensor); changing parallelism means choosing another preset, never editing the model.
"""

import contextlib
import contextvars
import itertools
import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vapo_jax import distributed, kinds
from vapo_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # Batches are split over every data-like axis.

# Logical name -> mesh axis (or axes, or None for replicated), per preset.
PRESETS: dict[str, dict[str, Any]] = {
    # Pure data parallelism: parameters replicated, batch split over every device.
    "dp": {"batch": BATCH},
    # FSDP (ZeRO-3): parameters split along their model-width axis over fsdp.
    "fsdp": {"batch": BATCH, "embed": "fsdp"},
    # FSDP + tensor parallelism (Megatron-style heads / MLP split, vocab split), with sequence parallelism: the
    # residual stream between the attention and MLP blocks ("act_seq") split along the sequence over tensor, so
    # each device of a tensor group norms and adds 1/tensor of the tokens (gathered before each block's matmuls).
    "fsdp_tp": {"batch": BATCH, "embed": "fsdp", "act_seq": "tensor", "heads": "tensor", "kv_heads": "tensor",
                "mlp": "tensor", "vocab": "tensor", "act_heads": "tensor", "act_kv_heads": "tensor",
                "act_mlp": "tensor", "act_vocab": "tensor"},
    # Tensor parallelism with data-parallel replicas: the rollout layout (rollout/layout.py). Weights are
    # split by heads, MLP width and vocabulary, never gathered (embed unsplit); the KV cache by batch and
    # KV heads. A decode step then communicates activations only.
    "tp": {"batch": BATCH, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
           "act_heads": "tensor", "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor",
           "cache_kv_heads": "tensor"},
}

kinds.check_table(kinds.MeshPreset, PRESETS, "models/sharding.py PRESETS")

# The rules' entry naming the mesh axis over which the decoder's blocks gather their input and scatter their output
# in steps around their matmuls (models/collective_matmul.py): `rules(..., collective_matmul=True)` adds it.
COLLECTIVE_MATMUL = "collective_matmul"


def rules(preset: kinds.MeshPreset, *, collective_matmul: bool = False) -> dict[str, Any]:
  """A preset's rules (`PRESETS`); `collective_matmul`: with the blocks' activation gathers and reductions over the
  sequence split ("act_seq") run as collective matmuls (none where the preset splits no sequence)."""
  table = PRESETS[preset]
  return {**table, COLLECTIVE_MATMUL: table["act_seq"]} if collective_matmul and "act_seq" in table else table

_CONTEXT: contextvars.ContextVar[tuple[Mesh, dict[str, Any]] | None] = contextvars.ContextVar(
    "vapo_jax_sharding", default=None)


def make_mesh(*, data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh; one size may be -1 to take the devices left over."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  known = math.prod(s for s in sizes if s != -1)
  setting = ", ".join(f"mesh.{axis}={size}" for axis, size in zip(MESH_AXES, sizes))
  platform = devices[0].platform if devices else "none"
  advice = (f"choose sizes whose product is {len(devices)} (one of them -1 takes the devices left over), "
            "or run where more devices are visible")
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(f"{len(devices)} devices cannot be split into a mesh with sizes {sizes} ({setting}; "
                        f"JAX sees {len(devices)} {platform} devices, not a multiple of {known}): {advice}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, "
                      f"but {len(devices)} are available ({setting}; JAX sees {len(devices)} {platform} "
                      f"devices): {advice}")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def tensor_groups(devices: Sequence[jax.Device], size: int) -> list[jax.Device]:
  """`devices` reordered so that every `size` consecutive ones are physical neighbours: a block of the
  chips' grid (by `coords`, then `core_on_chip`), as cube-like as the grid allows (2×2×2 for 8 chips of
  a 3-D torus), with each process's devices kept together. A mesh built from this order with `size`
  devices innermost (the rollout layout's tensor groups, rollout/layout.py) then puts each group in
  one block. Devices without coordinates (CPUs), or whose grid does not split into such blocks, keep
  their order."""
  devices = list(devices)
  if size <= 1 or not all(hasattr(d, "coords") for d in devices):
    return devices
  coords = np.array([tuple(d.coords) + (getattr(d, "core_on_chip", 0),) for d in devices])
  coords -= coords.min(0)
  dims = tuple(int(n) for n in coords.max(0) + 1)
  blocks = [b for b in itertools.product(*(range(1, n + 1) for n in dims))
            if math.prod(b) == size and all(n % k == 0 for n, k in zip(dims, b))]
  if math.prod(dims) != len(devices) or len(set(map(tuple, coords))) != len(devices) or not blocks:
    return devices
  block = min(blocks, key=lambda b: (max(b), [-k for k in reversed(b)]))  # Cube-like; later axes first.
  grid = np.empty(dims, int)
  grid[tuple(coords.T)] = np.arange(len(devices))
  split = grid.reshape([x for n, k in zip(dims, block) for x in (n // k, k)])
  k = len(dims)
  groups = split.transpose(list(range(0, 2 * k, 2)) + list(range(1, 2 * k, 2))).reshape(-1, size)
  process = lambda i: devices[i].process_index
  groups = sorted((sorted(g, key=process) for g in groups), key=lambda g: process(g[0]))
  return [devices[i] for g in groups for i in g]


_REPLICATED: set = set()  # The logical axes `partition_spec` has warned of.
# Logical axes whose split is an optimisation, replicated without a warning where the mesh does not divide them
# (the residual stream's sequence: a decode step's single token, a short prompt).
QUIETLY_REPLICATED = frozenset({"act_seq"})


def partition_spec(logical_axes: Sequence[str | None], rules: dict[str, Any],
                   mesh_shape: Mapping[str, int] | None = None,
                   shape: Sequence[int] | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec; with `shape`, a dimension that the mesh axes do
  not divide is replicated (with a warning) rather than failing at compile time."""
  spec, used = [], set()
  for i, name in enumerate(logical_axes):
    axes = rules.get(name) if name else None
    axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes_tuple = tuple(a for a in axes_tuple if a not in used)
    if mesh_shape is not None and shape is not None and axes_tuple:
      size = math.prod(mesh_shape[a] for a in axes_tuple)
      if shape[i] % size:
        said = (name, shape[i], axes_tuple, size) in _REPLICATED  # Said once a process (traced often).
        if name not in QUIETLY_REPLICATED and not said:
          _REPLICATED.add((name, shape[i], axes_tuple, size))
          warnings.warn(f"logical axis {name!r} of size {shape[i]} is not divisible by mesh axes "
                        f"{axes_tuple} (size {size}); replicating it", stacklevel=2)
        axes_tuple = ()
    used.update(axes_tuple)
    spec.append(None if not axes_tuple else axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple)
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


def state_partition_specs(state: nnx.State, rules: dict[str, Any], mesh: Mesh | None = None) -> nnx.State:
  """PartitionSpec of every variable in `state`, from its `logical_axes` metadata."""
  def spec(variable):
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
      return PartitionSpec()
    return partition_spec(axes, rules, None if mesh is None else mesh.shape, variable.get_value().shape)
  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules: dict[str, Any]) -> NamedSharding:
  """Where an array of `shape` goes on `mesh`: its leading (batch) axis split over the mesh axes that
  "batch" maps to when they divide it evenly, else (and for scalars) replicated."""
  spec = partition_spec(("batch",), rules)
  axes = spec[0] if spec else ()
  shards = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
  return NamedSharding(mesh, spec if len(shape) and shape[0] % shards == 0 else PartitionSpec())


def place(tree: Any, mesh: Mesh, rules: dict[str, Any]) -> Any:
  """Every leaf of `tree` on `mesh`, laid out by `batch_sharding`: a host array (the same on every process)
  becomes a global array, a device array laid out elsewhere (a key replicated on another mesh of the same
  devices) moves, and an abstract array (`jax.ShapeDtypeStruct`, a compile report's input) takes the
  sharding."""
  def one(x):
    target = batch_sharding(np.shape(x), mesh, rules)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
    if isinstance(x, jax.Array):
      return x if x.sharding == target else jax.device_put(x, target)
    return distributed.global_array(x, target)
  return jax.tree.map(one, tree)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: dict[str, Any]):
  """Within this context, `constrain` places activations on `mesh` by `rules`."""
  token = _CONTEXT.set((mesh, rules))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def context() -> tuple[Mesh, dict[str, Any]] | None:
  """The (mesh, rules) of the enclosing `use_rules`, or None outside one."""
  return _CONTEXT.get()


def platform() -> str:
  """The platform programs are traced for: the `use_rules` mesh's devices (a TPU topology compiled
  for on a CPU host is "tpu"), else JAX's default backend."""
  found = _CONTEXT.get()
  return found[0].devices.flat[0].platform if found is not None else jax.default_backend()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on an activation by logical names; a no-op outside `use_rules`."""
  context = _CONTEXT.get()
  if context is None:
    return x
  mesh, rules = context
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, partition_spec(logical_axes, rules, mesh.shape, x.shape)))


_INITS: dict = {}  # (key, mesh, rules) → the jitted initialisation `create_sharded` built for that key.
_KEEP_INITS = 8


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: dict[str, Any], *,
                   key: Hashable | None = None) -> nnx.Module:
  """Builds `factory()` with every parameter created directly in its sharding.

  The module is traced abstractly first (no memory), its shardings are derived from the
  parameters' logical axes, and initialisation runs under `jit` with those output shardings, so
  no device ever holds a full copy of a sharded parameter. `key`: what determines `factory`'s module
  and values (a trainer's: the model config and which model); a later call with the same key, mesh and
  rules runs the program the first one compiled, untraced.
  """
  cache_key = None if key is None else (key, mesh, tuple(sorted((k, str(v)) for k, v in rules.items())))
  if cache_key in _INITS:
    graphdef, init = _INITS[cache_key]
    return nnx.merge(graphdef, init())
  graphdef, abstract_state = abstract_sharded(factory, mesh, rules)
  shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
  init = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)
  if cache_key is not None:
    _INITS[cache_key] = graphdef, init
    while len(_INITS) > _KEEP_INITS:
      _INITS.pop(next(iter(_INITS)))
  return nnx.merge(graphdef, init())


def abstract_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: dict[str, Any]):
  """(graphdef, state) of `factory()` without allocating: every parameter a `jax.ShapeDtypeStruct`
  carrying the `NamedSharding` `create_sharded` gives it (traced under `use_rules`, so a choice made
  for the mesh's platform is made for it)."""
  with use_rules(mesh, rules):
    graphdef, state = nnx.split(nnx.eval_shape(factory))
  specs = state_partition_specs(state, rules, mesh)
  place = lambda v, spec: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                         sharding=NamedSharding(mesh, spec)))
  return graphdef, jax.tree.map(place, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))


def jit(fn: Callable, mesh: Mesh, rules: dict[str, Any], **jit_kwargs) -> Callable:
  """`jax.jit(fn, **jit_kwargs)` whose trace runs under `use_rules(mesh, rules)`.

  The rules are bound when the function is built, not read from the caller's context at call
  time, so a program traced once can never have been traced without them (jit's cache does not
  see a context variable).
  """
  def traced(*args, **kwargs):
    with use_rules(mesh, rules):
      return fn(*args, **kwargs)
  traced.__name__ = getattr(fn, "__name__", "program")
  return jax.jit(traced, **jit_kwargs)
