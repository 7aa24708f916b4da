"""Problem files → `Record`s: loading, validation and de-duplication.

  records = load_records(paths.data_path("aime24/qwen25math_aime24_test.jsonl"))   # [Record]

Files: `.jsonl`, `.json` (a list of objects, or an object of equal-length columns), `.parquet`, and Hugging
Face `datasets` (`hf:NAME[:CONFIG]` from the hub, or a local dataset directory) when that package is
installed. Each row becomes a `Record(prompt, answer, id, source, solution, level)`; the fields come from a
schema (`SCHEMAS`, detected from the first row's keys) or from explicit field paths
(`"reward_model.ground_truth"`, `"prompt.0.content"`). A worked solution, for the supervised warm start
(`sft.path`), is read from a `solution` field, else a `response` field (the first that is present and
non-empty; None otherwise). A difficulty level, for accuracy by level (MATH's 1-5, the synthetic tasks' number
of terms), is read from a `level` field: an integer, or text ending in one ("Level 3"); None otherwise.

A bad row (malformed line, text that is not UTF-8, missing or empty prompt or answer, wrong type)
is a `DataError` naming the file, the line (jsonl) or row and the field; with `skip_bad_rows` it is
skipped and counted in one warning. No valid row at all is always an error. Duplicate problems are
dropped (the first is kept) and those with conflicting answers are reported in a warning.
Files are read row by row by `rows.py`; prompts (templates, token limits) are `problems.py`'s; the prompt
sampler is `prompt_iterator.py`.
"""

import collections
import dataclasses
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vapo_jax import kinds
from vapo_jax.data.rows import read_rows
from vapo_jax.errors import DataError


class Record(NamedTuple):
  prompt: str  # The problem text, without a template.
  answer: str  # The reference answer (integers as written: "025" stays "025").
  id: str  # The row's id field, or its line / row number.
  source: str  # The dataset: the row's source field, or "<folder>/<file stem>".
  solution: str | None = None  # A worked solution (supervised warm start), when the row has one.
  level: int | None = None  # The problem's difficulty level (accuracy by level), when the row has one.


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldMap:
  """Where a row's fields are: dotted paths, the first one present is used."""

  prompt: tuple[str, ...]  # Candidates for the problem text.
  answer: tuple[str, ...]  # Candidates for the reference answer.
  id: tuple[str, ...] = ("id", "unique_id", "index", "idx")  # Optional; default: row number.
  source: tuple[str, ...] = ()  # Optional; default: "<folder>/<file stem>".
  solution: tuple[str, ...] = ("solution", "response")  # Optional worked solution; default: None.
  level: tuple[str, ...] = ("level", "extra_info.level")  # Optional difficulty level; default: None.
  answer_after: str | None = None  # Keep the text after the last occurrence of this marker.


SCHEMAS: dict[str, FieldMap] = {
    # verl parquet (DAPO-Math-17k, DAPO's AIME 2024, SimpleRL): the chat prompt holds the raw
    # problem (DAPO-17k) or a templated one, whose raw text is in extra_info.
    "verl": FieldMap(prompt=("extra_info.raw_problem", "extra_info.question", "prompt.0.content"),
                     answer=("reward_model.ground_truth",), id=("extra_info.index",),
                     source=("data_source",)),
    # Qwen2.5-Math AIME 2024 / AMC 2023, MathArena AIME, MATH-500, DAPO-17k jsonl.
    "problem_answer": FieldMap(prompt=("problem",), answer=("answer",)),
    # GSM8K: the answer is a worked solution ending in "#### <number>".
    "gsm8k": FieldMap(prompt=("question",), answer=("answer",), answer_after="####"),
    "question_answer": FieldMap(prompt=("question",), answer=("answer", "gt_answer")),
    # SvS's MATH-500 + AIME evaluation file.
    "svs": FieldMap(prompt=("question",), answer=("ref_answer",), source=("data_source",)),
}
kinds.check_table(kinds.Schema, SCHEMAS, "data/records.py SCHEMAS")
_MISSING = object()


def detect_schema(row: dict) -> str:
  """The schema of a row, from its keys."""
  if "reward_model" in row:
    return "verl"
  if "ref_answer" in row:
    return "svs"
  if "problem" in row and "answer" in row:
    return "problem_answer"
  if "question" in row and ("answer" in row or "gt_answer" in row):
    return "gsm8k" if "####" in str(row.get("answer", "")) else "question_answer"
  raise ValueError(f"no known schema has the keys {sorted(row)}")


