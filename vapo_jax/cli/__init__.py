"""The command-line entry points: the only layer that imports the experiment registry (`experiments/`).

  train      `make train`: resolve an experiment, run it       python -m vapo_jax.cli.train
  evaluate   `make eval`: avg@k / pass@k / maj@k of responses  python -m vapo_jax.cli.evaluate
  sweep      `make sweep`: every member × seed, then a report  python -m vapo_jax.cli.sweep
  sweep_runs a sweep's runs as `make train` subprocesses, started as their stages finish, stopped together
  sweep_report  a sweep's runs.csv, table.md and plots/, rebuilt from the runs' own metrics
  plots      `make plot`: PNG curves of runs                   python -m vapo_jax.cli.plots
  memory     `make memory`: XLA's per-device memory of a run    python -m vapo_jax.cli.memory
  resolve    `--exp`, `--smoke` and `field.path=value` overrides into a config (no JAX)
  preflight  the checks before a run starts: backend, devices, run directory, XLA's memory verdict

Every entry point parses its arguments with `ArgumentParser` before it imports JAX: `--help` prints its
usage (exit 0) at once, and a bad argument is one line on stderr (exit 2).
Importing the package sets JAX_PLATFORMS=cpu on a machine without accelerator devices (`cpu_only_platform`).
`one_line_warnings` shows the package's own warnings as the entry points' other messages: one line each.
`outlasting_output` keeps a run going when the pipe or terminal its output goes to is gone (a stop saves).
"""

import argparse
import contextlib
import errno
import glob
import os
import sys
import warnings

from vapo_jax.errors import USER_ERROR_EXIT_CODE

# Device files of the accelerators JAX could use: TPU (/dev/accel*, /dev/vfio), NVIDIA and AMD GPUs.
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser whose mistakes are one line on stderr and exit status 2 (`USER_ERROR_EXIT_CODE`),
  as every user error of the entry points."""

  def error(self, message: str):
    self.exit(USER_ERROR_EXIT_CODE, f"error: {message} (--help: the usage)\n")


def cpu_only_platform(environ=os.environ, *, files=ACCELERATOR_FILES) -> None:
  """On a machine with none of `files`, `JAX_PLATFORMS=cpu` (unless set): JAX then never starts libtpu,
  whose probe of a TPU VM's environment prints errors at the start of a CPU run. Where an accelerator's
  device file exists JAX chooses as it would."""
  if "JAX_PLATFORMS" not in environ and not any(glob.glob(pattern) for pattern in files):
    environ["JAX_PLATFORMS"] = "cpu"


# The package's own sources (vapo_jax/ and experiments/): the warnings raised from them are the run's
# messages.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = (os.path.join(_PACKAGE, ""), os.path.join(os.path.dirname(_PACKAGE), "experiments", ""))


@contextlib.contextmanager
def one_line_warnings():
  """Inside the block, a warning raised from the package's own code is one line on stderr, `warning: ...`,
  in the voice of the entry points' `error: ...` lines, without Python's file, line and source under it.
  Warnings from libraries keep Python's form (and the filters the modules set for their known noise)."""
  shown = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):
    if os.path.abspath(filename).startswith(_OWN):
      print(f"warning: {message}", file=sys.stderr, flush=True)
    else:
      shown(message, category, filename, lineno, file, line)

  with warnings.catch_warnings():
    warnings.showwarning = show  # Restored on leaving the block.
    yield


class _Outlasting:
  """A text stream whose writes outlast its reader: once the pipe or terminal behind it is gone (EPIPE, EIO),
  what is written goes nowhere instead of raising in the middle of a step or a save."""

  _GONE = (errno.EPIPE, errno.EIO, errno.EBADF, errno.ECONNRESET)

  def __init__(self, stream):
    self._stream, self._gone = stream, False

  def _call(self, method, *args):
    if not self._gone:
      try:
        return getattr(self._stream, method)(*args)
      except OSError as e:
        if e.errno not in self._GONE:
          raise
        self._gone = True
    return len(args[0]) if args else None

  def write(self, text):
    return self._call("write", text)

  def flush(self):
    return self._call("flush")

  def __getattr__(self, name):
    return getattr(self._stream, name)


@contextlib.contextmanager
def outlasting_output():
  """Inside the block, stdout and stderr outlast their readers (`_Outlasting`): under `make train | tee log`,
  a signal to the process group ends make and tee, and the run still finishes its step and saves."""
  saved = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = _Outlasting(sys.stdout), _Outlasting(sys.stderr)
  try:
    yield
  finally:
    sys.stdout, sys.stderr = saved


cpu_only_platform()  # Before any entry point imports JAX.
