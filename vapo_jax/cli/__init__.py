"""The command-line entry points: the only layer that imports the experiment registry (`experiments/`).

  train      `make train`: resolve an experiment, run it       python -m vapo_jax.cli.train
  evaluate   `make eval`: avg@k / pass@k / maj@k of responses  python -m vapo_jax.cli.evaluate
  sweep      `make sweep`: every member × seed, then a report  python -m vapo_jax.cli.sweep
  plots      `make plot`: PNG curves of runs                   python -m vapo_jax.cli.plots
  memory     `make memory`: the per-device memory plan         python -m vapo_jax.cli.memory
  resolve    `--exp`, `--smoke` and `field.path=value` overrides into a config (no JAX)
  preflight  the machine's checks before a run starts: backend, devices, run directory

Importing the package sets JAX_PLATFORMS=cpu on a machine without accelerator devices (`cpu_only_platform`).
"""

import glob
import os

# Device files of the accelerators JAX could use: TPU (/dev/accel*, /dev/vfio), NVIDIA and AMD GPUs.
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def cpu_only_platform(environ=os.environ, *, files=ACCELERATOR_FILES) -> None:
  """On a machine with none of `files`, `JAX_PLATFORMS=cpu` (unless set): JAX then never starts libtpu,
  whose probe of a TPU VM's environment prints errors at the start of a CPU run. Where an accelerator's
  device file exists JAX chooses as it would."""
  if "JAX_PLATFORMS" not in environ and not any(glob.glob(pattern) for pattern in files):
    environ["JAX_PLATFORMS"] = "cpu"


cpu_only_platform()  # Before any entry point imports JAX.
