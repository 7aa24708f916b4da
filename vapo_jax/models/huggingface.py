"""Hugging Face checkpoints in: config.json + safetensors (single file or sharded), and the names both ways.

Loading reads one tensor at a time from memory-mapped files and places it directly in the target
parameter's sharding (`jax.make_array_from_callback` asks only for the slices this process's
devices hold), so the host never needs the whole model in memory; a decoder layer's tensor is
written into its stacked parameter `[L, ...]` in place. Errors name the Hugging Face tensor.
Out: `hf_export.py`, which unstacks to the per-layer names with `ours_to_hf`.
"""

import functools
import glob
import json
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vapo_jax.errors import CheckpointError, MissingFileError
from vapo_jax.models import hub, safetensors_io, sharding
from vapo_jax.models.config import TransformerConfig
from vapo_jax.models.transformer import CausalLM, ValueModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class UnknownTensor(CheckpointError):
  """A tensor name that no parameter maps to."""


def _fitted(array: np.ndarray, shape: tuple[int, ...], cfg: TransformerConfig, heads: str) -> np.ndarray:
  """`array`, checked to have the Hugging Face `shape` its reshape needs (config.json's `heads` heads)."""
  if array.shape != shape:
    raise CheckpointError(f"has shape {tuple(array.shape)}, but config.json ({heads}={getattr(cfg, heads)}, "
                          f"head_dim={cfg.head_dim}, hidden_size={cfg.hidden_size}) needs {shape}")
  return array


def _to_ours(hf_suffix: str, array: np.ndarray, cfg: TransformerConfig) -> tuple[str, np.ndarray]:
  """Maps a per-layer HF tensor (name after `model.layers.{i}.`) to our name and layout; a tensor
  that the attention's reshape does not fit is a `CheckpointError` saying what config.json needs."""
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
  heads = {"q": (n, "num_heads"), "k": (k, "num_kv_heads"), "v": (k, "num_kv_heads")}
  match hf_suffix.split("."):
    case ["self_attn", ("q_proj" | "k_proj" | "v_proj") as proj, "weight"]:
      count, field = heads[proj[0]]
      return f"self_attn.{proj}", _fitted(array, (count * h, d), cfg, field).T.reshape(d, count, h)
    case ["self_attn", ("q_proj" | "k_proj" | "v_proj") as proj, "bias"]:
      count, field = heads[proj[0]]
      return f"self_attn.{proj[0]}_bias", _fitted(array, (count * h,), cfg, field).reshape(count, h)
    case ["self_attn", "o_proj", "weight"]:
      return "self_attn.o_proj", _fitted(array, (d, n * h), cfg, "num_heads").T.reshape(n, h, d)
    case ["mlp", proj, "weight"]:
      return f"mlp.{proj}", array.T
    case ["mlp", proj, "bias"]:
      return f"mlp.{proj.removesuffix('_proj')}_bias", array
    case [norm, "weight"]:
      return f"{norm}.weight", array
  raise UnknownTensor(f"unexpected tensor 'model.layers.N.{hf_suffix}'")


def _to_hf(our_suffix: str, array: np.ndarray) -> tuple[str, np.ndarray]:
  """Inverse of `_to_ours` for one per-layer parameter."""
  match our_suffix.split("."):
    case ["self_attn", ("q_proj" | "k_proj" | "v_proj") as proj]:
      return f"self_attn.{proj}.weight", array.reshape(array.shape[0], -1).T
    case ["self_attn", bias] if bias.endswith("_bias"):
      return f"self_attn.{bias[0]}_proj.bias", array.reshape(-1)
    case ["self_attn", "o_proj"]:
      return "self_attn.o_proj.weight", array.reshape(-1, array.shape[-1]).T
    case ["mlp", bias] if bias.endswith("_bias"):
      return f"mlp.{bias.removesuffix('_bias')}_proj.bias", array
    case ["mlp", proj]:
      return f"mlp.{proj}.weight", array.T
    case [norm, "weight"]:
      return f"{norm}.weight", array
  raise ValueError(f"no Hugging Face name for parameter {our_suffix!r}")


