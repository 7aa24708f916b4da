"""One run per run directory: an exclusive lock taken at start and released on any exit.

  with RunLock("runs/aime_vapo"):         # RunLockError if another process holds it
    ...                                    # train; the lock is released however this block ends

The lock is `fcntl.flock` on `<run_dir>/run.lock`, which records the holder (pid, host, start time,
command) for the message a second start gets. The kernel drops a flock when its process dies,
even by SIGKILL, so a crash leaves no lock behind; it may leave the file, which the next start takes
over and says so. A clean release deletes the file (and the run directory, when the lock created it
and nothing else was written there). Multi-host runs: take it on the main process only.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import warnings

from vapo_jax.errors import SetupError

LOCK_FILE = "run.lock"


class RunLockError(SetupError):
  """Another process holds the run directory: a user error (exit status 2, USER_ERROR_EXIT_CODE)."""


class RunLock:
  """The exclusive lock on `run_dir`: `acquire()` / `release()`, or a `with` block."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, LOCK_FILE)
    self.took_over: dict | None = None  # The holder record a dead process left, when taken over.
    self._fd: int | None = None
    self._made_dir = False

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> "RunLock":
    if self._fd is not None:
      raise RuntimeError(f"{self.path} is already held by this RunLock")
    self._made_dir = not os.path.isdir(self.run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunLockError(busy_message(self.run_dir, self.path, holder)) from None
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
          raise
        warnings.warn(f"cannot lock {self.path} ({e.strerror}: a file system without flock?): running "
                      "without protection against a second start in the same run directory", stacklevel=2)
        self._remove_dir_if_unused()
        return self
      if _same_file(fd, self.path):
        break
      os.close(fd)  # Its holder released (and deleted) it after we opened it: lock the new file.
    left = _read(fd)
    if left is not None:
      self.took_over = left
      warnings.warn(f"{self.path}: took over the lock left by {describe(left)}, which no longer holds it (it "
                    "crashed or was killed without releasing it)", stacklevel=2)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    """Deletes the lock file, then unlocks; idempotent."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    except OSError:  # The directory turned read-only: the file stays, emptied if it can be (no holder recorded).
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    finally:
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
    self._remove_dir_if_unused()

  def _remove_dir_if_unused(self) -> None:
    if self._made_dir:  # A start that failed before writing anything leaves no empty run directory.
      try:
        os.rmdir(self.run_dir)
      except OSError:
        pass

  def __enter__(self) -> "RunLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def holder(run_dir: str) -> dict | None:
  """Who holds `run_dir`'s lock now (its record; {} when it has recorded nothing yet), or None when it is free."""
  path = os.path.join(run_dir, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError:
    return _read(fd) or {}
  else:
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  finally:
    os.close(fd)


def describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (since {holder.get('since', '?')}; "
          f"command: {holder.get('command', '?')})")


def busy_message(run_dir: str, path: str, holder: dict | None) -> str:
  who = describe(holder) if holder else "a process that has not yet recorded itself"
  message = (f"{run_dir} is in use by another run: {who} holds {path}. Wait for it to finish or stop it, or "
             "start this one with another name= or run_dir=.")
  if holder and holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
    message += (f" Its pid {holder.get('pid')} is gone, so a process it started holds the lock file open: "
                f"`fuser -v {path}` names it.")
  return message


def _read(fd: int) -> dict | None:
  """The record in a lock file: None when empty; unparsable content is reported as is."""
  text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
  if not text:
    return None
  try:
    record = json.loads(text)
    return record if isinstance(record, dict) else {"command": text}
  except ValueError:
    return {"command": f"unreadable record {text[:80]!r}"}


def _same_file(fd: int, path: str) -> bool:
  try:
    now = os.stat(path)
  except FileNotFoundError:
    return False
  opened = os.fstat(fd)
  return (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)


def _alive(pid) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
