"""Hub models (`models/hub.py`): `hf:NAME[@REVISION]` read from a Hub cache built on disk (no network: the cache's
own layout, `models--OWNER--NAME/{refs,snapshots}`, with `HF_HUB_OFFLINE`), loaded as the directory it holds; and
every failure one `CheckpointError` line naming the repository and what to do. On several processes the first
downloads and the others read its cache after it (the workers are this file run as a script,
`python tests/test_hub.py worker OUT_DIR CACHE SOURCE`, started by `multiprocess_launch.launch`)."""

import errno
import json
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import pytest
from flax import nnx
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors

from model_utils import FIXTURES
from multiprocess_launch import launch
from vapo_jax.data import tokenizer as tok_lib
from vapo_jax.errors import CheckpointError, MissingFileError
from vapo_jax.models import hub, huggingface
from vapo_jax.models.config import TransformerConfig
from vapo_jax.train import checkpoints

TOKENIZER = pathlib.Path(__file__).parents[1] / "data" / "qwen2.5_tokenizer"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache: pathlib.Path, repo: str, source: pathlib.Path) -> pathlib.Path:
  """`source`'s files as the Hub cache holds repository `repo` at commit `COMMIT` (its `main`)."""
  root = cache / f"models--{repo.replace('/', '--')}"
  snapshot = root / "snapshots" / COMMIT
  shutil.copytree(source, snapshot)
  (root / "refs").mkdir()
  (root / "refs" / "main").write_text(COMMIT)
  return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
  """An empty Hub cache, read offline; each test resolves its names afresh."""
  cache = tmp_path / "hub"
  cache.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  hub._snapshot.cache_clear()
  yield cache
  hub._snapshot.cache_clear()


def test_a_hub_model_in_the_cache_loads_as_its_directory(offline_cache):
  snapshot = _cached(offline_cache, "tiny/qwen2", FIXTURES / "qwen2_untied")
  assert hub.local("hf:tiny/qwen2") == str(snapshot) == hub.local(f"hf:tiny/qwen2@{COMMIT}")
  assert hub.local("/some/dir") == "/some/dir"
  assert TransformerConfig.from_pretrained("hf:tiny/qwen2") == huggingface.read_config(str(snapshot))
  from_hub = huggingface.load_causal_lm("hf:tiny/qwen2")
  from_dir = huggingface.load_causal_lm(str(FIXTURES / "qwen2_untied"))
  for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(from_hub)), nnx.to_flat_state(nnx.state(from_dir))):
    np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(path))


def test_a_hub_tokenizer_resolves_alike(offline_cache):
  _cached(offline_cache, "Qwen/tok", TOKENIZER)
  tokenizer = tok_lib.load("hf:Qwen/tok")
  assert tokenizer.encode("1 + 1 = 2") == tok_lib.load(str(TOKENIZER)).encode("1 + 1 = 2")
  assert os.path.dirname(tokenizer.directory).endswith("models--Qwen--tok/snapshots")


def test_a_resume_compares_hub_names_not_files():
  assert checkpoints.same_path("hf:Qwen/Qwen2.5-0.5B", "hf:Qwen/Qwen2.5-0.5B")
  assert not checkpoints.same_path("hf:Qwen/Qwen2.5-0.5B", "hf:Qwen/Qwen2.5-1.5B")


@pytest.mark.parametrize("spec", ["hf:", "hf:a/b/c", "hf:Qwen/Qwen 2", "hf:Qwen/x@"])
def test_a_malformed_name_is_refused_in_one_line(spec):
  with pytest.raises(CheckpointError, match=r"is not a Hub model: write hf:NAME or hf:OWNER/NAME"):
    hub.local(spec)


def test_a_model_not_in_the_cache_offline_says_what_to_do(offline_cache):
  with pytest.raises(CheckpointError, match=r"^hf:Qwen/absent: not in the Hub cache .*hub and HF_HUB_OFFLINE=1 is set: "
                                            r"run once with the network"):
    hub.local("hf:Qwen/absent")


def _raising(error):
  def download(*args, **kwargs):
    raise error
  return download