def hf_to_ours(name: str, array: np.ndarray, cfg: TransformerConfig) -> tuple[str, np.ndarray]:
  """Our parameter path (dotted) and layout for a Hugging Face tensor."""
  if m := _LAYER.match(name):
    suffix, converted = _to_ours(m.group(2), array, cfg)
    return f"model.layers.{m.group(1)}.{suffix}", converted
  match name:
    case "model.embed_tokens.weight":
      return "model.embed_tokens", array
    case "model.norm.weight":
      return "model.norm.weight", array
    case "lm_head.weight":
      return "lm_head", array.T
    case "value_head.weight" | "score.weight":
      return "value_head", array.T
  raise UnknownTensor(f"unexpected tensor {name!r}")


def ours_to_hf(path: str, array: np.ndarray) -> tuple[str, np.ndarray]:
  """The Hugging Face name and layout of one of our parameters (dotted path)."""
  if m := re.match(r"^model\.layers\.(\d+)\.(.+)$", path):
    name, converted = _to_hf(m.group(2), array)
    return f"model.layers.{m.group(1)}.{name}", converted
  match path:
    case "model.embed_tokens":
      return "model.embed_tokens.weight", array
    case "model.norm.weight":
      return "model.norm.weight", array
    case "lm_head" | "value_head":
      return f"{path}.weight", array.T
  raise ValueError(f"no Hugging Face name for parameter {path!r}")


def _open_tensors(directory: str) -> dict[str, safetensors_io.SafetensorsFile]:
  """tensor name -> the file holding it, from the index or the single file."""
  if not os.path.isdir(directory):
    raise MissingFileError(f"checkpoint directory {directory!r} does not exist")
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    try:
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({type(e).__name__}: "
                            f"{e}); restore the file from the model's original copy") from None
    for name in sorted(set(weight_map.values())):
      if not os.path.isfile(os.path.join(directory, name)):
        raise MissingFileError(f"{index_path} names {name!r}, which is not in {directory!r}: copy the "
                               "missing file (an incomplete download?)")
    files = {name: safetensors_io.SafetensorsFile(os.path.join(directory, name))
             for name in sorted(set(weight_map.values()))}
    return {tensor: files[file] for tensor, file in weight_map.items()}
  paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
  if not paths:
    raise MissingFileError(f"no *.safetensors files in checkpoint directory {directory!r}")
  tensors = {}
  for path in paths:
    file = safetensors_io.SafetensorsFile(path)
    tensors |= {name: file for name in file.keys()}
  return tensors


EMBEDDING = "model.embed_tokens.weight"


def _check_vocab_size(directory: str, cfg: TransformerConfig,
                      tensors: dict[str, safetensors_io.SafetensorsFile]):
  """config.json's `vocab_size` is the embedding tensor's row count; else config.json is at fault."""
  if EMBEDDING in tensors and (rows := tensors[EMBEDDING].shape(EMBEDDING)[0]) != cfg.vocab_size:
    raise CheckpointError(f"{os.path.join(directory, 'config.json')} says vocab_size={cfg.vocab_size}, but "
                          f"tensor {EMBEDDING!r} in {tensors[EMBEDDING].path} has {rows} rows: config.json "
                          f"does not describe these weights; set its vocab_size to {rows}, or restore it "
                          "from the model's original copy")


def read_config(directory: str) -> TransformerConfig:
  """The architecture of a checkpoint directory (or Hub model, `hub`): its config.json, checked against its
  embedding tensor."""
  directory = hub.local(directory)
  cfg = TransformerConfig.from_pretrained(directory)
  _check_vocab_size(directory, cfg, _open_tensors(directory))
  return cfg


def param_paths(state: nnx.State) -> dict[str, nnx.Variable]:
  return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)
          if isinstance(v, nnx.Param)}


_STACKED = re.compile(r"^(model\.layers)\.(\d+)\.(.+)$")  # A per-layer name of a stacked parameter.


