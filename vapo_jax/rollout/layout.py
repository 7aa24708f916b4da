"""The rollout layout: the mesh, sharding rules and weights the policy decodes with.

  layout = layout_for(config.rollout, training_mesh, compute_dtype="bfloat16", training_rules=rules)
  params = layout.reshard(state.actor)     # once per RL step (and evaluation); dropped after generation
  out, metrics = rollout.sample(nnx.merge(actor_def, params), ..., jit=layout.jit, place=layout.place)
  out = layout.to_training(out)            # the rollout's arrays where scoring reads them

Training keeps each weight split over the FSDP devices. Decoding in that layout gathers every
weight for every token (under `fsdp`, a 32B model's 65 GB into each chip per decode step). With
`rollout.tensor_parallel` = T > 1 the rollout decodes on a second mesh instead: the same devices
in the same order (jit requires one device order for a program that reads one layout and writes
the other), grouped into data-parallel groups of T consecutive devices (data = devices / T,
tensor = T), under the "tp" preset (models/sharding.py): heads, KV heads, MLP width and vocabulary
split over the group, embed unsplit, batch over the groups, the KV cache split by batch and KV
heads. The weights then stay where they are while decoding; a step communicates activations only
(one reduction per attention and per MLP block, the embedding's and the sampler's small ones).
A group is T physical neighbours when the training mesh was built from `sharding.tensor_groups`'s
device order (the trainer does so).

The reshard: once per RL step the actor's parameters move from the training layout into the
rollout layout, cast to the compute dtype, each array by a small jitted program of its kind (shape,
dtype, input and output sharding: about ten kinds for a transformer, whatever its depth). The
inputs are not donated (training needs them); the peak is the training shards, the rollout copy
and one array in flight. The copy is dropped after generation.

With `rollout.weight_dtype="int8"` the reshard also quantises each decoder layer's seven matmul kernels
(models/int8_weights.py: int8 values, one float32 scale per output channel, split over the group as the
kernel's output axes are): a decode step then reads about half the weights' bytes. The trainer keeps full
precision; the sampler's log-probs come from the int8 copy (`algo.tis_cap` corrects the difference,
`rollout/sampler_kl` measures it).

With T = 1 the layout is the training mesh and rules, `reshard` returns the parameters themselves
(no copy; int8 weights: the quantised copy in the training layout) and `to_training` its input: the
rollout runs exactly as it did before this layout.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.models import int8_weights, sharding

_IS_VARIABLE = lambda x: isinstance(x, nnx.Variable)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(tensor_parallel: int, *, devices: int, kv_heads: int | None = None) -> None:
  """A `ConfigError` naming `rollout.tensor_parallel` when groups of that many chips do not divide the
  devices or (when given) the model's KV heads, which the rollout splits the KV cache by."""
  t = tensor_parallel
  if devices % t:
    raise ConfigError(f"rollout.tensor_parallel={t} must divide the mesh's {devices} devices: choose one of "
                      f"{_divisors(devices)} (1 decodes in the training layout)")
  if kv_heads is not None and kv_heads % t:
    fits = [d for d in _divisors(kv_heads) if devices % d == 0]
    raise ConfigError(f"rollout.tensor_parallel={t} must divide the model's {kv_heads} KV heads (the rollout "
                      f"splits the KV cache by heads over each tensor-parallel group): choose one of {fits}")


