"""A process pool for untrusted, possibly hanging work (answer verification), with time-outs.

  with VerifierPool(fn="vapo_jax.rewards.equivalence:score_response", workers=8, timeout_s=10) as pool:
    outcomes = pool.map([(response, gold, forms), ...])      # one Outcome per task, in order

Each worker owns a pipe; the parent hands it a chunk of tasks and the worker sends back one
result per task. A task that runs longer than `timeout_s` gets its worker killed (SIGKILL) and
the outcome status "timeout"; a worker that dies (a segfault in a C extension, `os._exit`, the
OOM killer) gives the task it was running the status "crash". In both cases a fresh worker takes
its place and the rest of its chunk is handed out again, so `map` always returns, one outcome
per task, and the pool stays usable. An exception raised by `fn` is the status "error"; so is
running out of a worker's address space (`memory_limit_mb`), which keeps a runaway sympy
computation from invoking the OOM killer on the host.

Workers are forked from a fork server (never from the parent, which runs JAX's threads), which
has already imported `fn`'s module, so replacing a killed worker takes milliseconds.
"""

import collections
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

Status = Literal["ok", "timeout", "crash", "error"]
DEFAULT_FN = "vapo_jax.rewards.equivalence:score_response"
STARTUP_TIMEOUT_S = 120.0  # A new worker's time to import `fn` before its first task counts.


class Outcome(NamedTuple):
  value: Any  # `fn(*task)` when status is "ok"; the error message for "error"; else None.
  status: Status


def load_function(path: str) -> Callable:
  """Imports `"package.module:function"` (or `"package.module.function"`)."""
  module_name, sep, attr = path.partition(":")
  if not sep:
    module_name, _, attr = path.rpartition(".")
  if not module_name or not attr:
    raise ValueError(f"function path {path!r} is not of the form 'package.module:function'")
  try:
    fn = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot load function {path!r}: {e}") from e
  if not callable(fn):
    raise ValueError(f"{path!r} is not callable")
  return fn


