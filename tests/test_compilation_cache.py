"""The cache directory's owner (`compile_cache`): `bound` deletes the least recently used files first, down to
the bound, and nothing without both variables; a keyed file is read back only under its own key (a mismatched
key, a damaged file, an unreadable or read-only directory: a miss, never an error); XLA's entries are sealed."""

import contextlib
import os

import pytest

from vapo_jax import compile_cache

MIB = 2**20


def _cache(tmp_path, sizes_mib):
  for i, size in enumerate(sizes_mib):  # File i was last used at time 1000 + i.
    path = tmp_path / f"entry{i}-cache"
    path.write_bytes(b"x" * int(size * MIB))
    os.utime(path, (1000 + i, 1000 + i))
  return sorted(p.name for p in tmp_path.iterdir())


def test_the_least_recently_used_files_go_down_to_the_bound(tmp_path):
  _cache(tmp_path, [1, 1, 1, 1])
  environ = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path), "VAPO_JAX_CACHE_MAX_GIB": str(2.5 * MIB / 2**30)}
  assert compile_cache.bound(environ) == 2 * MIB
  assert sorted(p.name for p in tmp_path.iterdir()) == ["entry2-cache", "entry3-cache"]
  assert compile_cache.bound(environ) == 0  # Within the bound: nothing more goes.


def test_a_file_renamed_by_another_process_while_bound_lists_them_is_passed_over(tmp_path, monkeypatch):
  """Another process writing the cache (a test process, a sweep's run) renames its temporary file between the
  listing and the file's stat: that file is passed over, the rest bounded, and the run starts."""
  _cache(tmp_path, [1, 1, 1, 1])
  (tmp_path / "entry9-seal.tmp-1").write_bytes(b"x")
  scandir = os.scandir

  def renamed_after_listing(path):
    entries = list(scandir(path))
    (tmp_path / "entry9-seal.tmp-1").rename(tmp_path / "entry9-seal")
    return contextlib.nullcontext(entries)
  monkeypatch.setattr(compile_cache.os, "scandir", renamed_after_listing)
  environ = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path), "VAPO_JAX_CACHE_MAX_GIB": str(2.5 * MIB / 2**30)}
  assert compile_cache.bound(environ) == 2 * MIB
  assert sorted(p.name for p in tmp_path.iterdir()) == ["entry2-cache", "entry3-cache", "entry9-seal"]


def test_nothing_happens_without_both_variables_or_a_directory(tmp_path):
  files = _cache(tmp_path, [1, 1])
  tiny = str(1 / 2**30)
  for environ in ({"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}, {"VAPO_JAX_CACHE_MAX_GIB": tiny},
                  {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "absent"), "VAPO_JAX_CACHE_MAX_GIB": tiny}):
    assert compile_cache.bound(environ) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_a_keyed_file_is_read_back_only_under_its_own_key(tmp_path):
  environ = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
  assert compile_cache.store_keyed("vapo-x-", "k1", {"table": "t"}, environ)
  assert compile_cache.load_keyed("vapo-x-", "k1", environ) == {"table": "t", "key": "k1"}
  path = compile_cache.keyed_path("vapo-x-", "k1", environ)
  os.replace(path, compile_cache.keyed_path("vapo-x-", "k2", environ))  # Another key's file under this name.
  assert compile_cache.load_keyed("vapo-x-", "k2", environ) is None
  with open(compile_cache.keyed_path("vapo-x-", "k2", environ), "w") as f:
    f.write('{"key": "k2", "tab')  # Damaged: cut short.
  assert compile_cache.load_keyed("vapo-x-", "k2", environ) is None
  assert compile_cache.load_keyed("vapo-x-", "k3", environ) is None  # Absent.
  assert compile_cache.load_keyed("vapo-x-", "k1", {}) is None  # No cache directory.
  assert not compile_cache.store_keyed("vapo-x-", "k1", {}, {})


def test_a_read_only_directory_stores_no_keyed_file_and_raises_nothing():
  environ = {"JAX_COMPILATION_CACHE_DIR": "/proc/self"}  # Read-only for root too (the tests may run as root).
  assert not compile_cache.store_keyed("vapo-x-", "k1", {"table": "t"}, environ)
  assert compile_cache.load_keyed("vapo-x-", "k1", environ) is None


