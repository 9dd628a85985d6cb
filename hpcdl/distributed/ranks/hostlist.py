"""Slurm hostlist expressions: ``c[401-403,405],knl-[0001-0002]`` -> the host names, in Slurm's order."""

from __future__ import annotations

import itertools
import re

__all__ = ["HostlistError", "expand_hostlist"]

_GROUP = re.compile(r"\[([^\[\]]*)\]")


class HostlistError(ValueError):
    """A hostlist expression that Slurm would not accept."""


def expand_hostlist(expr: str) -> list[str]:
    """Expand a compressed Slurm hostlist.

    Commas outside brackets separate entries, commas inside separate ranges; ``lo-hi`` keeps the
    zero padding of ``lo``; several bracket groups in one entry expand as a product, the last group
    varying fastest (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2).
    """
    if not expr or not expr.strip():
        raise HostlistError("empty hostlist")
    hosts: list[str] = []
    for entry in _split_top_level(expr.strip(), expr):
        hosts.extend(_expand_entry(entry, expr))
    return hosts


def _split_top_level(text: str, expr: str) -> list[str]:
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' at position {i} in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unmatched ']' at position {i} in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in hostlist {expr!r}")
    entries.append(text[start:])
    if any(not e.strip() for e in entries):
        raise HostlistError(f"empty entry in hostlist {expr!r}")
    return [e.strip() for e in entries]


def _expand_entry(entry: str, expr: str) -> list[str]:
    pieces = _GROUP.split(entry)  # literal, group, literal, group, ..., literal
    choices = [[pieces[0]]]
    for k in range(1, len(pieces), 2):
        choices.append(_expand_ranges(pieces[k], expr))
        choices.append([pieces[k + 1]])
    return ["".join(parts) for parts in itertools.product(*choices)]


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"bad range {part!r} in hostlist {expr!r}: expected N or LO-HI")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise HostlistError(f"range {part!r} runs backwards in hostlist {expr!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out
