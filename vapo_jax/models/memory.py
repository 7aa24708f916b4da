"""Per-device memory of a model's parameters, gradients and optimizer state, before allocation.

Traces the module abstractly (`nnx.eval_shape`: no memory), shards each parameter's shape by its
logical axes under a preset and mesh shape, and adds up the bytes each device will hold.
"""

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from vapo_jax.models import sharding


class MemoryReport(NamedTuple):
  num_parameters: int  # Total parameter count.
  param_bytes: int  # Per device.
  grad_bytes: int  # Per device (gradients in the parameter dtype).
  optimizer_bytes: int  # Per device (AdamW: two float32 moments).

  @property
  def total_bytes(self) -> int:
    return self.param_bytes + self.grad_bytes + self.optimizer_bytes

  def format(self, name: str = "model") -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    return (f"{name}: {self.num_parameters / 1e9:.3f} B parameters; per device: params {gib(self.param_bytes)}, "
            f"grads {gib(self.grad_bytes)}, AdamW state {gib(self.optimizer_bytes)}, "
            f"total {gib(self.total_bytes)}")


def parameter_memory(factory: Callable[[], nnx.Module], *, rules: dict, mesh_shape: Mapping[str, int],
                     optimizer_moments: int = 2, optimizer_dtype=jnp.float32) -> MemoryReport:
  """Memory per device of `factory()`'s parameters, gradients and optimizer state on a mesh."""
  state = nnx.state(nnx.eval_shape(factory), nnx.Param)
  count = params = optimizer = 0
  for _, variable in nnx.to_flat_state(state):
    value = variable.get_value()
    spec = sharding.partition_spec(variable.get_metadata()["logical_axes"], rules, mesh_shape, value.shape)
    split = math.prod(math.prod(mesh_shape[a] for a in ((ax,) if isinstance(ax, str) else ax))
                      for ax in spec if ax is not None)
    numel = math.prod(value.shape)
    count += numel
    params += math.ceil(numel / split) * jnp.dtype(value.dtype).itemsize
    optimizer += math.ceil(numel / split) * optimizer_moments * jnp.dtype(optimizer_dtype).itemsize
  return MemoryReport(count, params, params, optimizer)


def main(argv: list[str]) -> int:
  """`python -m vapo_jax.models.memory PRESET SHARDING data=1 fsdp=256 tensor=1`"""
  from vapo_jax.models.config import preset
  from vapo_jax.models.transformer import CausalLM, ValueModel

  if len(argv) < 2:
    print(main.__doc__)
    return 2
  cfg, rules = preset(argv[0]), sharding.PRESETS[argv[1]]
  mesh_shape = {"data": 1, "fsdp": 1, "tensor": 1} | {k: int(v) for k, v in (a.split("=") for a in argv[2:])}
  print(f"{argv[0]} on mesh {mesh_shape} ({math.prod(mesh_shape.values())} devices), preset {argv[1]}, "
        f"float32 parameters and AdamW moments")
  for name, cls in (("policy", CausalLM), ("critic", ValueModel)):
    report = parameter_memory(lambda: cls(cfg, rngs=nnx.Rngs(0)), rules=rules, mesh_shape=mesh_shape)
    print("  " + report.format(name))
  return 0


if __name__ == "__main__":
  import sys
  sys.exit(main(sys.argv[1:]))