def test_a_sealed_entry_that_does_not_match_its_key_is_evicted_and_replaced(tmp_path):
  """`compile_cache.SealedCache` over JAX's file cache: an entry is read back while its seal matches; another
  entry's bytes copied over it, or the entry cut short, make a miss that evicts the entry (and says so once);
  the entry written next takes its place."""
  import shutil

  from jax._src.lru_cache import LRUCache

  from vapo_jax.compile_cache import SEAL_SUFFIX, SealedCache

  said = []
  cache = SealedCache(LRUCache(str(tmp_path), max_size=-1), str(tmp_path), said.append)
  cache.put("f", b"program f")
  cache.put("g", b"program g")
  assert cache.get("f") == b"program f" and cache.get("g") == b"program g" and cache.get("h") is None
  shutil.copyfile(tmp_path / "f-cache", tmp_path / "g-cache")  # g's entry now holds f's program.
  assert cache.get("g") is None and not (tmp_path / "g-cache").exists() and not (tmp_path / f"g{SEAL_SUFFIX}").exists()
  assert len(said) == 1 and "make clean-cache" in said[0]
  cache.put("g", b"program g")  # The recompiled entry replaces it (JAX's cache never overwrites one).
  assert cache.get("g") == b"program g"
  (tmp_path / "f-cache").write_bytes(b"progr")  # Cut short.
  assert cache.get("f") is None and len(said) == 1  # Said once a process.
  (tmp_path / "u-cache").write_bytes(b"unsealed")  # Written before seals (or by another JAX): compiled again.
  assert cache.get("u") is None


def _run(script: str, cache_dir, tmp_path):
  import subprocess
  import sys

  environ = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu",
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, cwd=tmp_path,
                        timeout=300)


PROGRAMS = """
import jax, jax.numpy as jnp
from vapo_jax import compile_cache
print(compile_cache.install())
f = jax.jit(lambda x: x * 2.0 + 1.0)
g = jax.jit(lambda x: jnp.sin(x) - x ** 3)
print(float(f(jnp.float32(3.0))), float(g(jnp.float32(3.0))))
"""


@pytest.mark.slow  # For time (7 s): make test says an unwritable cache once.
def test_another_programs_entry_is_compiled_again_with_one_line(tmp_path):
  """A process whose cache entry holds another program's executable (copied over it) computes the right numbers,
  says so in one line naming `make clean-cache`, and the next process loads the replaced entry silently."""
  cache = tmp_path / "cache"
  first = _run(PROGRAMS, cache, tmp_path)
  assert first.returncode == 0, first.stderr
  entries = sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))
  assert len(entries) >= 2 and all((cache / (p.name[:-6] + "-seal")).exists() for p in entries)
  for entry in entries[1:]:  # Every entry but one now holds the first one's executable.
    entry.write_bytes(entries[0].read_bytes())
  swapped = _run(PROGRAMS, cache, tmp_path)
  assert swapped.returncode == 0 and swapped.stdout == first.stdout, swapped.stderr
  assert swapped.stderr.count("make clean-cache") == 1 and "Traceback" not in swapped.stderr
  again = _run(PROGRAMS, cache, tmp_path)
  assert again.stdout == first.stdout and "make clean-cache" not in again.stderr, again.stderr


def test_an_unwritable_cache_is_said_once_and_compiles_without_keeping(tmp_path):
  """A cache path this process cannot write (here a file where the directory should be): one line at the start,
  no warning per program, the same numbers."""
  blocked = tmp_path / "cache"
  blocked.write_text("not a directory")
  result = _run(PROGRAMS, blocked, tmp_path)
  assert result.returncode == 0 and result.stdout.splitlines()[0] == "read-only", result.stderr
  assert result.stderr.count("compiling without keeping programs") == 1
  assert "PermissionError" not in result.stderr and "Error writing" not in result.stderr


def test_a_full_disk_is_said_once_and_nothing_more_is_written(tmp_path):
  """JAX's cache raising ENOSPC at a write (a full disk): one line, once; later programs are not written."""
  import errno

  from vapo_jax.compile_cache import SealedCache

  class FullDisk:
    writes = 0

    def put(self, key, value):
      FullDisk.writes += 1
      raise OSError(errno.ENOSPC, "No space left on device")

  said = []
  cache = SealedCache(FullDisk(), str(tmp_path), said.append)
  for key in ("f", "g", "h"):
    cache.put(key, b"program")
  assert FullDisk.writes == 1 and len(said) == 1 and "is on a full disk: compiling without keeping" in said[0]
  with pytest.raises(OSError, match="Permission"):  # Anything else is not a full disk: JAX reports it as it does.
    SealedCache(type("Denied", (), {"put": lambda self, k, v: (_ for _ in ()).throw(PermissionError(
        errno.EACCES, "Permission denied"))})(), str(tmp_path), said.append).put("k", b"v")
