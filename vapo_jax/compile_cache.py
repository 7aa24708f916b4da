"""XLA's persistent compilation cache, checked: every entry bound to its key, a read-only directory said once.

  compile_cache.install()     # at a run's start, before anything compiles (make train, eval, memory; the tests)

JAX keeps each compiled program in `$JAX_COMPILATION_CACHE_DIR/<key>-cache` and loads it back by the key alone:
an entry that holds another program's executable (a file copied over it) is loaded and run, and a damaged one
(cut short, overwritten) warns at every later run and is never replaced, since JAX does not overwrite an entry.
`install` wraps JAX's cache so that each entry gets a seal beside it, `<key>-seal`: the sha256 of the key and
of the entry's bytes as written. An entry whose seal is missing or does not match is evicted (the entry, its
access time and its seal) and compiled again, the recompiled entry taking its place; the first eviction of a
process prints one line naming the directory and `make clean-cache`. An entry written before seals existed
is compiled again once.

A full disk is said once, in one line, when an entry first fails to be written; nothing more is written. A
directory the process cannot write is found once, here: one line ("... is read-only: compiling without
keeping programs") and the run compiles with the cache off, instead of a two-line `PermissionError` warning
per program.
"""

import errno
import hashlib
import os
import sys
import tempfile

import jax

from vapo_jax import files

SEAL_SUFFIX = "-seal"


def _say(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def writable(directory: str) -> bool:
  """Whether this process can create (and remove) a file in `directory`, creating the directory if needed."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".vapo-probe-"):
      pass
    return True
  except OSError:
    return False


def install(environ=os.environ, *, say=_say) -> str:
  """Checks and wraps JAX's persistent compilation cache (module docstring), once per process; returns what it
  did: "off" (no cache directory), "read-only" (the cache turned off) or "sealed"."""
  from jax._src import compilation_cache

  directory = environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
  if not directory:
    return "off"
  if not writable(directory):
    say(f"{directory} is read-only: compiling without keeping programs (make clean-cache, or a writable "
        "JAX_COMPILATION_CACHE_DIR, keeps them)")
    jax.config.update("jax_enable_compilation_cache", False)
    return "read-only"
  jax.config.update("jax_compilation_cache_dir", directory)
  if compilation_cache._cache is None:
    compilation_cache._initialize_cache()
  if compilation_cache._cache is not None and not isinstance(compilation_cache._cache, SealedCache):
    compilation_cache._cache = SealedCache(compilation_cache._cache, directory, say)
  return "sealed"


class SealedCache:
  """JAX's cache interface (`get`, `put`, `clear`) over its file cache, each entry checked against its seal."""

  def __init__(self, base, directory: str, say=_say):
    self._base, self._directory, self._say, self._said, self._full = base, directory, say, False, False

  @property
  def _path(self):
    return self._base._path

  def _seal_path(self, key: str) -> str:
    return os.path.join(self._directory, key + SEAL_SUFFIX)

  @staticmethod
  def seal(key: str, value: bytes) -> str:
    return hashlib.sha256(key.encode() + b"\0" + value).hexdigest()

  def get(self, key: str) -> bytes | None:
    value = self._base.get(key)
    if value is None:
      return None
    try:
      with open(self._seal_path(key), encoding="ascii") as f:
        sealed = f.read().strip()
    except OSError:
      sealed = None
    if sealed == self.seal(key, value):
      return value
    self.evict(key)
    if not self._said:
      self._said = True
      self._say(f"{self._directory} held an entry that does not match its key (damaged, replaced, or written before "
                "entries were sealed): evicted and compiled again; make clean-cache empties the cache")
    return None

  def put(self, key: str, value: bytes) -> None:
    if self._full:
      return
    try:
      self._base.put(key, value)
    except OSError as e:  # JAX would warn in two lines for every program: one line, once, and no more writes.
      if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise
      self._full = True
      self._say(f"{self._directory} is on a full disk: compiling without keeping programs (free space there, "
                "make clean-cache, or a JAX_COMPILATION_CACHE_DIR with room keeps them)")
      return
    try:  # Seal what is on disk: another process may have written the entry first.
      with open(os.path.join(self._directory, key + "-cache"), "rb") as f:
        files.write_atomically(self._seal_path(key), self.seal(key, f.read()))
    except OSError:  # Not written (too large, a full disk): an entry without a seal is compiled again.
      pass

  def evict(self, key: str) -> None:
    for suffix in ("-cache", "-atime", SEAL_SUFFIX):
      try:
        os.remove(os.path.join(self._directory, key + suffix))
      except OSError:
        pass

  def clear(self) -> None:
    self._base.clear()