def field_map(row: dict, *, schema: str = "auto", prompt_field: str | None = None,
              answer_field: str | None = None, id_field: str | None = None) -> FieldMap:
  """The schema's `FieldMap` with explicit field paths in place of its candidates."""
  if schema == "auto" and prompt_field and answer_field:
    base = FieldMap(prompt=(prompt_field,), answer=(answer_field,))
  elif (base := SCHEMAS.get(detect_schema(row) if schema == "auto" else schema)) is None:
    raise ValueError(f"unknown schema {schema!r}; known: auto, {', '.join(SCHEMAS)}")
  explicit = {k: (v,) for k, v in (("prompt", prompt_field), ("answer", answer_field), ("id", id_field)) if v}
  return dataclasses.replace(base, **explicit)


def _get(row: Any, path: str) -> Any:
  for part in path.split("."):
    if isinstance(row, dict):
      row = row.get(part, _MISSING)
    elif isinstance(row, (list, tuple)) and part.lstrip("-").isdigit() and -len(row) <= int(part) < len(row):
      row = row[int(part)]
    else:
      return _MISSING
    if row is _MISSING:
      return _MISSING
  return row


def _first(row: dict, paths: tuple[str, ...]) -> tuple[str, Any]:
  for path in paths:
    if (value := _get(row, path)) is not _MISSING and value is not None:
      return path, value
  return " or ".join(repr(p) for p in paths), _MISSING


def answer_text(value: Any) -> str | None:
  """A reference answer as a string: ints as written, integer-valued floats (AMC's 27.0) as ints."""
  if isinstance(value, str):
    return value.strip()
  if isinstance(value, bool):
    return None
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  if isinstance(value, (float, np.floating)) and math.isfinite(value):
    return str(int(value)) if float(value).is_integer() else repr(float(value))
  return None


def _record(row: Any, fields: FieldMap, number: int, source: str) -> Record:
  """One row as a Record; raises ValueError("field 'x': problem") on a bad row."""
  if not isinstance(row, dict):
    raise ValueError(f"field (row): expected an object, got {type(row).__name__}")
  name, prompt = _first(row, fields.prompt)
  if prompt is _MISSING:
    raise ValueError(f"field {name}: missing")
  if not isinstance(prompt, str):
    raise ValueError(f"field {name!r}: expected a string, got {type(prompt).__name__}")
  if not prompt.strip():
    raise ValueError(f"field {name!r}: empty prompt")
  _check_encodable(name, prompt)
  name, raw = _first(row, fields.answer)
  if raw is _MISSING:
    raise ValueError(f"field {name}: missing")
  answer = answer_text(raw)
  if answer is None:
    raise ValueError(f"field {name!r}: expected a string or a number, got {type(raw).__name__}")
  if fields.answer_after is not None:
    if fields.answer_after not in answer:
      raise ValueError(f"field {name!r}: no {fields.answer_after!r} marker before the final answer")
    answer = answer.rsplit(fields.answer_after, 1)[1].strip().replace(",", "")
  if not answer:
    raise ValueError(f"field {name!r}: empty answer")
  _check_encodable(name, answer)
  id_name, id_value = _first(row, fields.id)
  if id_value is _MISSING:
    id_value = number
  elif isinstance(id_value, bool) or not isinstance(id_value, (str, int, np.integer)):
    raise ValueError(f"field {id_name!r}: expected a string or an integer id, got {type(id_value).__name__}")
  _, row_source = _first(row, fields.source)
  solution = None
  for path in fields.solution:
    if (value := _get(row, path)) is _MISSING or value is None:
      continue
    if not isinstance(value, str):
      raise ValueError(f"field {path!r}: expected a string solution, got {type(value).__name__}")
    _check_encodable(path, value)
    if value.strip():
      solution = value
      break
  _, level = _first(row, fields.level)
  return Record(prompt, answer, str(id_value), source if row_source is _MISSING else str(row_source),
                solution, level_number(level))


def level_number(value: Any) -> int | None:
  """A level as an integer: an int, or text ending in one ("Level 3"); else None (MATH's "Level ?": metadata)."""
  whole = isinstance(value, (str, int, np.integer)) and not isinstance(value, bool)
  return int(last) if whole and (last := str(value).strip().rsplit(" ", 1)[-1]).isdigit() else None


