"""Command-line flags derived from a config dataclass: the dataclass is the one source of each flag.

Each field becomes ``--field-name``: its type from the annotation, its default from the field, its help
from the comment on the field's line (or the comment lines just above it). A nested dataclass field
contributes its own fields' flags. Field metadata, rarely needed, adjusts one flag:

- ``flag``: another spelling (``--json`` for ``json_path``);
- ``positional``: an argument without dashes (``nargs='?'`` when the field has a default);
- ``remainder``: a positional that takes every argument after it (``-- COMMAND ...``);
- ``repeat``: the flag may be given several times and collects a tuple (``--set``);
- ``choices``: the names argparse offers (the config still checks them itself);
- ``metavar``, ``hidden``;
- ``old_flag``: a former spelling, still accepted with a warning that names the new one.

:func:`config_from_args` builds the dataclass back from the parsed arguments through :mod:`hpcdl.schema`, so
the config's own ``__post_init__`` checks every value, from the command line as from Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any, get_args, get_origin

from hpcdl.schema import from_dict

__all__ = ["add_flags", "config_from_args", "field_help", "flag_defaults", "meta"]


def meta(*, flag: str | None = None, positional: bool = False, remainder: bool = False, repeat: bool = False,
         choices=None, metavar: str | None = None, hidden: bool = False, old_flag: str | None = None) -> dict:
    """Field metadata for :func:`add_flags`: ``field(default=..., metadata=meta(flag="--json"))``."""
    out = {"flag": flag, "positional": positional or remainder, "remainder": remainder, "repeat": repeat,
           "choices": choices, "metavar": metavar, "hidden": hidden, "old_flag": old_flag}
    return {"cli": {k: v for k, v in out.items() if v}}


@functools.cache
def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError:
        return []


@functools.cache
def field_help(cls) -> dict[str, str]:
    """Each field's help: the comment on its line, else the comment lines right above it."""
    lines = _lines(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")
    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*class {cls.__name__}\b", line)), None)
    if start is None:
        return {}
    indent, end = len(lines[start]) - len(lines[start].lstrip()), start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].lstrip().startswith("#")
                                or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    body = textwrap.dedent("\n".join(lines[start:end])) + "\n"
    try:  # the class's own lines only: comments are told from '#' in strings by tokenizing them
        comments = {t.start[0] - 1: t.string.lstrip("#").strip()
                    for t in tokenize.generate_tokens(io.StringIO(body).readline) if t.type == tokenize.COMMENT}
    except (SyntaxError, tokenize.TokenError):
        return {}
    block, out = body.splitlines(), {}
    for i, line in enumerate(block):
        match = re.match(r"\s+(\w+)\s*:", line)
        if not match or match.group(1) in out or line.lstrip().startswith("#"):
            continue
        text, above, row = comments.get(i), [], i - 1
        while not text and row >= 0 and block[row].lstrip().startswith("#"):
            above.insert(0, comments.get(row, ""))
            row -= 1
        out[match.group(1)] = text or " ".join(above)
    return out


def _leaves(cls, prefix: tuple[str, ...] = ()):
    """(path, field, type) of every init field; nested dataclasses are walked."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, (*prefix, f.name))
        else:
            yield (*prefix, f.name), f, tp, cls


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _without_none(tp):
    """``X | None`` -> ``X``; a union of several types is read as a string that the config parses itself."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return str if str in args or len(args) > 1 else args[0]
    return tp


def _items(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {kind.__name__} values separated by commas") from None

    parse.__name__ = f"{kind.__name__} list"
    return parse


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def flag_name(path: tuple[str, ...], f: dataclasses.Field) -> str:
    return f.metadata.get("cli", {}).get("flag") or "--" + path[-1].replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = ()) -> None:
    """Add one argument per field of ``cls`` (nested dataclasses flattened) to ``parser``."""
    for path, f, tp, owner in _leaves(cls):
        if path[-1] not in skip:
            name, kw = _argument(path, f, tp, field_help(owner).get(f.name, ""))
            old = f.metadata.get("cli", {}).get("old_flag")
            if old:
                kw["action"] = functools.partial(_OldSpelling, old=old)
            parser.add_argument(name, *([old] if old else []), **kw)


class _OldSpelling(argparse.Action):
    """Stores the value; given under its former spelling, also warns with the new one."""

    def __init__(self, option_strings, dest, old: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.old = old

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.old:
            print(f"warning: {self.old} is now {self.option_strings[0]}; {self.old} goes in the next release",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def _argument(path: tuple[str, ...], f: dataclasses.Field, tp, text: str) -> tuple[str, dict]:
    """The name or flag and ``add_argument``'s keywords for one field."""
    opts, default, kind = f.metadata.get("cli", {}), _default(f), _without_none(tp)
    kw: dict[str, Any] = {"dest": "__".join(path), "choices": opts.get("choices"),
                          "metavar": opts.get("metavar") or (None if opts.get("choices") else path[-1].upper())}
    if get_origin(kind) is tuple:
        item = get_args(kind)[0] if get_args(kind) else str
        kw |= {"type": item, "action": "append"} if opts.get("repeat") else {"type": _items(item)}
    elif kind is bool:
        kw |= {"action": argparse.BooleanOptionalAction if default is True else "store_true", "metavar": None}
    else:
        kw["type"] = kind if kind in (int, float, str) else str
    if default not in (dataclasses.MISSING, None, ()) and kind is not bool and "default" not in text:
        text = f"{text} (default: {_shown(default)})" if text else f"default: {_shown(default)}"
    kw["help"] = argparse.SUPPRESS if opts.get("hidden") else text.replace("%", "%%")
    missing = default is dataclasses.MISSING
    if opts.get("positional"):
        del kw["dest"]  # a positional is stored under its own name
        if opts.get("remainder"):
            kw |= {"type": None, "nargs": argparse.REMAINDER}
        else:
            kw["nargs"] = None if missing else "?"
        return path[-1], {k: v for k, v in kw.items() if v is not None} | {"default": None if missing else default}
    kw |= {"required": missing, "default": None if missing or opts.get("repeat") else default}
    return flag_name(path, f), {k: v for k, v in kw.items() if v is not None or k == "default"}


def config_from_args(cls, args: argparse.Namespace):
    """``cls`` built from the flags :func:`add_flags` added, through :func:`hpcdl.schema.from_dict`: the same
    rules for unions, tuples and bools as a YAML file or ``--set``."""
    return from_dict(cls, _nested(cls, vars(args), ()), "")


def _nested(cls, values: dict, prefix: tuple[str, ...]) -> dict:
    """The parsed flags as the nested mapping of ``cls``'s fields (those given or with an argparse default)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _nested(hints[f.name], values, path)
        elif "__".join(path) in values:
            value = values["__".join(path)]
            out[f.name] = list(value or ()) if f.metadata.get("cli", {}).get("repeat") else value
        elif f.name in values:  # a positional argument keeps its own name
            out[f.name] = values[f.name]
    return out


def flag_defaults(cls) -> dict[str, Any]:
    """``{flag: default}`` as the dataclass gives them (tests compare the parser's with these)."""
    return {flag_name(path, f): _default(f) for path, f, _, _ in _leaves(cls)
            if not f.metadata.get("cli", {}).get("positional")}
