"""Hugging Face checkpoints out: a module exported as config.json + safetensors (sharded above a size), with
the tokenizer's files beside it.

  export(module, directory, tokenizer_dir=...)   # huggingface.py reads it back

Export unstacks a stacked decoder layer `[L, ...]` into its per-layer names (`huggingface.ours_to_hf`), writes
one tensor at a time, in shards of at most `max_shard_bytes`, and a full disk or an unwritable directory is
one error naming the directory (the partial export removed).
"""

import json
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import files
from vapo_jax.errors import SetupError
from vapo_jax.models import safetensors_io
from vapo_jax.models.huggingface import layer_of, ours_to_hf, param_paths, per_layer_paths, stacked_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "generation_config.json", "chat_template.jinja")


def _tensors_of(state: nnx.State) -> list[tuple[str, nnx.Variable, int | None]]:
  """(per-layer path, parameter, layer or None) for every tensor an export writes: a stacked decoder-layer
  parameter is L tensors, `model.layers.{i}.{name}`."""
  return [(name, v, stacked_path(name)[1]) for path, v in param_paths(state).items()
          for name in per_layer_paths(path, v)]


def _shard_plan(tensors, out_dtype, max_shard_bytes: int) -> list[list]:
  """The tensors grouped into safetensors files of at most `max_shard_bytes`, from shapes alone."""
  shards, current, size = [], [], 0
  for path, variable, layer in tensors:
    shape = variable.get_value().shape
    nbytes = int(np.prod(shape if layer is None else shape[1:])) * out_dtype(variable).itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((path, variable, layer))
    size += nbytes
  shards.append(current)
  return shards


def _attempt(write: Callable[[], object]) -> Exception | None:
  """Runs a write; its error, if it fails (the export goes on gathering with the other processes)."""
  try:
    write()
  except Exception as e:  # noqa: BLE001  Raised once every process has left the gathers.
    return e
  return None


def _finish_export(directory: str, hf_config: dict, index: dict | None, tokenizer_dir: str | None,
                   written: list[str]) -> None:
  """The index, the tokenizer's files and, last, config.json (without it the directory is no
  checkpoint), each name added to `written` as its file is begun."""
  copies = [name for name in TOKENIZER_FILES if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir,
                                                                                              name))]
  for name in (["model.safetensors.index.json"] if index is not None else []) + copies + ["config.json"]:
    written.append(name)
    if name in copies:
      with open(os.path.join(tokenizer_dir, name), "rb") as f:
        data = f.read()
    else:
      data = json.dumps(index if name.endswith("index.json") else hf_config, indent=2)
    files.write_atomically(os.path.join(directory, name), data)


def export(module: nnx.Module, directory: str, *, max_shard_bytes: int = 5 * 2**30, dtype: str | None = None,
           tokenizer_dir: str | None = None) -> list[str]:
  """Writes config.json and safetensors (sharded above `max_shard_bytes`) that transformers loads.

  `dtype` ("float32" / "bfloat16") converts the tensors; None keeps the parameter dtype. The
  tokenizer's files found in `tokenizer_dir` are copied alongside. Tensors are fetched one shard
  file at a time (a 32B model never sits whole in host memory); with several processes every
  process takes part in the gathers and process 0 writes. Returns the files written.

  config.json is removed first and written last, so that the directory is a loadable checkpoint only
  once complete; a failed export (a full disk: a `SetupError` naming the directory, on every process)
  removes the files it wrote.
  """
  from vapo_jax import distributed  # Imported here: the model package does not need it otherwise.

  main = distributed.is_main_process()
  tensors_out = _tensors_of(nnx.state(module))
  out_dtype = lambda v: jnp.dtype(dtype) if dtype is not None else jnp.dtype(v.get_value().dtype)
  hf_config = module.cfg.to_hf() | {"torch_dtype": str(out_dtype(tensors_out[0][1]))}
  shards = _shard_plan(tensors_out, out_dtype, max_shard_bytes)
  value = lambda v, layer: v.get_value() if layer is None else layer_of(v.get_value(), layer)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  begin = lambda: (os.makedirs(directory, exist_ok=True),
                   files.remove_quietly(os.path.join(directory, "config.json")))
  failure = _attempt(begin) if main else None
  weight_map, total, written = {}, 0, []
  for name, shard in zip(names, shards):
    tensors = [ours_to_hf(path, distributed.to_host(value(v, layer)).astype(out_dtype(v))) for path, v,
               layer in shard]
    if main and failure is None:
      written.append(name)
      failure = _attempt(lambda: safetensors_io.write(os.path.join(directory, name), tensors))
    weight_map |= {tensor: name for tensor, _ in tensors}
    total += sum(a.nbytes for _, a in tensors)
  index = {"metadata": {"total_size": total}, "weight_map": weight_map} if len(shards) > 1 else None
  if main and failure is None:
    failure = _attempt(lambda: _finish_export(directory, hf_config, index, tokenizer_dir, written))
  if distributed.any_process(failure is not None):
    for name in written if main else ():
      files.remove_quietly(os.path.join(directory, name))
    what = "exporting the model" if main else "exporting the model (process 0 could not write it)"
    with files.reporting_write_failures(directory, what):
      raise failure or SetupError(f"{what} to {directory}: see process 0's error")
  return written if main else names + ["config.json"]
