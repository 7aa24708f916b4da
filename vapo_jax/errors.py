"""Errors a user can act on: one message naming the file, tensor, row or setting, and what to do.

Every mistake in a run's configuration, files or environment raises a subclass of `UserError`;
the command-line entry points print its message on one line and exit with
`USER_ERROR_EXIT_CODE`, without a traceback. Anything else is a bug and keeps its traceback.

  UserError             (a ValueError, so older `except ValueError` handlers still catch it)
    ConfigError         an invalid setting (config/, overrides, experiments, mesh, presets)
    DataError           a data file that cannot be used (data.py)
    CheckpointError     a model checkpoint that cannot be read or does not match (models/)
    TokenizerError      a tokenizer that is missing or does not fit the model (tokenizer.py)
    RewardFunctionError a reward function that cannot be loaded or fails on every response
    SetupError          the machine: JAX backend, device count, run directory (preflight.py)
    MissingFileError    a file or directory that does not exist (also a FileNotFoundError)

This module imports nothing, so that any module (the pure ones included) may use it.
"""

USER_ERROR_EXIT_CODE = 2


def counted(n: int, noun: str, plural: str | None = None) -> str:
  """`n` and `noun` as a message says them: "1 page", "2 pages" (`plural`: the plural where it is not noun + s)."""
  return f"{n} {noun if n == 1 else plural or noun + 's'}"


class UserError(ValueError):
  """A mistake the user can fix; its message says where and how."""


class ConfigError(UserError):
  """An invalid configuration value; `cross_field`: judged against other fields' values (a section's check of
  one field alone, on the defaults of the others, leaves it out)."""

  def __init__(self, message: str, *, cross_field: bool = False):
    super().__init__(message)
    self.cross_field = cross_field


class DataError(UserError):
  """A data file that cannot be used; the message names the file, row and field."""


class CheckpointError(UserError):
  """A checkpoint directory that cannot be read or does not match the model; names file and tensor."""


class TokenizerError(UserError):
  """A tokenizer that is missing or does not match the model's vocabulary."""


class RewardFunctionError(UserError):
  """A reward function that cannot be imported, or that failed on every response of a batch."""


class SetupError(UserError):
  """The environment cannot run the configuration: JAX backend, devices, run directory."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or directory that does not exist (caught by `except FileNotFoundError` too)."""

  def __init__(self, message: str):
    super().__init__(message)

  def __str__(self) -> str:
    return self.args[0]
