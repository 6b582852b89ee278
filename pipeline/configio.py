"""YAML <-> typed dataclass configs, with `--set a.b=value` overrides.

Every config in the project is a (possibly nested) dataclass that validates itself in
``__post_init__``. This module only maps plain data onto those dataclasses: unknown keys,
wrong types and bad override syntax become one-line ``ConfigError``s naming the field.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

from arr_coc._validate import ConfigError, check_int

T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursing into nested dataclass fields."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]}; known keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}.{name}" if prefix else name)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_qualify(str(e), prefix)) from None


def _qualify(message: str, prefix: str) -> str:
    """Name the field by its full dotted path: 'attending.x=..' inside 'model.attending' -> 'model.attending.x=..'."""
    if not prefix or message.startswith(prefix):
        return message
    last = prefix.rsplit(".", 1)[-1]
    if message.startswith(last + "."):
        return prefix[: len(prefix) - len(last)] + message
    return f"{prefix}: {message}"


YAML_FALSE, YAML_TRUE = ("off", "no", "false"), ("on", "yes", "true")


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, name)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and value not in allowed:
            # YAML 1.1 reads off/no/false (on/yes/true) as booleans: back to the word a choice spells
            words = [w for w in (YAML_FALSE if value is False else YAML_TRUE) if w in allowed]
            value = words[0] if words else value
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{name} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        return origin(_coerce(item, v, f"{name}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            return float(value)        # YAML 1.1 reads 5e-4 (no dot) as a string; users write it so
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        check_int(name, value)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), for YAML and store attrs."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to nested plain data; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        set_value(data, key.strip(), value, f"--set {key.strip()}")
    return data


def set_value(data: dict[str, Any], key: str, value: Any, where: str | None = None) -> dict[str, Any]:
    """Set the dotted `key` (e.g. model.attending.retention) of nested plain data to `value`;
    `where` names the setting in errors (default: the key)."""
    where = key if where is None else where
    if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"config keys are dotted names such as model.attending.retention, got {key!r}")
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {p} is not a section")
        node = child
    node[parts[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                values: Mapping[str, Any] | None = None) -> T:
    """Defaults of ``cls`` <- YAML file <- ``--set`` strings <- ``values`` ({dotted key: value},
    the Python API's overrides: values are taken as they are, not parsed), validated."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            first = str(e).splitlines()[0] if str(e) else "parse error"
            raise ConfigError(f"config file {path} is not valid YAML: {first}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    apply_overrides(data, overrides or [])
    for key, value in (values or {}).items():
        set_value(data, key, value)
    return from_mapping(cls, data)
