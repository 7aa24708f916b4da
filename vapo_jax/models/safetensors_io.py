"""Reading and writing the safetensors format with numpy, one tensor at a time.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the raw data. Reading memory-maps the file, so a tensor's
bytes are touched only when (and where) they are used; bfloat16 comes from `ml_dtypes`.
"""

import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """Lazy access to the tensors of one `.safetensors` file."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
      (header_len,) = struct.unpack("<Q", raw)
      try:
        self.header = json.loads(f.read(header_len))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    self.metadata = self.header.pop("__metadata__", {}) or {}
    self._offset = 8 + header_len
    self._mmap = None

  def keys(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a read-only, memory-mapped numpy array."""
    info = self.header[name]
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    begin, end = info["data_offsets"]
    data = self._mmap[self._offset + begin:self._offset + end]
    return data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> int:
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
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for _, array in tensors:
      f.write(array.tobytes())
  os.replace(tmp, path)
  return 8 + len(encoded) + offset
