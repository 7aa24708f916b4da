"""Writing a run's files: a reader never takes a partial file for complete; a full disk or an unwritable
directory is one line.

  files.write_atomically(path, text)                           # via a temporary file and a rename
  with files.reporting_write_failures(directory, "saving checkpoint 3"):
    ...                                   # ENOSPC / EDQUOT, EACCES / EPERM / EROFS -> SetupError

A write that fails leaves its temporary file removed and the previous version of the file (if any) in
place. `reporting_write_failures` turns a full disk or an exhausted quota met anywhere in its block (also
one re-raised from a background thread, or wrapped in another exception) into a `SetupError` naming
the directory, the space left there and what to do; any other error passes through unchanged.
"""

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

from vapo_jax.errors import SetupError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = tuple(os.strerror(code) for code in DISK_FULL_ERRNOS)  # Libraries that wrap the OSError.
UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)  # A directory made read-only, or remounted so.
UNWRITABLE_TEXTS = tuple(os.strerror(code) for code in UNWRITABLE_ERRNOS)


def _cause(error: BaseException | None, errnos: tuple[int, ...],
           texts: tuple[str, ...]) -> BaseException | None:
  """The exception in `error`'s chain of causes (and exception groups) with one of `errnos` (or, not an
  OSError, whose text holds one of `texts`)."""
  seen: set[int] = set()
  pending = [error]
  while pending:
    e = pending.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in errnos:
      return e
    if not isinstance(e, OSError) and any(text in str(e) for text in texts):
      return e
    pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return None


def disk_full_cause(error: BaseException | None) -> BaseException | None:
  """The exception, in `error`'s chain of causes (and exception groups), that says the disk is full."""
  return _cause(error, DISK_FULL_ERRNOS, DISK_FULL_TEXTS)


def unwritable_cause(error: BaseException | None) -> BaseException | None:
  """The exception, in `error`'s chain of causes, that says a file could not be written: permission denied,
  or a read-only file system."""
  return _cause(error, UNWRITABLE_ERRNOS, UNWRITABLE_TEXTS)


def _free_space(directory: str) -> str:
  path = os.path.abspath(directory)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    free = shutil.disk_usage(path).free
  except OSError:
    return "free space unknown"
  return f"{free / 2**30:.2f} GiB free" if free >= 2**30 else f"{free / 2**20:.1f} MiB free"


def disk_full_error(directory: str, what: str, *, cause: BaseException | None = None,
                    elsewhere: str = "run_dir=",
                    after: str = "then run the same command again") -> SetupError:
  """The one-line error of a full disk met while `what` in `directory`."""
  quota = isinstance(cause, OSError) and cause.errno == errno.EDQUOT
  reason = "the disk quota is used up" if quota else "the disk is full"
  return SetupError(f"{what} in {directory}: {reason} ({_free_space(directory)} there). Free space on that "
                    "disk (e.g. other runs' checkpoints/ and export/ directories) or choose another "
                    f"{elsewhere}, {after}")


def unwritable_error(directory: str, what: str, *, cause: BaseException | None = None,
                     elsewhere: str = "run_dir=",
                     after: str = "then run the same command again") -> SetupError:
  """The one-line error of a file that could not be written (permission denied, a read-only file system)
  while `what` in `directory`."""
  name = getattr(cause, "filename", None)
  reason = os.strerror(cause.errno) if isinstance(cause, OSError) and cause.errno else str(cause)
  return SetupError(f"{what} in {directory}: cannot write {name or 'its files'} ({reason}). Make {directory} "
                    "writable (what it holds is kept: its checkpoints resume) or choose another "
                    f"{elsewhere}, {after}")


def write_failure(error: BaseException, directory: str, what: str, **message) -> SetupError | None:
  """The one-line `SetupError` of a full disk or an unwritable file in `error`'s causes, else None."""
  if (cause := disk_full_cause(error)) is not None:
    return disk_full_error(directory, what, cause=cause, **message)
  if (cause := unwritable_cause(error)) is not None:
    return unwritable_error(directory, what, cause=cause, **message)
  return None


@contextlib.contextmanager
def reporting_write_failures(directory: str, what: str, **message) -> Iterator[None]:
  """Re-raises a full disk, or a file that could not be written, met inside the block as one line
  (`disk_full_error` / `unwritable_error` with `directory`, `what` and `message`)."""
  try:
    yield
  except SetupError:
    raise
  except BaseException as e:
    failure = write_failure(e, directory, what, **message)
    if failure is None:
      raise
    raise failure from None


def remove_quietly(path: str) -> None:
  """Deletes a file if it is there (cleaning up after a failed write must not hide its error)."""
  with contextlib.suppress(OSError):
    os.remove(path)


def write_atomically(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` through `path.tmp-<pid>` and a rename: the file is whole or not there.

  On a failure the temporary file is removed and the error raised (see `reporting_write_failures`).
  """
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      f.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)
  except BaseException:
    remove_quietly(tmp)
    raise
