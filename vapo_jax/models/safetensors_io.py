"""Reading and writing the safetensors format with numpy, one tensor at a time.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the raw data. Reading memory-maps the file, so a tensor's
bytes are touched only when (and where) they are used; bfloat16 comes from `ml_dtypes`. Opening a
file checks its header against its size, so a truncated or corrupt file is a `CheckpointError`
naming the file and the tensor, not a failed reshape later.
"""

import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

from vapo_jax import files
from vapo_jax.errors import CheckpointError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # The format's limit on the JSON header.
_DAMAGED = "the file is damaged or incomplete (an interrupted download or copy?): fetch it again"


class SafetensorsFile:
  """Lazy access to the tensors of one `.safetensors` file."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length); {_DAMAGED}")
      (header_len,) = struct.unpack("<Q", raw)
      if header_len > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"{path}: not a safetensors file, or a corrupt one: its header length "
                              f"{header_len} exceeds the file's {size} bytes; {_DAMAGED}")
      try:
        header = json.loads(f.read(header_len))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e}); {_DAMAGED}") from None
    if not isinstance(header, dict):
      raise CheckpointError(f"{path}: the safetensors header is a {type(header).__name__}, not an object; "
                            f"{_DAMAGED}")
    self.metadata = header.pop("__metadata__", {}) or {}
    self._offset = 8 + header_len
    for name, info in header.items():
      self._check(name, info, size)
    self.header = header
    self._mmap = None

  def _check(self, name: str, info, size: int) -> None:
    """A tensor's entry is well formed, and its bytes match its shape and lie inside the file."""
    try:
      shape, (begin, end) = [int(d) for d in info["shape"]], info["data_offsets"]
      dtype = info["dtype"]
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(f"{self.path}: tensor {name!r} has a malformed header entry {info!r}; {_DAMAGED}") from None
    if dtype in _DTYPES and end - begin != int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize:
      raise CheckpointError(f"{self.path}: tensor {name!r} ({dtype} {shape}) spans {end - begin} bytes, "
                            f"which does not match its shape; {_DAMAGED}")
    if not 0 <= begin <= end or self._offset + end > size:
      raise CheckpointError(f"{self.path}: tensor {name!r} needs bytes up to {self._offset + end}, but the "
                            f"file has {size}: it is truncated; {_DAMAGED}")

  def keys(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a read-only, memory-mapped numpy array."""
    if name not in self.header:
      raise CheckpointError(f"{self.path}: no tensor {name!r} in this file (the index names it here)")
    info = self.header[name]
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']} "
                            f"(supported: {', '.join(_DTYPES)})")
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    begin, end = info["data_offsets"]
    data = self._mmap[self._offset + begin:self._offset + end]
    return data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]],
          metadata: dict[str, str] | None = None) -> int:
  """Writes `(name, array)` pairs to `path` (atomically, via a temporary file); returns bytes written."""
  tensors = [(name, np.ascontiguousarray(array)) for name, array in tensors]
  header, offset = {}, 0
  for name, array in tensors:
    if array.dtype not in _NAMES:
      raise ValueError(f"tensor {name!r} has unsupported dtype {array.dtype}")
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
  header["__metadata__"] = metadata or {"format": "pt"}
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  tmp = path + ".tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(struct.pack("<Q", len(encoded)))
      f.write(encoded)
      for _, array in tensors:
        f.write(array.tobytes())
    os.replace(tmp, path)
  except BaseException:
    files.remove_quietly(tmp)  # A failed write (a full disk) leaves no partial file behind.
    raise
  return 8 + len(encoded) + offset
