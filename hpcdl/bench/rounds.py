"""The one measuring loop every benchmark uses: warm-up, then rounds that alternate between the cases, then
the median of each case's rounds. Alternating spreads a shared machine's drift over every case alike, so
ratios between cases measured in one run hold where absolute figures wander."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, TypeVar

T = TypeVar("T")

__all__ = ["alternate", "medians", "timed_ms"]


def alternate(cases: Mapping[str, Callable[[], T]], rounds: int, *, warmup: int = 1,
              before: Callable[[], object] | None = None) -> dict[str, list[T]]:
    """Each case called ``warmup`` times untimed, then ``rounds`` rounds calling every case once in turn;
    ``before`` runs ahead of every call (a barrier, a new epoch). Returns each case's results in order."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[T]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            if before is not None:
                before()
            out[name].append(fn())
    return out


def timed_ms(fn: Callable[[], object], repeat: int = 1) -> Callable[[], float]:
    """A case that calls ``fn`` ``repeat`` times and returns the milliseconds per call."""
    def case() -> float:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1e3

    return case


def medians(results: Mapping[str, list], key: Callable | None = None) -> dict[str, float]:
    """The median of each case's rounds (of ``key(result)`` when given)."""
    return {name: statistics.median(key(r) for r in values) if key else statistics.median(values)
            for name, values in results.items()}
