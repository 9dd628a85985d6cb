"""Typed configs to and from plain data: ``--set key.sub=value`` overrides and dicts read from files.

Every key is checked against the dataclass fields, and every value against the field's type; an error
names the key and lists the valid keys with their current values.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, get_args, get_origin

from hpcdl.errors import ConfigError


def to_dict(obj) -> dict:
    """A dataclass as JSON-ready data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(obj)))


def flatten(data: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; mappings are walked, lists and scalars are values."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def from_dict(cls, data: dict, where: str = "config"):
    """Build ``cls`` from ``data``, coercing each value to its field's type; nested dataclasses recurse."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(sorted(fields))}")
    required = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in data
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        key = f"{where}.{required[0]}".removeprefix("config.")
        place = "at the top level" if where == "config" else f"under {where.removeprefix('config.')}:"
        raise ConfigError(f"{key} is not set and has no default: add '{required[0]}: VALUE' {place}, or start from a "
                          "preset ('preset: NAME' in a YAML file; hpcdl presets lists them)")
    return cls(**{k: coerce(hints[k], v, f"{where}.{k}") for k, v in data.items()})


def coerce(tp, value, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(arg, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not a {_name(tp)}")
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: {value!r} is not a list")
        kinds = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(items):
            raise ConfigError(f"{where}: {value!r} needs {len(kinds)} items")
        return tuple(coerce(k, v, f"{where}[{i}]") for i, (k, v) in enumerate(zip(kinds, items)))
    return _scalar(tp, value, where)


def _scalar(tp, value, where: str):
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    elif tp is int and not isinstance(value, bool):
        if isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit()):
            return int(value)
    elif tp is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif tp is str and isinstance(value, str):
        return value
    elif tp in (Any, dict, list):
        return value
    raise ConfigError(f"{where}: {value!r} is not a {_name(tp)}")


def _name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def apply_overrides(cfg, overrides: list[str], frozen: dict[str, str] | None = None):
    """A copy of ``cfg`` with each ``key.sub=value`` applied (value: JSON, else a plain string).

    ``frozen`` maps keys that may not be set to the reason (e.g. values derived from others).
    """
    data = to_dict(cfg)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write key=value, e.g. --set optimizer.lr=0.1")
        if frozen and key in frozen:
            raise ConfigError(f"--set {key}: {frozen[key]}")
        node, parts = data, key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[:depth]) or "the config"
                valid = ", ".join(f"{k}={v!r}" for k, v in node.items() if not isinstance(v, dict)) if isinstance(node, dict) else ""
                raise ConfigError(f"--set {key}: {where} has no key {part!r}; valid: {valid}")
            if depth == len(parts) - 1:
                node[part] = _parse(raw)
            node = node[part]
    return from_dict(type(cfg), data)


def _parse(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw
