"""Test setup: 8 virtual CPU devices, set before JAX is first imported, and one XLA compilation
cache for the session (this process and the runs its tests start): tests that build the same
programs (the trainer tests' models, samplers and updates) compile each of them once.

XLA's backend runs at its default optimisation level: at `--xla_backend_optimization_level=0` (tried in
session 5, 5 % faster) LLVM's code differs in floating-point rounding, and 1 device against 8 then
differed by 1.6e-6 in one parameter, over the test's 1e-6 (`test_one_and_eight_devices_...`)."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="vapo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402  (must come after the environment is set)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit` (static keyword arguments closed over)."""
  if not request.param:
    return lambda f, **static: (lambda *a: f(*a, **static))
  return lambda f, **static: jax.jit(lambda *a: f(*a, **static))


# The test files that take longest (idle durations of `make test`, most first). `make test` hands
# whole files to its two processes in collection order (`--dist loadfile`); starting with the
# longest keeps one process from running a long file alone at the end (longest-first scheduling).
LONGEST_FILES = ("test_trainer.py", "test_train_step.py", "test_trainer_fidelity.py", "test_refill.py",
                 "test_rollout.py", "test_losses.py", "test_advantages.py", "test_memory.py", "test_logprobs.py",
                 "test_decode_attention.py", "test_verifier_data.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: file order otherwise kept.
