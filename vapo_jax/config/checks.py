"""Validation of config fields: each failure is one `ConfigError` naming the class, the field, what it
must be and the value it got (`AlgoConfig.eps_low must be in [0.0, 1.0), got 1.5`)."""

import dataclasses

from vapo_jax.errors import ConfigError

frozen = dataclasses.dataclass(frozen=True, kw_only=True)


def require(ok: bool, owner: object, field: str, message: str, value: object, *,
            cross_field: bool = False) -> None:
  """`cross_field`: the check reads other fields too (their values may be the defaults, not the user's)."""
  if not ok:
    raise ConfigError(f"{type(owner).__name__}.{field} {message}, got {value!r}", cross_field=cross_field)


def in_range(owner, field: str, lo: float, hi: float, *, lo_open=False, hi_open=False) -> None:
  value = getattr(owner, field)
  above = value > lo if lo_open else value >= lo
  below = value < hi if hi_open else value <= hi
  interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
  require(above and below, owner, field, f"must be in {interval}", value)


INT32_MAX = 2**31 - 1  # The programs count in int32 (decode steps, tokens, pages, seeds' folds).


def positive_int(owner, field: str, *, allow_zero: bool = False) -> None:
  """An integer in [1, 2³¹ − 1] ([0, ...] with `allow_zero`): the range the device programs' int32 counters hold."""
  value = getattr(owner, field)
  ok = isinstance(value, int) and not isinstance(value,
                                                 bool) and (0 if allow_zero else 1) <= value <= INT32_MAX
  require(ok, owner, field, f"must be an integer in [{0 if allow_zero else 1}, {INT32_MAX}]", value)
