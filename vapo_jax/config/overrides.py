"""Command-line overrides of any config field: `algo.eps_high=0.3 rollout.top_p=0.9`.

Field paths and value types come from the dataclasses themselves, so nothing is declared twice.
Unknown fields and values that do not parse as the field's type are errors naming the field.
"""

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from vapo_jax.errors import ConfigError

_NONE = ("none", "null")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _parse(text: str, annotation: Any, path: str) -> Any:
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    if type(None) in args and text.lower() in _NONE:
      return None
    errors = []
    for option in (a for a in args if a is not type(None)):
      try:
        return _parse(text, option, path)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError("; ".join(errors))
  if origin is Literal:
    if text not in args:
      raise ConfigError(f"{path} must be one of {list(args)}, got {text!r}")
    return text
  if origin is tuple:
    parts = [p for p in text.split(",") if p.strip()]
    return tuple(_parse(p.strip(), args[0], path) for p in parts)
  if annotation is bool:
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise ConfigError(f"{path} must be true or false, got {text!r}")
  if annotation in (int, float):
    try:
      return annotation(text)
    except ValueError:
      raise ConfigError(f"{path} must be {annotation.__name__}, got {text!r}") from None
  if annotation is str:
    return text
  raise ConfigError(f"{path} has type {annotation}, which cannot be set from the command line")


def field_paths(config: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
  """Every settable leaf `path -> (type, current value)`, in declaration order."""
  hints = typing.get_type_hints(type(config))
  paths = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      paths |= field_paths(value, f"{prefix}{field.name}.")
    else:
      paths[prefix + field.name] = (hints[field.name], value)
  return paths


def _replace(config: Any, changes: dict[str, Any], errors: list[str]) -> Any:
  """One `dataclasses.replace` per dataclass, with all of its changes at once (so fields that must
  change together, like `algo.estimator` and `algo.value_pretrain_steps`, validate together). A change
  that is refused adds its error to `errors` (the dataclass's own, with the values given, then each field's
  own range or type error found alone: never a cross-field error judged against the defaults) and leaves
  that dataclass as it was, so that every mistake of an override list is found in one pass; a dataclass
  holding a refused one is not checked as a whole (that would judge the defaults left in its place)."""
  before = len(errors)
  nested = {k: _replace(getattr(config, k), v, errors) for k, v in changes.items() if isinstance(v, dict)}
  flat = {k: v for k, v in changes.items() if not isinstance(v, dict)}
  together = None
  if len(errors) == before:  # With a part refused, the whole's cross-field checks would judge the defaults kept.
    try:
      return dataclasses.replace(config, **flat, **nested)
    except ConfigError as e:
      together = str(e)
  alone = []  # Each field alone on the defaults: its own errors (a range, a type), said beside the section's.
  for key, value in flat.items():
    try:
      dataclasses.replace(config, **{key: value})
    except ConfigError as e:
      if not e.cross_field:
        alone.append(str(e))
  errors.extend(dict.fromkeys(([together] if together else []) + alone))
  return config


def _raise(errors: list[str]) -> None:
  if len(errors) == 1:
    raise ConfigError(errors[0])
  if errors:
    raise ConfigError(f"{len(errors)} config errors: " + "; ".join(f"({i}) {e}" for i,
                                                                   e in enumerate(errors, 1)))


def replace_fields(config: Any, values: dict[str, Any], errors: list[str] | None = None) -> Any:
  """`config` with each dotted `field.path` set to its (typed) value, checked as a whole: the one
  override syntax, shared by the command line (`apply_overrides`) and the code (the memory
  what-if's variants). Unknown paths and refused values are one `ConfigError` naming every one of them
  (with `errors` given: added to it, for the caller to raise)."""
  known, found = field_paths(config), [] if errors is None else errors
  changes: dict[str, Any] = {}
  for key, value in values.items():
    if key not in known:
      close = difflib.get_close_matches(key, known, n=3)
      hint = f" (did you mean {', '.join(close)}?)" if close else ""
      found.append(f"unknown config field {key!r}{hint}; `--help` lists every field")
      continue
    *parents, leaf = key.split(".")
    node = changes
    for parent in parents:
      node = node.setdefault(parent, {})
    node[leaf] = value
  config = _replace(config, changes, found) if changes else config
  if errors is None:
    _raise(found)
  return config


def apply_overrides(config: Any, overrides: list[str]) -> Any:
  """Returns `config` with each `path=value` (a leading `--` is allowed) applied; later wins. Every
  malformed, unknown or refused override is reported together, in one `ConfigError`."""
  known, errors = field_paths(config), []
  values: dict[str, Any] = {}
  for item in overrides:
    key, sep, text = item.removeprefix("--").partition("=")
    key = key.replace("-", "_")
    if not sep:
      errors.append(f"override {item!r} is not of the form field.path=value")
      continue
    try:
      values[key] = _parse(text, known[key][0], key) if key in known else text
    except ConfigError as e:
      errors.append(str(e))
  config = replace_fields(config, values, errors)
  _raise(errors)
  return config
