"""The compilation cache directory (`$JAX_COMPILATION_CACHE_DIR`), owned here: XLA's entries checked, the
directory bounded, and the package's own keyed files in it.

  compile_cache.bound()       # at a run's start: least recently used files out, down to VAPO_JAX_CACHE_MAX_GIB
  compile_cache.install()     # at a run's start, before anything compiles (make train, eval, memory; the tests)
  compile_cache.store_keyed("vapo-memory-", key, {...}); compile_cache.load_keyed("vapo-memory-", key)
  compile_cache.compiler_salt()   # what a keyed file's key holds of the compiler: versions and flags

Keyed files (`<prefix><key>.json`: the start-up verdict's `vapo-memory-`, the TPU compiler's reports'
`vapo-tpu-`) each hold their key, compared at every load: a file whose key differs (another program's, copied
over it), a damaged one or a directory that cannot be read is a miss, and a read-only or full directory
stores nothing; either way it costs a compile, nothing else. A load marks the file as recently used, so that
`bound` deletes it last.

JAX keeps each compiled program in `$JAX_COMPILATION_CACHE_DIR/<key>-cache` and loads it back by the key
alone: an entry that holds another program's executable (a file copied over it) is loaded and run, and a
damaged one (cut short, overwritten) warns at every later run and is never replaced, since JAX does not
overwrite an entry. `install` wraps JAX's cache so that each entry gets a seal beside it, `<key>-seal`: the
sha256 of the key and of the entry's bytes as written. An entry whose seal is missing or does not match is
evicted (the entry, its access time and its seal) and compiled again, the recompiled entry taking its place;
the first eviction of a process prints one line naming the directory and `make clean-cache`. An entry written
before seals existed is compiled again once.

A full disk is said once, in one line, when an entry first fails to be written; nothing more is written. A
directory the process cannot write is found once, here: one line ("... is read-only: compiling without
keeping programs") and the run compiles with the cache off, instead of a two-line `PermissionError` warning
per program.
"""

import errno
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile

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
  import jax
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


def bound(environ=os.environ) -> int:
  """Deletes the least recently used files of the cache directory (XLA's entries and the keyed files) until it
  holds at most `VAPO_JAX_CACHE_MAX_GIB` GiB (both set by the Makefile; nothing happens without them); returns
  the bytes deleted. Run once at the start of a run, not by JAX at every entry it writes: JAX's own bound
  (`jax_compilation_cache_max_size`) lists the whole directory at each write, which made the suite's
  thousands of small programs cost minutes."""
  path, limit = environ.get("JAX_COMPILATION_CACHE_DIR"), environ.get("VAPO_JAX_CACHE_MAX_GIB")
  if not path or not limit or not os.path.isdir(path):
    return 0
  entries = []
  with os.scandir(path) as it:
    for entry in it:
      try:
        if entry.is_file(follow_symlinks=False):
          stat = entry.stat(follow_symlinks=False)
          entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry.path))
      except FileNotFoundError:  # Renamed or removed since the listing (another process writing the cache).
        pass
  excess, deleted = sum(size for _, size, _ in entries) - float(limit) * 2**30, 0
  for _, size, file in sorted(entries):
    if excess - deleted <= 0:
      break
    try:
      os.remove(file)
      deleted += size
    except OSError:  # Another process removed or is reading it: it stays for the next run.
      pass
  return deleted


def compiler_salt(environ=os.environ) -> list[str]:
  """What a compiler's answer depends on besides its program, for the keyed files' keys: the installed jax,
  jaxlib and libtpu ("" when absent) and the flags XLA and libtpu read (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`)."""
  def version(name: str) -> str:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return ""
  return [*(version(name) for name in ("jax", "jaxlib", "libtpu")), environ.get("XLA_FLAGS", ""),
          environ.get("LIBTPU_INIT_ARGS", "")]


def keyed_path(prefix: str, key: str, environ=os.environ) -> str | None:
  """Where the keyed file `<prefix><key>.json` lives (None without a cache directory)."""
  directory = environ.get("JAX_COMPILATION_CACHE_DIR")
  return os.path.join(directory, prefix + key + ".json") if directory else None


def load_keyed(prefix: str, key: str, environ=os.environ) -> dict | None:
  """The keyed file's contents (a dict holding `key`), or None: absent, unreadable, damaged or another key's."""
  if (path := keyed_path(prefix, key, environ)) is None:
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    if not isinstance(data, dict) or data.get("key") != key:
      return None
    os.utime(path)  # Recently used: `bound` deletes the least recently used first.
    return data
  except (OSError, ValueError):
    return None


def store_keyed(prefix: str, key: str, data: dict, environ=os.environ) -> bool:
  """Writes `data` with its key to the keyed file, whole or not at all; False where it could not (no cache
  directory, a read-only or full one)."""
  if (path := keyed_path(prefix, key, environ)) is None:
    return False
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    files.write_atomically(path, json.dumps(data | {"key": key}))
    return True
  except OSError:
    return False


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
      self._say(f"{self._directory} held an entry that does not match its key (damaged, replaced, or written "
                "before entries were sealed): evicted and compiled again; make clean-cache empties the cache")
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
