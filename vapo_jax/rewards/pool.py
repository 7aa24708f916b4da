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
has already imported the built-in verifier's module, so replacing a killed worker takes
milliseconds. The fork server and its workers ignore SIGTERM and SIGINT (see `_forkserver_init`):
a scheduler signals the whole process group, and stopping is the trainer's business; a fork
server that died anyway is started again. Workers exit when the parent closes their pipes or dies.

`fn` is imported only in the workers, never in the parent: the pool's constructor waits until
every worker has imported it, at most `import_timeout_s`, and raises `RewardFunctionError` with
the import's error (or its time-out), naming the module.
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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from vapo_jax.errors import RewardFunctionError

Status = Literal["ok", "timeout", "crash", "error"]
DEFAULT_FN = "vapo_jax.rewards.equivalence:score_response"
STARTUP_TIMEOUT_S = 120.0  # A replacement worker's time to import `fn` before its first task counts.
IMPORT_TIMEOUT_S = 60.0  # Default limit on importing `fn`'s module when the pool starts.
# Imported by the fork server; math_verify too (the default function imports it at its first answer): every
# worker forked from it starts with it loaded.
_PRELOAD = ["vapo_jax.rewards._forkserver_init", DEFAULT_FN.partition(":")[0], "math_verify"]
_START_ATTEMPTS, _START_RETRY_S = 50, 0.1  # Starting a worker while a dead fork server is replaced.


class Outcome(NamedTuple):
  value: Any  # `fn(*task)` when status is "ok"; else a message saying what went wrong.
  status: Status


def parse_function_path(path: str) -> tuple[str, str]:
  """`(module, attribute)` of `"package.module:function"` (or `"package.module.function"`)."""
  module_name, sep, attr = path.partition(":")
  if not sep:
    module_name, _, attr = path.rpartition(".")
  if not module_name or not attr:
    raise RewardFunctionError(f"reward function path {path!r} is not of the form 'package.module:function'")
  return module_name, attr


def load_function(path: str) -> Callable:
  """Imports `"package.module:function"`; any failure is a `RewardFunctionError` naming the module."""
  module_name, attr = parse_function_path(path)
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # ImportError, or whatever the module raises while it runs.
    raise RewardFunctionError(
        f"cannot load function {path!r}: importing module {module_name!r} failed with {type(e).__name__}: "
        f"{e} (the module must be importable from the working directory or PYTHONPATH)") from None
  fn = getattr(module, attr, None)
  if fn is None:
    raise RewardFunctionError(f"cannot load function {path!r}: module {module_name!r} has no attribute "
                              f"{attr!r}")
  if not callable(fn):
    raise RewardFunctionError(f"cannot load function {path!r}: {attr!r} is a {type(fn).__name__}, not a "
                              "function")
  return fn


def _exit_when_closed(alive: mpc.Connection) -> None:
  """Ends the worker once the parent closes (or, dying, drops) its end of `alive`, even mid-task."""
  alive.poll(None)
  os._exit(0)


def _worker_main(conn: mpc.Connection, alive: mpc.Connection, fn_path: str, sys_path: list[str],
                 memory_limit_mb: int | None) -> None:
  """Imports `fn`, then runs chunks of `(task_id, args)` until it receives None; sends
  `(task_id, status, value)` per task, after `(-1, "ready", None)` or `(-1, "failed", message)`."""
  for signum in (signal.SIGTERM, signal.SIGINT):  # Stopping is the parent's to handle.
    signal.signal(signum, signal.SIG_IGN)
  threading.Thread(target=_exit_when_closed, args=(alive,), daemon=True).start()
  if memory_limit_mb:  # A sympy blow-up raises MemoryError here instead of waking the OOM killer.
    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  sys.path[:] = sys_path
  try:
    fn = load_function(fn_path)
  except RewardFunctionError as e:
    conn.send((-1, "failed", str(e)))
    return
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


def _death(exitcode: int | None) -> str:
  if exitcode is not None and exitcode < 0:
    try:
      return f"the verifier process was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
      pass
  return f"the verifier process died (exit code {exitcode})"


class _Worker:
  """One process, its pipes, and the task ids it was handed and has not answered yet."""

  def __init__(self, ctx, fn_path: str, memory_limit_mb: int | None):
    self.conn, child = ctx.Pipe(duplex=True)
    alive_child, self.alive = ctx.Pipe(duplex=False)  # Closed by the parent: the worker exits.
    self.process = ctx.Process(target=_worker_main, daemon=True,
                               args=(child, alive_child, fn_path, list(sys.path), memory_limit_mb))
    try:
      self.process.start()
    except BaseException:
      self.conn.close()
      self.alive.close()
      raise
    finally:
      child.close()
      alive_child.close()
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
    self.alive.close()
    self.process.join(timeout=5)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()
    self.conn.close()


