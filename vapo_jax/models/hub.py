"""Model weights from the Hugging Face Hub: `hf:NAME[@REVISION]` wherever a model directory goes
(`model.checkpoint`, `model.critic_checkpoint`, `model.tokenizer`).

  hub.local("hf:Qwen/Qwen2.5-0.5B")   # the snapshot's directory in the Hub cache, downloaded the first time
  hub.local("/ckpt/qwen")             # a local directory: itself

What a run reads is downloaded, through `huggingface_hub.snapshot_download` into its cache (`HF_HOME`,
`HF_HUB_CACHE`) with its progress bars: the safetensors weights and their index, config.json,
generation_config.json and the tokenizer's files; nothing else of the repository (no PyTorch `.bin`, no
`.gguf`). With `HF_HUB_OFFLINE=1` the cache is read and nothing is fetched; a gated or private repository
reads `HF_TOKEN`. With several processes (`jax.distributed`) the first one downloads while the others wait,
then each reads the cache. A missing repository, revision or file, a gated repository without access, no
network, or a full disk is one `CheckpointError` line naming the repository and what to do.
"""

import functools
import os

from vapo_jax import files
from vapo_jax.errors import CheckpointError

PREFIX = "hf:"
PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
            "added_tokens.json", "chat_template.jinja")


def is_hub(path: str | None) -> bool:
  return isinstance(path, str) and path.startswith(PREFIX)


def parse(spec: str) -> tuple[str, str | None]:
  """(repository, revision or None) of `hf:NAME[@REVISION]`; a malformed one is a `CheckpointError`."""
  name, _, revision = spec[len(PREFIX):].partition("@")
  if name.count("/") > 1 or not name.strip("/") or any(c.isspace() for c in name) or (_ and not revision):
    raise CheckpointError(f"{spec!r} is not a Hub model: write hf:NAME or hf:OWNER/NAME, optionally "
                          "@REVISION (a branch, tag or commit), e.g. hf:Qwen/Qwen2.5-0.5B")
  return name, revision or None


def local(path: str) -> str:
  """The local directory of `path`: a Hub model's snapshot in the cache (downloaded once per process), else
  `path` itself."""
  return _snapshot(path) if is_hub(path) else path


@functools.lru_cache(maxsize=16)
def _snapshot(spec: str) -> str:
  repo, revision = parse(spec)
  import jax  # (Imported on use: resolving a local path needs no JAX.)
  if jax.process_count() == 1:
    return _download(spec, repo, revision, cached_only=False)
  from jax.experimental import multihost_utils
  if jax.process_index() == 0:
    try:
      return _download(spec, repo, revision, cached_only=False)
    finally:  # Failed too: the others, let through, find no snapshot and say so now, not at a time-out.
      multihost_utils.sync_global_devices(f"hub {spec}")
  multihost_utils.sync_global_devices(f"hub {spec}")  # The first process has downloaded it (or failed: it says so).
  return _download(spec, repo, revision, cached_only=True)


def _download(spec: str, repo: str, revision: str | None, *, cached_only: bool) -> str:
  import huggingface_hub
  from huggingface_hub import constants
  from huggingface_hub import errors as hub_errors
  cache = constants.HF_HUB_CACHE
  try:
    directory = huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=list(PATTERNS),
                                                  local_files_only=cached_only or constants.HF_HUB_OFFLINE)
  except hub_errors.GatedRepoError:
    raise CheckpointError(f"{spec}: the repository is gated: accept its terms at "
                          f"https://huggingface.co/{repo} "
                          "and set HF_TOKEN to a token of that account") from None
  except hub_errors.RepositoryNotFoundError:
    raise CheckpointError(f"{spec}: no such repository on the Hub (or it is private: set HF_TOKEN); check "
                          "the name at https://huggingface.co/models") from None
  except hub_errors.RevisionNotFoundError:
    raise CheckpointError(f"{spec}: the repository has no revision {revision!r}: name a branch, tag or "
                          f"commit of https://huggingface.co/{repo}") from None
  except hub_errors.LocalEntryNotFoundError:
    why = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else
           "the Hub cannot be reached" if not cached_only else "the first process did not download it")
    raise CheckpointError(f"{spec}: not in the Hub cache {cache} and {why}: run once with the network (unset "
                          "HF_HUB_OFFLINE), or copy the model there, or pass its local directory") from None
  except hub_errors.EntryNotFoundError as e:  # (After its subclass, the offline miss.)
    raise CheckpointError(f"{spec}: a file of the repository is missing "
                          f"({str(e).strip().splitlines()[0][:200]}): "
                          f"check https://huggingface.co/{repo} holds safetensors weights and config.json") from None
  except OSError as e:
    if files.disk_full_cause(e) is not None:
      raise CheckpointError(f"{spec}: the disk holding the Hub cache {cache} is full: free space there or "
                            "point HF_HOME at a larger disk, then run again (what was downloaded is kept)") from None
    raise CheckpointError(f"{spec}: downloading into {cache} failed: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}") from None
  if not any(name.endswith(".safetensors") or name in ("config.json", "tokenizer.json", "vocab.json")
             for name in os.listdir(directory)):
    raise CheckpointError(f"{spec}: the repository has none of the files a run reads (*.safetensors, "
                          f"config.json, a tokenizer) in {directory}: is it a model repository with "
                          "safetensors weights?")
  return directory
