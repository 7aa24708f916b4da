"""Orbax's background saves, as the run's checkpoints (`checkpoints.RunCheckpoints`) live with them: the noise
they print beside a failed save's one-line error silenced, the directory probed, and the waits after a failure
bounded.

  probe(directory)            a small file written and removed: an unwritable directory fails here
  quiet_noise()               once a process: tensorstore's writes into a closed event loop, coroutines never awaited
  quiet_after_failure()       after a failed save: Orbax's threads', log records' and asyncio's leftover reports
  wait_at_most(manager, s)    `wait_until_finished`, given up after s seconds
  join(timeout_s)             Orbax's background threads let end, at most timeout_s in all
  background_left()           whether Orbax's threads outlive a failed save (the process then ends without them)
"""

import contextlib
import logging
import os
import sys
import threading
import time
import warnings

from vapo_jax import files


class NoDiskFullTracebacks(logging.Filter):
  """Orbax logs a background save's error, with its traceback, before raising it again where the run waits for
  the save; a full disk is then reported once, in one line (`checkpoints.RunCheckpoints._saving`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    texts = files.DISK_FULL_TEXTS + files.UNWRITABLE_TEXTS
    return not (files.disk_full_cause(error) or files.unwritable_cause(error)
                or any(t in record.getMessage() for t in texts))


def _is_closed_loop(value) -> bool:
  return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def quiet_noise() -> None:
  """Orbax's background writes print noise of no use beside a failed save's one-line error: tensorstore's
  writes completing into an event loop Orbax has closed ("Event loop is closed", one traceback a write), and
  coroutines never awaited. Installed once per process; `quiet_after_failure` adds the rest."""
  if getattr(sys.excepthook, "vapo_quiet", False):
    return
  previous_hook, previous_unraisable = sys.excepthook, sys.unraisablehook

  def quiet(kind, value, traceback):
    if not _is_closed_loop(value):
      previous_hook(kind, value, traceback)
  quiet.vapo_quiet = True

  def quiet_unraisable(unraisable):
    if not (_is_closed_loop(unraisable.exc_value) or "was never awaited" in str(unraisable.exc_value)):
      previous_unraisable(unraisable)
  sys.excepthook, sys.unraisablehook = quiet, quiet_unraisable


def quiet_after_failure() -> None:
  """After a failed save: Orbax's threads' exceptions, its log records and un-awaited coroutine warnings are
  not printed either (the one-line error says what happened; the complete checkpoints stay)."""
  previous_thread = threading.excepthook

  def quiet_thread(args):
    if not (args.thread is not None and type(args.thread).__module__.startswith(("orbax", "concurrent"))):
      previous_thread(args)
  threading.excepthook = quiet_thread
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
  logging.getLogger("absl").addFilter(lambda record: "orbax" not in record.pathname)
  # The background writes' futures, collected with their errors never read: asyncio's "Future exception was
  # never retrieved" / "_GatheringFuture exception was never retrieved", one traceback each.
  logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())


def probe(directory: str) -> None:
  """Writes and removes a small file in `directory`: an unwritable directory fails here, before a background
  save would start writing into it."""
  path = os.path.join(directory, f".write_probe.{os.getpid()}")
  with open(path, "wb") as f:
    f.write(b"\0")
  os.remove(path)


WAIT_AFTER_FAILURE_S = 5.0  # After a failed save: how long its other background writes may take to end.


def wait_at_most(manager, timeout_s: float) -> None:
  """`manager.wait_until_finished()`, given up after `timeout_s` (its error, if any, ignored): after a failed
  save, a background write stuck on the directory runs into Orbax's time-outs of minutes."""
  waiter = threading.Thread(target=_quietly, args=(manager,), daemon=True, name="vapo-checkpoint-wait")
  waiter.start()
  waiter.join(timeout_s)


def _quietly(manager) -> None:
  with contextlib.suppress(Exception):
    manager.wait_until_finished()


def background_left() -> bool:
  """Whether Orbax's background threads outlive a failed save (waiting on signals that never come, for
  minutes): the process then ends without waiting for them, once its error is said."""
  return any(type(t).__module__.startswith("orbax") and t.is_alive() and not t.daemon for t in threading.enumerate())


def join(timeout_s: float = 10.0) -> None:
  """Lets Orbax's background threads end after a failed save (its wait returns at the first error,
  while the other parts of the checkpoint are still being written), at most `timeout_s` in all: a thread
  stuck on the failed directory is not waited for (its time-outs run to minutes)."""
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax"):
      threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