def _worker_main(conn: mpc.Connection, fn_path: str, sys_path: list[str], memory_limit_mb: int | None) -> None:
  """Runs chunks of `(task_id, args)` until it receives None; sends `(task_id, status, value)`."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  if memory_limit_mb:  # A sympy blow-up raises MemoryError here instead of waking the OOM killer.
    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  sys.path[:] = sys_path
  fn = load_function(fn_path)
  conn.send((-1, "ready", None))
  while (chunk := conn.recv()) is not None:
    for task_id, args in chunk:
      try:
        message = (task_id, "ok", fn(*args))
      except Exception as e:  # The task's failure, reported; the worker carries on.
        message = (task_id, "error", f"{type(e).__name__}: {e}")
      try:
        conn.send(message)
      except Exception as e:  # An unpicklable result.
        conn.send((task_id, "error", f"result not picklable: {type(e).__name__}: {e}"))


class _Worker:
  """One process, its pipe, and the task ids it was handed and has not answered yet."""

  def __init__(self, ctx, fn_path: str, memory_limit_mb: int | None):
    self.conn, child = ctx.Pipe(duplex=True)
    self.process = ctx.Process(target=_worker_main, args=(child, fn_path, list(sys.path), memory_limit_mb),
                               daemon=True)
    self.process.start()
    child.close()
    self.pending: collections.deque[int] = collections.deque()
    self.ready = False  # Set by the worker's first message, once `fn` is imported.
    self.deadline = math.inf

  def stop(self, *, kill: bool) -> None:
    if kill:
      self.process.kill()
    else:
      try:
        self.conn.send(None)
      except OSError:
        pass
    self.process.join(timeout=5)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()
    self.conn.close()


class VerifierPool:
  """`workers` processes running `fn` on tasks with a per-task time limit (see the module doc)."""

  def __init__(self, *, fn: str = DEFAULT_FN, workers: int = 0, timeout_s: float = 10.0,
               chunk_size: int = 32, memory_limit_mb: int | None = 4096):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    load_function(fn)  # Fail here, in the parent, on a bad path.
    self.fn, self.timeout_s, self.chunk_size = fn, timeout_s, max(1, chunk_size)
    self.memory_limit_mb = memory_limit_mb
    self.num_workers = workers if workers > 0 else os.cpu_count() or 1
    self._ctx = mp.get_context("forkserver")
    # The fork server imports sympy and math-verify once; this only takes effect if the server
    # is not running yet. Other functions' modules are imported by each worker.
    self._ctx.set_forkserver_preload([DEFAULT_FN.partition(":")[0]])
    self._workers = [self._new_worker() for _ in range(self.num_workers)]
    self.totals = collections.Counter()  # Outcome statuses over the pool's life.

  def __enter__(self) -> "VerifierPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    for worker in self._workers:
      worker.stop(kill=bool(worker.pending))
    self._workers = []

  def _new_worker(self) -> _Worker:
    return _Worker(self._ctx, self.fn, self.memory_limit_mb)

  def _replace(self, index: int) -> None:
    self._workers[index].stop(kill=True)
    self._workers[index] = self._new_worker()

  def map(self, tasks: Sequence[tuple]) -> list[Outcome]:
    """`fn(*task)` for every task, in order; never raises for a task's failure or hang."""
    if not self._workers:
      raise RuntimeError("the pool is closed")
    results: list[Outcome | None] = [None] * len(tasks)
    queue = collections.deque(range(len(tasks)))
    remaining = len(tasks)
    while remaining:
      self._dispatch(tasks, queue)
      busy = [w for w in self._workers if w.pending]
      if not busy:  # Every hand-out failed (workers died idle and were replaced): try again.
        continue
      wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
      ready = set(mpc.wait([w.conn for w in busy] + [w.process.sentinel for w in busy], wait_s))
      for i, worker in enumerate(list(self._workers)):
        if not worker.pending:
          continue
        if worker.conn in ready or worker.process.sentinel in ready:
          remaining -= self._receive(i, results, queue)
        elif time.monotonic() >= worker.deadline:
          remaining -= self._fail_head(i, "timeout", results, queue)
    return results

  def _dispatch(self, tasks: Sequence[tuple], queue: collections.deque) -> None:
    for i, worker in enumerate(self._workers):
      if worker.pending or not queue:
        continue
      size = min(self.chunk_size, max(1, len(queue) // (2 * self.num_workers)))
      ids = [queue.popleft() for _ in range(min(size, len(queue)))]
      try:
        worker.conn.send([(task_id, tasks[task_id]) for task_id in ids])
      except OSError:  # The worker died while idle: replace it and hand the chunk out again.
        queue.extendleft(reversed(ids))
        self._replace(i)
        continue
      worker.pending.extend(ids)
      worker.deadline = time.monotonic() + (self.timeout_s if worker.ready else STARTUP_TIMEOUT_S)

  def _receive(self, index: int, results: list, queue: collections.deque) -> int:
    """Reads every result the worker has sent; on its death fails the task it was running."""
    worker, done = self._workers[index], 0
    try:
      while worker.pending and worker.conn.poll():
        task_id, status, value = worker.conn.recv()
        worker.deadline = time.monotonic() + self.timeout_s
        if status == "ready":
          worker.ready = True
          continue
        assert task_id == worker.pending[0], (task_id, worker.pending[0])  # Tasks run in order.
        worker.pending.popleft()
        results[task_id] = Outcome(value, status)
        self.totals[status] += 1
        done += 1
    except (EOFError, OSError):  # The pipe closed: the worker is dead or dying.
      return done + self._fail_head(index, "crash", results, queue)
    if worker.pending and not worker.process.is_alive():
      done += self._fail_head(index, "crash", results, queue)
    return done

  def _fail_head(self, index: int, status: Status, results: list, queue: collections.deque) -> int:
    worker = self._workers[index]
    if not worker.ready:  # Not a task's fault: the worker could not start at all.
      worker.stop(kill=True)
      raise RuntimeError(
          f"a verifier worker for {self.fn!r} failed to start ({status}, exit code "
          f"{worker.process.exitcode}); its traceback is above. Workers import the main module "
          "again: guard a script's entry point with `if __name__ == '__main__':`.")
    task_id = worker.pending.popleft()
    results[task_id] = Outcome(None, status)
    self.totals[status] += 1
    queue.extendleft(reversed(worker.pending))
    worker.pending.clear()
    self._replace(index)
    return 1
