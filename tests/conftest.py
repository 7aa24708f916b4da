"""Test setup: 8 virtual CPU devices, set before JAX is first imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (must come after the environment is set)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit` (static keyword arguments closed over)."""
  if not request.param:
    return lambda f, **static: (lambda *a: f(*a, **static))
  return lambda f, **static: jax.jit(lambda *a: f(*a, **static))
