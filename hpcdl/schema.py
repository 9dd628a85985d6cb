"""Dataclasses to and from plain data, with one set of rules: the run config from YAML and ``--set key.sub=value``,
a command's flags (:func:`hpcdl.flags.config_from_args`), and the benchmarks' JSON reports
(:mod:`hpcdl.bench.reports`).

Every key is checked against the dataclass fields, and every value against the field's type: a union takes
the first of its types that the value fits, a tuple takes a list (or ``a,b`` from ``--set``), a dict's values
are of its value type, a section with a ``name`` takes a string as its name (``model: resnet50``; ``--set
model=NAME`` keeps the section's other keys), a bool is true or false (never 1), an int is whole, a float
finite. An error names the key and says what to write; a config lists the valid keys, a report the command
that writes one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, get_args, get_origin

from hpcdl.errors import ConfigError

__all__ = ["apply_overrides", "flatten", "from_dict", "to_dict"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Rules:
    """What differs between readers: the error raised, whether unknown keys are refused (a config) or left for
    a newer reader (a report), the file named first and the fix appended to every message."""

    error: type[Exception] = ConfigError
    strict: bool = True
    fix: str = ""
    source: str = ""

    def fail(self, message: str) -> Exception:
        message = f"{self.source}: {message}" if self.source else message
        return self.error(f"{message}; {self.fix}" if self.fix else message)


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


def from_dict(cls, data: dict, where: str = "config", *, error: type[Exception] = ConfigError, strict: bool = True,
              fix: str = "", source: str = ""):
    """Build ``cls`` from ``data``, coercing each value to its field's type; nested dataclasses recurse.
    ``error``, ``strict``, ``fix`` and ``source``: see :class:`_Rules` (the defaults are a config's)."""
    return _build(cls, data, where, _Rules(error, strict, fix, source))


def _build(cls, data, where: str, rules: _Rules):
    if not isinstance(data, dict):
        raise rules.fail(f"{_key(where)}: expected a mapping of {cls.__name__} fields ({', '.join(_fields(cls))}), "
                         f"got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = set(_fields(cls))
    unknown = sorted(set(data) - fields)
    if unknown and rules.strict:
        raise rules.fail(f"{_key(where)}: unknown keys {unknown}; valid keys: {', '.join(sorted(fields))}")
    required = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in data
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required and rules.error is not ConfigError:
        raise rules.fail(f"{_key(f'{where}.{required[0]}')} is missing")
    if required:
        key = f"{where}.{required[0]}".removeprefix("config.")
        place = "at the top level" if where == "config" else f"under {where.removeprefix('config.')}:"
        raise ConfigError(f"{key} is not set and has no default: add '{required[0]}: VALUE' {place}, or start from a "
                          "preset ('preset: NAME' in a YAML file; hpcdl presets lists them)")
    return cls(**{k: _coerce(hints[k], v, f"{where}.{k}", rules) for k, v in data.items() if k in fields})


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _coerce(tp, value, where: str, rules: _Rules) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and "name" in _fields(tp):  # a section given a string: its name (model: resnet50)
            value = {"name": value}
        return _build(tp, value, where, rules)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where, rules)
            except rules.error:
                continue
        raise rules.fail(f"{_key(where)}: {value!r} is not {_name(tp)}; write {_example(tp)}")
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise rules.fail(f"{_key(where)}: {value!r} is not a list; write a list such as [a, b] (or a,b in --set)")
        kinds = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(items):
            raise rules.fail(f"{_key(where)}: {value!r} needs {len(kinds)} items, such as "
                             f"[{', '.join(_example(k).split(' such as ')[-1] for k in kinds)}]")
        return tuple(_coerce(k, v, f"{where}[{i}]", rules) for i, (k, v) in enumerate(zip(kinds, items)))
    if origin is dict and args:
        if not isinstance(value, dict):
            raise rules.fail(f"{_key(where)}: {value!r} is not a mapping")
        return {k: _coerce(args[1], v, f"{where}.{k}", rules) for k, v in value.items()}
    return _scalar(tp, value, where, rules)


def _scalar(tp, value, where: str, rules: _Rules):
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
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            number = None
        if number is not None and math.isfinite(number):
            return number
    elif tp is str and isinstance(value, str):
        return value
    elif tp in (Any, dict, list):
        return value
    raise rules.fail(f"{_key(where)}: {value!r} is not {_name(tp)}; write {_example(tp)}")


def _key(where: str) -> str:
    return where.removeprefix("config.").removeprefix(".")


def _name(tp) -> str:
    """``int`` -> 'an int'; ``float | None`` -> 'a float or null'."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_name(a) if a is not type(None) else "null" for a in get_args(tp))
    name = getattr(tp, "__name__", str(tp))
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _example(tp) -> str:
    """What to write for a value of type ``tp``."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_example(a) if a is not type(None) else "null" for a in get_args(tp))
    return {bool: "true or false", int: "a whole number such as 8", float: "a number such as 0.1",
            str: "a string such as 'name'"}.get(tp, f"a {getattr(tp, '__name__', tp)}")


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
                value = _parse(raw)
                if isinstance(node[part], dict) and "name" in node[part] and not isinstance(value, dict):
                    node[part]["name"] = value  # --set model=NAME names the model and keeps model.weights
                else:
                    node[part] = value
            node = node[part]
    return from_dict(type(cfg), data)


def _parse(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw
