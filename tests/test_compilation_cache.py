"""`bound_compilation_cache`: the least recently used files go first, down to the bound, and nothing
happens without both variables."""

import os

from vapo_jax.cli import bound_compilation_cache

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
  assert bound_compilation_cache(environ) == 2 * MIB
  assert sorted(p.name for p in tmp_path.iterdir()) == ["entry2-cache", "entry3-cache"]
  assert bound_compilation_cache(environ) == 0  # Within the bound: nothing more goes.


def test_nothing_happens_without_both_variables_or_a_directory(tmp_path):
  files = _cache(tmp_path, [1, 1])
  tiny = str(1 / 2**30)
  for environ in ({"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}, {"VAPO_JAX_CACHE_MAX_GIB": tiny},
                  {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "absent"), "VAPO_JAX_CACHE_MAX_GIB": tiny}):
    assert bound_compilation_cache(environ) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == files
