"""bench startup's report: each job size's phases and counts, their fits against N, the store's capacity."""

from __future__ import annotations

import dataclasses
import typing

from hpcdl.bench.configs import StartupBench
from hpcdl.bench.reports.base import Provenance, Report
from hpcdl.errors import DataError

__all__ = ["CountFit", "StartupReport", "StartupRow", "StoreCapacity"]


@dataclasses.dataclass(frozen=True, slots=True)
class StartupRow:
    """One launch of N ranks (``leg``: start, from nothing; restart, from the start's checkpoint)."""

    ranks: int
    leg: str
    phases_s: dict[str, float]  # phase -> the slowest rank's time in it
    total_s: float  # the slowest rank's process start to first step
    files_per_rank: dict[str, float]  # root (python, training data, run folder, ...) -> files opened, mean over ranks
    bytes_per_rank: dict[str, float]  # the same, bytes
    run_folder_bytes: int  # bytes read under the run folder, summed over the ranks (the checkpoint at restart)
    checkpoint_bytes: int  # the checkpoint's size (0 at start)
    store_connections: int  # connections to rank 0's store, summed over the ranks
    store_rendezvous_requests: int  # requests rank 0's store served for the groups' rendezvous, all ranks
    store_requests_after_startup: int  # requests besides the heartbeat from the first step to the run's end, all ranks
    heartbeat_per_rank_per_s: float | None  # the heartbeat's requests per second per rank (None: under 2 beats)


@dataclasses.dataclass(frozen=True, slots=True)
class CountFit:
    """``count = intercept + slope * N`` by least squares over the job sizes (N: ranks)."""

    count: str
    intercept: float
    slope: float


@dataclasses.dataclass(frozen=True, slots=True)
class StoreCapacity:
    """What one TCPStore server served, measured in one process: requests per second with ``clients``
    connections open, ``threads`` of them sending."""

    clients: int
    threads: int
    requests_per_s: float
    heartbeat_s: float
    heartbeat_load: float  # requests per second the heartbeat of ``clients`` ranks sends, over the capacity


@dataclasses.dataclass(frozen=True, slots=True)
class StartupReport(Report):
    benchmark: typing.ClassVar[str] = "startup"
    rows: tuple[StartupRow, ...]
    fits: tuple[CountFit, ...]
    store: StoreCapacity | None
    config: StartupBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner

    def fit(self, count: str, source: str = "the report") -> CountFit:
        for f in self.fits:
            if f.count == count:
                return f
        raise DataError(f"{source}: no fit of {count!r} (it has {', '.join(f.count for f in self.fits)}); "
                        "rerun hpcdl bench startup")
