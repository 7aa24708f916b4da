"""A data file's rows, one at a time with its number: `.jsonl` (by line; a line that is not UTF-8 or not JSON
is that line's error), `.json` (a list of objects, or an object of equal-length columns), `.parquet`, and
Hugging Face `datasets` (`hf:NAME[:CONFIG]`, or a local dataset directory). A file that cannot be read as any
of them (missing, compressed, an unknown suffix, a directory with no data set) is a `DataError` naming it.

  rows, unit = read_rows(path)     # ((number, row or ValueError), ...), "line" or "row"
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vapo_jax.errors import DataError


def _not_utf8(raw: bytes, position: int) -> str:
  """What is wrong with the `raw` line's byte at `position` (0-based)."""
  return (f"not UTF-8 text (byte 0x{raw[position]:02x} at column {position + 1}); re-save the file as "
          "UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
  with open(path, "rb") as f:  # Bytes: a line that is not UTF-8 is that line's error, not the file's.
    for number, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
      except UnicodeDecodeError as e:
        yield number, ValueError(f"field (line): {_not_utf8(raw, e.start)}")
        continue
      if not line.strip():
        continue
      try:
        yield number, json.loads(line.rstrip("\r\n"))
      except json.JSONDecodeError as e:
        yield number, ValueError(f"field (line): malformed JSON: {e.msg} at column {e.colno}")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
  raw = path.read_bytes()
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line_start = raw.rfind(b"\n", 0, e.start) + 1
    line = raw.count(b"\n", 0, line_start) + 1
    raise DataError(f"{path}, line {line}: {_not_utf8(raw[line_start:], e.start - line_start)}") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{path}, line {e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
  if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
    lengths = {len(v) for v in data.values()}
    if len(lengths) != 1:
      raise DataError(f"{path}: columns of unequal lengths {sorted(lengths)}")
    data = [dict(zip(data, values)) for values in zip(*data.values())]
  if not isinstance(data, list):
    raise DataError(f"{path}: expected a list of objects or an object of columns, got {type(data).__name__}")
  yield from enumerate(data, 1)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
  import pyarrow
  import pyarrow.parquet as pq

  try:
    table = pq.read_table(path)
  except pyarrow.ArrowException as e:
    raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]}); copy it again, or give "
                    "a .jsonl or .json file") from None
  yield from enumerate(table.to_pylist(), 1)


def _hf_rows(spec: str, split: str) -> Iterator[tuple[int, Any]]:
  """Rows of a hub dataset (`hf:NAME[:CONFIG]`) or a local dataset directory, loaded eagerly."""
  try:
    import datasets
  except ImportError:
    raise DataError(f"{spec}: loading a Hugging Face dataset needs `pip install datasets`") from None
  try:
    if spec.startswith("hf:"):
      name, _, config = spec[3:].partition(":")
      dataset = datasets.load_dataset(name, config or None, split=split)
    elif (Path(spec) / "dataset_info.json").exists() or (Path(spec) / "dataset_dict.json").exists():
      dataset = datasets.load_from_disk(spec)
      if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset[split]
    else:
      dataset = datasets.load_dataset(spec, split=split)
  except (ValueError, KeyError, FileNotFoundError, ConnectionError) as e:
    raise DataError(f"{spec}: cannot load split {split!r}: {e}") from None
  return enumerate(dataset, 1)


# What a local Hugging Face dataset directory holds (save_to_disk's metadata, or data files).
_DATASET_FILES = {".arrow", ".csv", ".json", ".jsonl", ".parquet"}


def read_rows(path: str, *, split: str = "train") -> tuple[Iterator[tuple[int, Any]], str]:
  """`(number, row)` pairs of a file or dataset, and the unit its numbers count ("line", "row")."""
  p = Path(path)
  if p.is_dir() and not any(f.suffix in _DATASET_FILES for f in p.iterdir()):
    raise DataError(f"{path}: a directory holding no data set (no {', '.join(sorted(_DATASET_FILES))} file): "
                    "give a .jsonl, .json or .parquet file, or a directory saved by datasets' save_to_disk")
  if path.startswith("hf:") or p.is_dir():
    return _hf_rows(path, split), "row"
  if not p.is_file():
    raise DataError(f"{path}: no such file")
  with open(p, "rb") as f:
    if f.read(2) == b"\x1f\x8b":
      raise DataError(f"{path}: a gzip-compressed file: decompress it first (gunzip -k {path}) and give the "
                      "uncompressed .jsonl, .json or .parquet file")
  match p.suffix:
    case ".jsonl":
      return _jsonl_rows(p), "line"
    case ".json":
      return _json_rows(p), "row"
    case ".parquet":
      return _parquet_rows(p), "row"
  raise DataError(f"{path}: unknown file type {p.suffix!r} (expected .jsonl, .json or .parquet)")