def _http(kind, status: int):
  """The Hub client's error `kind` as it raises it: with the HTTP response that caused it."""
  import httpx2  # The Hub client's HTTP library.
  request = httpx2.Request("GET", "https://huggingface.co/api/models/meta/gated")
  return kind(f"{status} Client Error", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize("error, message", [
    ((hub_errors.GatedRepoError, 403), r"^hf:meta/gated: the repository is gated: accept its terms at "
                                       r"https://huggingface.co/meta/gated and set HF_TOKEN"),
    ((hub_errors.RepositoryNotFoundError, 404), r"^hf:meta/gated: no such repository on the Hub \(or it is private: "
                                                r"set HF_TOKEN\)"),
    ((hub_errors.RevisionNotFoundError, 404), r"^hf:meta/gated: the repository has no revision None"),
    (hub_errors.EntryNotFoundError("404 Client Error"),
     r"^hf:meta/gated: a file of the repository is missing \(404 Client Error\): check "
     r"https://huggingface.co/meta/gated holds safetensors weights"),
    (OSError(errno.ENOSPC, "No space left on device"), r"^hf:meta/gated: the disk holding the Hub cache .* is full: "
                                                       r"free space there or point HF_HOME at a larger disk"),
], ids=["gated", "not-found", "no-revision", "missing-file", "disk-full"])
def test_each_download_failure_is_one_line_naming_the_repository(monkeypatch, offline_cache, error, message):
  import huggingface_hub
  error = _http(*error) if isinstance(error, tuple) else error
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(error))
  with pytest.raises(CheckpointError, match=message) as raised:
    hub.local("hf:meta/gated")
  assert "\n" not in str(raised.value)


def test_a_repository_without_the_files_a_run_reads_is_refused(offline_cache, tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "README.md").write_text("no weights")
  _cached(offline_cache, "someone/readme", tmp_path / "empty")
  shutil.rmtree(offline_cache / "models--someone--readme" / "snapshots" / COMMIT)  # As the filter leaves it.
  (offline_cache / "models--someone--readme" / "snapshots" / COMMIT).mkdir()
  with pytest.raises(CheckpointError, match=r"^hf:someone/readme: the repository has none of the files a run reads"):
    hub.local("hf:someone/readme")


def test_a_hub_model_without_its_config_is_one_line_naming_the_snapshot(offline_cache, tmp_path):
  (tmp_path / "weights").mkdir()
  shutil.copy(FIXTURES / "qwen2_untied" / "model.safetensors", tmp_path / "weights")
  _cached(offline_cache, "tiny/noconfig", tmp_path / "weights")
  with pytest.raises(MissingFileError, match=r"no config.json in checkpoint directory '.*models--tiny--noconfig/"
                                             r"snapshots/"):
    huggingface.load_causal_lm("hf:tiny/noconfig")


@pytest.mark.slow  # For time (12 s): make test reads Hub models from a cache built on disk, in one process.
def test_on_several_processes_the_first_downloads_and_the_others_read_the_cache_after_it(tmp_path):
  """Two processes resolve one `hf:` name: process 0 downloads (a stand-in for `snapshot_download` that takes 2 s
  to fill the cache), process 1 waits at the barrier, then reads the cache only (`local_files_only`)."""
  cache = tmp_path / "hub"
  cache.mkdir()
  launch(__file__, ["worker", str(tmp_path), str(cache), str(FIXTURES / "qwen2_untied")], num_processes=2,
         devices_per_process=1, timeout_s=120, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"})
  said = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  snapshot = str(cache / "models--tiny--qwen2" / "snapshots" / COMMIT)
  assert [s["directory"] for s in said] == [snapshot, snapshot]
  assert [s["cached_only"] for s in said] == [[False], [True]]  # Only the first process downloads.


@pytest.mark.slow  # For time (8 s): make test runs the several processes' successful download.
def test_on_several_processes_a_failed_download_is_said_by_every_process_without_waiting(tmp_path):
  """Process 0's download fails (no such repository): it still reaches the barrier, so process 1 says at once that
  the first process did not download the model, instead of waiting there for a time-out."""
  cache = tmp_path / "hub"
  cache.mkdir()
  launch(__file__, ["worker", str(tmp_path), str(cache), "missing"], num_processes=2, devices_per_process=1,
         timeout_s=60, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"})
  said = [json.loads((tmp_path / f"process_{i}.json").read_text())["error"] for i in range(2)]
  assert "hf:tiny/qwen2: no such repository on the Hub" in said[0], said
  assert "hf:tiny/qwen2: not in the Hub cache" in said[1] and "the first process did not download it" in said[1]


def worker(out_dir: str, cache: str, source: str):
  import huggingface_hub
  import jax

  from vapo_jax import distributed
  assert distributed.initialize(initialization_timeout_s=60, shutdown_timeout_s=60)
  real, cached_only = huggingface_hub.snapshot_download, []

  def download(repo, *, local_files_only, **kwargs):
    cached_only.append(local_files_only)
    if not local_files_only and source == "missing":
      raise _http(hub_errors.RepositoryNotFoundError, 404)
    if not local_files_only:  # A slow download: a process reading the cache before it ends finds nothing.
      time.sleep(2)
      _cached(pathlib.Path(cache), repo, pathlib.Path(source))
    return real(repo, local_files_only=True, **kwargs)
  huggingface_hub.snapshot_download = download
  try:
    said = {"directory": hub.local("hf:tiny/qwen2"), "cached_only": cached_only}
  except CheckpointError as e:
    said = {"error": str(e)}
  pathlib.Path(out_dir, f"process_{jax.process_index()}.json").write_text(json.dumps(said))


if __name__ == "__main__":
  worker(*sys.argv[2:5])