class VerifierPool:
  """`workers` processes running `fn` on tasks with a per-task time limit (see the module doc)."""

  def __init__(self, *, fn: str = DEFAULT_FN, workers: int = 0, timeout_s: float = 10.0,
               chunk_size: int = 32, memory_limit_mb: int | None = 4096,
               import_timeout_s: float = IMPORT_TIMEOUT_S):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    parse_function_path(fn)  # Fail here, in the parent, on a malformed path (the import is the workers').
    self.fn, self.timeout_s, self.chunk_size = fn, timeout_s, max(1, chunk_size)
    self.memory_limit_mb = memory_limit_mb
    self.num_workers = workers if workers > 0 else os.cpu_count() or 1
    self._ctx = mp.get_context("forkserver")
    # Takes effect only if the fork server is not running yet: it then ignores SIGTERM and SIGINT
    # and imports sympy and math-verify once. Other functions' modules are imported by each worker.
    self._ctx.set_forkserver_preload(_PRELOAD)
    self._workers: list[_Worker] = []
    self.totals = collections.Counter()  # Outcome statuses over the pool's life.
    self.failure_reported = False  # Set by `reward.check_errors` once it has shown a user function's error.
    try:
      self._workers = [self._new_worker() for _ in range(self.num_workers)]
      self._await_ready(import_timeout_s)
    except BaseException:
      self.close()
      raise

  def __enter__(self) -> "VerifierPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    for worker in self._workers:
      worker.stop(kill=bool(worker.pending) or not worker.ready)
    self._workers = []

  def _await_ready(self, limit_s: float) -> None:
    """Waits until every worker has imported `fn`; an import that fails or hangs is an error."""
    module = parse_function_path(self.fn)[0]
    deadline, waiting = time.monotonic() + limit_s, list(self._workers)
    while waiting:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise RewardFunctionError(
            f"importing module {module!r} (reward function {self.fn!r}) did not finish within {limit_s:g} s "
            f"in {len(waiting)} of {len(self._workers)} verifier workers: does the module block at import "
            "(waiting for input, a lock, the network)? Import such work lazily inside the function.")
      ready = set(mpc.wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting], remaining))
      for worker in list(waiting):
        if worker.conn in ready:
          try:
            _, status, value = worker.conn.recv()
          except (EOFError, OSError):
            status, value = "died", None
          if status == "failed":
            raise RewardFunctionError(value)
          if status != "ready":
            raise RewardFunctionError(f"{_death(worker.process.exitcode)} while importing module {module!r} "
                                      f"(reward function {self.fn!r}); its traceback, if any, is above")
          worker.ready = True
          waiting.remove(worker)
        elif worker.process.sentinel in ready:
          worker.process.join(timeout=1)
          raise RewardFunctionError(f"{_death(worker.process.exitcode)} while importing module {module!r} "
                                    f"(reward function {self.fn!r}); its traceback, if any, is above")

  def _new_worker(self) -> _Worker:
    """A started worker; retried while a dead fork server is noticed and started again."""
    for _ in range(_START_ATTEMPTS):
      try:
        return _Worker(self._ctx, self.fn, self.memory_limit_mb)
      except (EOFError, OSError) as e:  # The fork server died (SIGKILL, or it was signalled while starting).
        error = e
        time.sleep(_START_RETRY_S)
    raise RuntimeError(f"cannot start a verifier worker: the fork server failed {_START_ATTEMPTS} times "
                       f"({type(error).__name__}: {error})")

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
      if not worker.process.is_alive():  # Died while idle (killed, or its fork server was): no task's fault.
        self._replace(i)
        worker = self._workers[i]
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
        if status == "failed":  # A replacement worker could not import `fn` any more.
          worker.stop(kill=True)
          raise RewardFunctionError(value)
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
      why = (f"did not import it within {STARTUP_TIMEOUT_S:g} s" if status == "timeout" else
             _death(worker.process.exitcode) + " before importing it")
      worker.stop(kill=True)
      raise RewardFunctionError(
          f"a verifier worker for {self.fn!r} failed to start ({why}); its traceback, if any, is above. "
          "Workers import the main module again: guard a script's entry point with `if __name__ == "
          "'__main__':`.")
    if status == "crash":
      worker.process.join(timeout=1)
      message = _death(worker.process.exitcode)
    else:
      message = f"timed out after {self.timeout_s:g} s"
    task_id = worker.pending.popleft()
    results[task_id] = Outcome(message, status)
    self.totals[status] += 1
    queue.extendleft(reversed(worker.pending))
    worker.pending.clear()
    self._replace(index)
    return 1