@dataclasses.dataclass(frozen=True)
class _Quantise:
  """Where a kernel's int8 copy goes (a leaf of `RolloutLayout._targets`): its values' and its scale's
  shardings, and its axes."""
  shardings: int8_weights.Int8Kernel  # Of `NamedSharding`s.
  axes: int8_weights.Axes


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutLayout:
  """Where a rollout decodes (see the module docstring); build it with `layout_for`."""

  mesh: Mesh  # The rollout mesh: the training mesh's devices in its order, (data, 1, tensor_parallel).
  rules: Mapping[str, Any]  # Logical axis -> mesh axes while decoding.
  training_mesh: Mesh  # Where the parameters and the scoring live.
  training_rules: Mapping[str, Any]
  tensor_parallel: int  # Chips per tensor-parallel group (1: the training layout itself).
  compute_dtype: jnp.dtype  # The rollout copy's dtype.
  weight_dtype: str = "model"  # `rollout.weight_dtype`: "int8" quantises the layers' kernels (module doc).
  _programs: dict = dataclasses.field(default_factory=dict, init=False,
                                      repr=False)  # Output sharding -> cast.

  @property
  def copies(self) -> bool:
    """Whether `reshard` makes a copy (a second layout, or int8 weights), or returns the parameters."""
    return self.tensor_parallel > 1 or self.weight_dtype == "int8"

  @property
  def data_devices(self) -> int:
    """Data-parallel groups: the rollout's batch is split over them, slot counts are multiples of them."""
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  def jit(self, fn: Callable, **kwargs) -> Callable:
    """`sharding.jit` with the rollout mesh and rules bound."""
    return sharding.jit(fn, self.mesh, self.rules, **kwargs)

  def place(self, tree):
    """Every input of a rollout program, keys included, on the rollout mesh: split over its batch axes
    (replicated when they do not divide), from the host, from the training mesh, or as abstract arrays
    (`sharding.place`). The one placement of a rollout's inputs: the trainer's calls and the compile report's
    arguments go through it."""
    return sharding.place(tree, self.mesh, self.rules)

  def reshard(self, params: nnx.State) -> nnx.State:
    """The actor's parameters (an `nnx.State` in the training layout) in the rollout layout, cast to the
    compute dtype (the layers' kernels int8 with `weight_dtype` "int8"): a new copy, the inputs untouched;
    with tensor_parallel 1 and the model's dtype, `params` themselves."""
    if not self.copies:
      return params
    return jax.tree.map(lambda v, out: v.replace(self._program(out)(v.get_value())), params,
                        self._targets(params), is_leaf=_IS_VARIABLE)

  def reshard_programs(self, abstract_params: nnx.State) -> list[tuple[Callable, jax.ShapeDtypeStruct]]:
    """The reshard's programs, one per array kind, each with an abstract input (shape, dtype and
    training sharding) to lower it with: `program.lower(x).compile()`. Empty where `reshard` copies nothing."""
    if not self.copies:
      return []
    kinds = {}
    for v, out in zip(jax.tree.leaves(abstract_params, is_leaf=_IS_VARIABLE),
                      jax.tree.leaves(self._targets(abstract_params))):
      x = v.get_value()
      kinds.setdefault((x.shape, x.dtype, x.sharding, out), (self._program(out), jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=x.sharding)))
    return list(kinds.values())

  def abstract_copy(self, abstract_params: nnx.State) -> nnx.State:
    """What `reshard` returns for parameters with these shapes, dtypes and shardings, as abstract arrays
    (the compute dtype or int8 kernels, the rollout shardings), allocating nothing: a compile report's input."""
    if not self.copies:
      return abstract_params
    return jax.tree.map(lambda v, out: v.replace(jax.eval_shape(self._program(out), v.get_value())),
                        abstract_params, self._targets(abstract_params), is_leaf=_IS_VARIABLE)

  def to_training(self, tree):
    """Rollout arrays placed where the trainer reads them: split over the training mesh's batch axes
    (replicated when they do not divide). With tensor_parallel 1, `tree` itself."""
    if self.tensor_parallel == 1:
      return tree
    place = lambda x: sharding.batch_sharding(x.shape, self.training_mesh, self.training_rules)
    return jax.device_put(tree, jax.tree.map(place, tree))

  def check_model(self, model_cfg) -> None:
    """A `ConfigError` when the tensor-parallel groups cannot split the model's KV heads (the cache's)."""
    check_tensor_parallel(self.tensor_parallel, devices=self.mesh.size, kv_heads=model_cfg.num_kv_heads)

  def _targets(self, params: nnx.State):
    """The rollout sharding of every parameter, from its logical axes: a `NamedSharding`, or for a kernel
    quantised to int8 a `_Quantise`."""
    specs = sharding.state_partition_specs(params, dict(self.rules), self.mesh)

    def target(path, v, spec):
      kind = self._quantised(path)
      if kind is None:
        return NamedSharding(self.mesh, spec)
      axes, x = v.get_metadata()["logical_axes"], v.get_value().shape
      scale = sharding.partition_spec(int8_weights.per_scale(axes, kind), dict(self.rules), self.mesh.shape,
                                      int8_weights.per_scale(x, kind))
      return _Quantise(int8_weights.Int8Kernel(NamedSharding(self.mesh, spec), NamedSharding(self.mesh, scale)), kind)
    return jax.tree_util.tree_map_with_path(target, params, specs, is_leaf=_IS_VARIABLE)

  def _quantised(self, path) -> int8_weights.Axes | None:
    """A decoder layer kernel's axes where `weight_dtype` is int8 (`path`: the parameter's in the state)."""
    if self.weight_dtype != "int8":
      return None
    names = [str(getattr(k, "key", k)) for k in path]
    return int8_weights.LAYER_KERNELS.get(names[-1]) if "layers" in names else None

  def _program(self, out) -> Callable:
    """The jitted cast into `out`, or the quantisation a `_Quantise` names (jit compiles it once per input
    shape, dtype and sharding)."""
    if out not in self._programs:
      if isinstance(out, _Quantise):
        self._programs[out] = jax.jit(lambda x: int8_weights.quantize(x, out.axes), out_shardings=out.shardings)
      else:
        self._programs[out] = jax.jit(lambda x: x.astype(self.compute_dtype), out_shardings=out)
    return self._programs[out]


def layout_for(rollout_config: RolloutConfig, training_mesh: Mesh, *, compute_dtype,
               training_rules: Mapping[str, Any]) -> RolloutLayout:
  """The rollout layout of `rollout.tensor_parallel` over `training_mesh` (whose parameters follow
  `training_rules`); a `ConfigError` when the groups do not divide its devices."""
  t, devices = rollout_config.tensor_parallel, training_mesh.devices
  common = dict(training_mesh=training_mesh, training_rules=training_rules, tensor_parallel=t,
                compute_dtype=jnp.dtype(compute_dtype), weight_dtype=rollout_config.weight_dtype)
  if t == 1:
    return RolloutLayout(mesh=training_mesh, rules=training_rules, **common)
  check_tensor_parallel(t, devices=devices.size)
  mesh = Mesh(devices.reshape(devices.size // t, 1, t),
              sharding.MESH_AXES)  # The same devices, in the same order.
  return RolloutLayout(mesh=mesh, rules=sharding.PRESETS["tp"], **common)