def _check_encodable(field: str, text: str) -> None:
  """A ValueError naming `field` where `text` holds what no tokenizer can encode: a lone UTF-16 surrogate
  (valid JSON as "\\ud83d", not a character)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"field {field!r}: a lone UTF-16 surrogate {text[e.start]!r} at character {e.start} "
                     "(half of an emoji or other character cut in two), not text a tokenizer can encode") from None


def load_records(path: str, *, schema: str = "auto", prompt_field: str | None = None,
                 answer_field: str | None = None, id_field: str | None = None,
                 skip_bad_rows: bool = False, dedup: bool = True, split: str = "train",
                 source: str | None = None, unique_ids: bool = False) -> list[Record]:
  """The problems in `path` (see the module docstring); with `unique_ids`, see `make_ids_unique`."""
  rows, unit = read_rows(path, split=split)
  source = source or (path[3:] if path.startswith("hf:") else f"{Path(path).parent.name}/{Path(path).stem}")
  records, numbers, bad, fields, total = [], [], [], None, 0
  for number, row in rows:
    total += 1
    try:
      if isinstance(row, Exception):
        raise row
      if fields is None:
        try:
          fields = field_map(row, schema=schema, prompt_field=prompt_field, answer_field=answer_field,
                             id_field=id_field)
        except ValueError as e:
          raise DataError(f"{path}: {e}; set the field paths (data.prompt_field, "
                          "data.answer_field)") from None
      records.append(_record(row, fields, number, source))
      numbers.append(number)
    except DataError:
      raise
    except ValueError as e:
      message = f"{path}, {unit} {number}, {e}"
      if not skip_bad_rows:
        raise DataError(message) from None
      bad.append(message)
  if bad:
    warnings.warn(f"{path}: skipped {len(bad)} bad {unit}s of {total}; first: {bad[0]}", stacklevel=2)
  if not records:
    raise DataError(f"{path}: empty dataset ({total} {unit}s, none valid)")
  if unique_ids:
    records = make_ids_unique(records, numbers, path=path, unit=unit)
  if dedup:
    records, _ = deduplicate(records)
  return records


def make_ids_unique(records: Sequence[Record], numbers: Sequence[int], *, path: str,
                    unit: str) -> list[Record]:
  """The records with every id that different problems share made `<id>@<unit><number>` (`7@line12`),
  with a warning; a problem repeated under its id stays (it is one problem: `deduplicate` keeps one).
  Held-out problems are matched to their responses by id, so one id must name one problem."""
  keys: dict[str, set[str]] = collections.defaultdict(set)
  for record in records:
    keys[record.id].add(problem_key(record.prompt))
  shared = {i for i, problems in keys.items() if len(problems) > 1}
  if not shared:
    return list(records)
  renamed = [r._replace(id=f"{r.id}@{unit}{n}") if r.id in shared else r for r, n in zip(records, numbers)]
  first = next(r.id for r in records if r.id in shared)
  lines = [n for r, n in zip(records, numbers) if r.id == first]
  warnings.warn(f"{path}: {len(shared)} id(s) name different problems, e.g. id {first!r} ({unit}s "
                f"{', '.join(map(str, lines))}); each such problem is now named by its {unit} "
                f"({', '.join(repr(f'{first}@{unit}{n}') for n in lines)}): give every problem its own id, "
                "or use those", stacklevel=2)
  return renamed


def kept_for_dropped(records: Sequence[Record], kept: Sequence[Record]) -> dict[str, Record]:
  """The id of every record of `records` that `deduplicate` left out of `kept` → the kept record of
  its problem (responses to a dropped duplicate belong to that problem)."""
  by_problem = {problem_key(r.prompt): r for r in kept}
  kept_ids = {r.id for r in kept}
  return {r.id: by_problem[problem_key(r.prompt)] for r in records
          if r.id not in kept_ids and problem_key(r.prompt) in by_problem}


class Conflict(NamedTuple):
  prompt: str  # The shared problem text.
  ids: tuple[str, ...]
  answers: tuple[str, ...]


def problem_key(prompt: str) -> str:
  """A problem's text as deduplication and the train/eval overlap compare it: whitespace normalised."""
  return " ".join(prompt.split())


def answer_key(answer: str) -> str:
  """An answer as deduplication and the train/eval overlap compare it: whitespace dropped, integers canonical."""
  compact = "".join(answer.split())
  return str(int(compact)) if compact.lstrip("+-").isdigit() else compact


def deduplicate(records: Sequence[Record], *, warn: bool = True) -> tuple[list[Record], list[Conflict]]:
  """Keeps the first record of each problem text (whitespace-normalised).

  Returns the kept records and the problems seen with different answers, which are warned about.
  """
  groups: dict[str, list[Record]] = collections.defaultdict(list)
  for record in records:
    groups[problem_key(record.prompt)].append(record)
  conflicts = [Conflict(group[0].prompt, tuple(r.id for r in group), tuple(r.answer for r in group))
               for group in groups.values() if len({answer_key(r.answer) for r in group}) > 1]
  if conflicts and warn:
    examples = "; ".join(f"ids {list(c.ids)} answers {list(c.answers)}" for c in conflicts[:3])
    warnings.warn(f"{len(conflicts)} problems appear with conflicting answers (the first row of each "
                  f"is kept): {examples}", stacklevel=2)
  return [group[0] for group in groups.values()], conflicts
