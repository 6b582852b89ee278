"""Validation helpers shared by every config dataclass (errors name field, value and allowed range)."""
from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A configuration value is out of range or of the wrong kind. The message is one line."""


def check_range(name: str, value: float, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ConfigError unless lo <= value <= hi (open ends with lo_open / hi_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value != value:   # NaN compares false with every bound, so it would pass any range
        raise ConfigError(f"{name} must be a number, got nan")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        left = "-inf" if lo is None else f"{lo}"
        right = "inf" if hi is None else f"{hi}"
        interval = f"{'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
        raise ConfigError(f"{name}={value!r} is out of range; allowed: {interval}")


def check_int(name: str, value: Any) -> None:
    """Raise ConfigError unless value is an integer (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ConfigError unless value is one of allowed."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")
