"""Start-up checks of the machine and the run, each an error with one message saying what to change.

  devices = preflight.check_backend()        # after distributed.initialize(), before any JAX work
  preflight.check_run_dir("runs/aime_vapo")  # the run directory can be created and written
  preflight.check_memory(config, devices)    # XLA's figures of the run's programs; refused when a phase is over
  print(preflight.kernels(config, model_cfg, devices[0].platform))  # The attention each phase runs, said once

The device count a mesh needs is checked by `models.sharding.make_mesh` (a `ConfigError` naming
mesh.data / mesh.fsdp / mesh.tensor).
"""

import contextlib
import errno
import os
import shutil

from vapo_jax.errors import SetupError

_WRITE_ERRORS = {errno.EROFS: "its file system is read-only", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted", errno.ENOSPC: "the disk is full",
                 errno.EDQUOT: "the disk quota is used up", errno.ENOTDIR: "a file is in the way of the path",
                 errno.EEXIST: "a file is in the way of the path"}


def check_backend() -> list:
  """`jax.devices()`, or a `SetupError` naming JAX_PLATFORMS when JAX cannot start the backend."""
  import jax

  try:
    return jax.devices()
  except (RuntimeError, AssertionError) as e:  # jax raises AssertionError for an uninstalled cuda plugin.
    platforms = os.environ.get("JAX_PLATFORMS", "")
    reason = (str(e).strip().splitlines()[0] if str(e).strip() else
              f"{type(e).__name__} while starting it (is its plugin installed?)")
    if platforms:
      raise SetupError(
          f"JAX cannot start the platform(s) JAX_PLATFORMS={platforms!r}: {reason}. Unset JAX_PLATFORMS (JAX "
          "then picks what is installed), set it to one installed here (cpu always is), or install the "
          "backend: pip install -U \"jax[cuda12]\" (NVIDIA GPUs) or \"jax[tpu]\" (TPU VMs).") from None
    raise SetupError(f"JAX cannot start any backend: {reason}") from None


def check_run_dir(run_dir: str, *, min_free_bytes: int = 0) -> list[str]:
  """Raises `SetupError` unless `run_dir` can be created and written and has `min_free_bytes` free.

  Writes (and deletes) a small probe file; a directory this check created is removed again when
  it fails, so a refused start leaves nothing behind. Returns the directories it created, deepest
  first: a start that fails later removes them again with `remove_empty`.
  """
  missing = []
  parent = os.path.abspath(run_dir)
  while not os.path.exists(parent):
    missing.append(parent)
    parent = os.path.dirname(parent)
  probe = os.path.join(run_dir, f".write_probe.{os.getpid()}")
  try:
    os.makedirs(run_dir, exist_ok=True)
    with open(probe, "wb") as f:
      f.write(b"\0" * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    with contextlib.suppress(OSError):  # The probe, if opened before the disk was found full.
      os.remove(probe)
    remove_empty(missing)
    reason = _WRITE_ERRORS.get(e.errno, e.strerror or type(e).__name__)
    where = f" ({e.filename})" if e.filename and os.path.abspath(str(e.filename)) != os.path.abspath(probe) else ""
    raise SetupError(f"cannot write to the run directory {run_dir!r}{where}: {reason}. Choose another place "
                     "with run_dir=/path/with/space (and name=), or fix the directory's permissions or "
                     "space.") from None
  free = shutil.disk_usage(run_dir).free
  if free < min_free_bytes:
    remove_empty(missing)
    raise SetupError(f"the run directory {run_dir!r} has {free / 2**30:.2f} GiB free, less than the "
                     f"{min_free_bytes / 2**30:.2f} GiB needed: free space there, or choose another run_dir=")
  return missing


def check_memory(config, devices: list, *, show: bool = True) -> None:
  """XLA's figures for every program of `config`'s run compiled on `devices` (`memory.verdict`), printed
  with `show`; with `mesh.check_memory`, a `ConfigError` naming each phase over (1 − `mesh.memory_margin`)
  of the device memory and the settings, each compiled, that bring it under. Runs before the trainer
  builds anything."""
  from vapo_jax.memory import verdict

  verdict.check(config, devices, show=show)


def kernels(config, model_cfg, platform: str) -> str:
  """One line naming the attention the run's programs choose on `platform` with `config`'s settings: the
  training and scoring attention for padded and packed rows (`attention.select`), and the paged decode of the
  refill engine (`paged_attention.default_implementation`)."""
  import jax.numpy as jnp

  from vapo_jax.models import attention, paged_attention
  from vapo_jax.rollout import common

  m, r = config.model, config.rollout
  train = {form: attention.select(m.attention, jnp.dtype(m.dtype), platform, packed=form == "packed")
           for form in ("padded", "packed")}
  rows = " and ".join(f"{kernel} ({form} rows)" for form,
                      kernel in train.items()) if len(set(train.values())) > 1 \
      else next(iter(train.values()))
  paged = paged_attention.default_implementation(platform, head_dim=model_cfg.head_dim,
                                                 page_tokens=r.page_tokens or common.default_page_tokens(platform))
  return f"kernels on {platform}: attention {rows}; paged decode (refill engine) {paged}"


def remove_empty(directories: list[str]) -> None:
  """Removes the directories `check_run_dir` created (deepest first), if still empty."""
  for directory in directories:
    try:
      os.rmdir(directory)
    except OSError:
      pass