def stacked_path(path: str) -> tuple[str, int | None]:
  """(our parameter's path, layer) for a per-layer path `model.layers.{i}.{name}` (decoder layers are
  stacked: one parameter `model.layers.{name}` of shape `[L, ...]`); (path, None) for any other."""
  if m := _STACKED.match(path):
    return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
  return path, None


def per_layer_paths(path: str, variable: nnx.Variable) -> list[str]:
  """The per-layer paths of a stacked parameter (`model.layers.{i}.{name}`, i < L), or [path]."""
  if not path.startswith("model.layers."):
    return [path]
  return [f"model.layers.{i}.{path.removeprefix('model.layers.')}" for i in range(variable.get_value().shape[0])]


# Streaming into stacked parameters: a zero stack in its sharding, one layer's tensor written at a time
# (donated).
@functools.cache
def _zeros(shape: tuple[int, ...], dtype, placement: NamedSharding | None) -> Callable[[], jax.Array]:
  """A program creating a zero array directly in `placement` (no device ever holds it whole)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=placement)


_set_layer = jax.jit(lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0),
                     donate_argnums=0)
layer_of = jax.jit(lambda stack, i: jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False))


def _placed(array: np.ndarray, dtype, shape, sharding) -> jax.Array:
  """A host tensor on the devices in `sharding` (None: the default device), each device reading only its slice."""
  if sharding is None:
    return jnp.asarray(np.asarray(array, dtype))
  return jax.make_array_from_callback(shape, sharding, lambda index: np.asarray(array[index], dtype))


def _hf_name(per_layer: str, params: dict[str, nnx.Variable]) -> str:
  """The Hugging Face tensor name of one of our per-layer (or unstacked) parameter paths."""
  path, layer = stacked_path(per_layer)
  return ours_to_hf(per_layer, np.zeros(params[path].get_value().shape[layer is not None:], np.float32))[0]


def _check_complete(directory: str, params: dict[str, nnx.Variable], found: set[str], allow_missing) -> None:
  """A `CheckpointError` naming (by their Hugging Face names) the tensors of `params` not `found`."""
  expected = {name for path,
              v in params.items() if path not in allow_missing for name in per_layer_paths(path, v)}
  missing = sorted(expected - found)
  if missing:
    hf_names = [_hf_name(p, params) for p in missing]
    raise CheckpointError(f"{directory}: missing tensors "
                          f"{hf_names[:10]}{' ...' if len(missing) > 10 else ''} "
                          f"(of {len(missing)}): the weights are incomplete, or not of the architecture in "
                          "config.json")


def _placed_parameter(current, variable, array: np.ndarray, layer: int | None, *, mesh, rules) -> jax.Array:
  """`array` as parameter `variable` (sharded on `mesh` by `rules`), or as layer `layer` of its stack
  `current` (None: zeros of the stack's shape, at the stack's first tensor)."""
  target, axes = variable.get_value(), variable.get_metadata()["logical_axes"]
  spec = () if mesh is None else tuple(sharding.partition_spec(axes, rules, mesh.shape, target.shape))
  placement = lambda *parts: None if mesh is None else NamedSharding(mesh, PartitionSpec(*parts))
  if layer is None:
    return _placed(array, target.dtype, target.shape, placement(*spec))
  current = _zeros(target.shape, jnp.dtype(target.dtype), placement(*spec))() if current is None else current
  return _set_layer(current, _placed(array, target.dtype, target.shape[1:], placement(*spec[1:])), layer)


def load(directory: str, factory: Callable[[], nnx.Module], *, mesh: Mesh | None = None,
         rules: dict | None = None, allow_missing: tuple[str, ...] = ()) -> nnx.Module:
  """Builds `factory()`'s module with its parameters read from a Hugging Face checkpoint.

  Tensors are read one at a time; a decoder layer's tensor is written into its stacked parameter
  (`stacked_path`), so the host holds one tensor and the devices the stacks plus one layer.

  Args:
    directory: holds config.json and `*.safetensors` (optionally `model.safetensors.index.json`).
    factory: builds the module (CausalLM or ValueModel); it is only traced, never run.
    mesh, rules: where to place each parameter; None keeps everything on the default device.
    allow_missing: our parameter paths that may be absent (left at their initial value).
  """
  directory = hub.local(directory)
  tensors = _open_tensors(directory)
  graphdef, abstract = nnx.split(nnx.eval_shape(factory))
  params, cfg = param_paths(abstract), TransformerConfig.from_pretrained(directory)
  _check_vocab_size(directory, cfg, tensors)
  loaded, found, unexpected = {}, set(), []
  for name, file in tensors.items():
    if name == "lm_head.weight" and "lm_head" not in params:
      continue  # Tied embeddings, or a value model built from a policy checkpoint.
    tensor = file.get(name)  # A tensor the index names but its file lacks is an error here.
    try:
      per_layer, array = hf_to_ours(name, tensor, cfg)
    except UnknownTensor:
      unexpected.append(name)
      continue
    except CheckpointError as e:
      raise CheckpointError(f"{file.path}: tensor {name!r} {e}") from None
    path, layer = stacked_path(per_layer)
    if path not in params or (layer is not None and layer >= params[path].get_value().shape[0]):
      unexpected.append(name)
      continue
    shape = params[path].get_value().shape[0 if layer is None else 1:]  # A stack's layer: its own shape.
    if array.shape != shape:
      raise CheckpointError(f"{directory}: tensor {name!r} has shape {file.shape(name)}, which maps "
                            f"to {array.shape}, but parameter {per_layer!r} needs {shape}")
    loaded[path] = _placed_parameter(loaded.get(path), params[path], array, layer, mesh=mesh, rules=rules)
    found.add(per_layer)
  if unexpected:
    raise CheckpointError(f"{directory}: unexpected tensors {sorted(unexpected)[:10]}"
                          f"{' ...' if len(unexpected) > 10 else ''} (no parameter of the model maps to them)")
  _check_complete(directory, params, found, allow_missing)
  if set(params) - set(loaded):  # Allowed-missing parameters keep their initial value.
    initial = param_paths(nnx.state(factory()))
    loaded |= {p: initial[p].get_value() for p in set(params) - set(loaded)}
  state = nnx.from_flat_state([(path, v.replace(loaded[".".join(map(str, path))]))
                               for path, v in nnx.to_flat_state(abstract)])
  return nnx.merge(graphdef, state)


def load_causal_lm(directory: str, *, mesh=None, rules=None, **model_kwargs) -> CausalLM:
  """The policy from a Hugging Face checkpoint directory (`model_kwargs`: `CausalLM`'s dtype, param_dtype,
  remat, attention, scan_layers, scan_unroll)."""
  cfg = TransformerConfig.from_pretrained(directory)
  return load(directory, lambda: CausalLM(cfg, rngs=nnx.Rngs(0), **model_kwargs), mesh=mesh, rules=rules)


def load_value_model(directory: str, *, from_policy: bool, mesh=None, rules=None,
                     **model_kwargs) -> ValueModel:
  """The critic: from a policy checkpoint (backbone copied, value head zero) or its own."""
  cfg = TransformerConfig.from_pretrained(directory)
  return load(directory, lambda: ValueModel(cfg, rngs=nnx.Rngs(0), **model_kwargs),
              mesh=mesh, rules=rules, allow_missing=("value_head",) if from_policy else ())


def check_finite(path: str, module) -> None:
  """Refuses a loaded checkpoint holding NaN or infinite weights, naming the tensors."""
  flags = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), tree))(nnx.state(module))
  bad = [jax.tree_util.keystr(k) for k,
         ok in jax.tree_util.tree_flatten_with_path(jax.device_get(flags))[0] if not ok]
  if bad:
    raise CheckpointError(f"{path}: {len(bad)} tensor(s) hold NaN or infinite values, e.g. "
                          f"{', '.join(bad[:3])}; this checkpoint cannot be trained from: use an earlier or "
                          "a re-exported one")
