"""The data benchmarks' reports: bench feed, data and data-path."""

from __future__ import annotations

import dataclasses
import typing

from hpcdl.bench.configs import DataBench, DataPathBench, FeedBench
from hpcdl.bench.reports.base import Provenance, Report

__all__ = ["DataPathReport", "DataReport", "FeedReport", "FeedRow", "FeedRun", "PathEpoch", "ReaderRow", "RecipeRates"]


@dataclasses.dataclass(frozen=True, slots=True)
class FeedRun:
    images_per_s: float  # the median of the run's steps after the warm-up
    data_share: float  # the median share of a step spent waiting on data
    loader: str = ""  # rank 0's loader sizing line


@dataclasses.dataclass(frozen=True, slots=True)
class FeedRow:
    layout: str  # RANKSxTHREADS on this node
    precision: str
    images_per_s: dict[str, float]  # medians: "memory", and "jpeg, N workers" for each of --workers
    ratios: dict[str, float]  # each jpeg case / memory
    data_share: dict[str, float]  # each jpeg case's last run's
    loader: str  # the last run's of the jpeg case with the most workers
    runs: dict[str, tuple[FeedRun, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class FeedReport(Report):
    benchmark: typing.ClassVar[str] = "feed"
    rows: tuple[FeedRow, ...]
    config: FeedBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


@dataclasses.dataclass(frozen=True, slots=True)
class ReaderRow:
    reader: str
    images_per_s_per_worker: float
    files_opened_per_epoch: int  # the first round's, in fresh processes
    files_opened_next_epochs: int
    rounds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class RecipeRates:
    recipe: str  # the recipe expanded
    spec: str  # as given to --recipes
    images_per_s_per_core: dict[str, float]  # per decode path
    fastest: str
    default: str  # data.decoder's default
    default_over_fastest: float


@dataclasses.dataclass(frozen=True, slots=True)
class DataReport(Report):
    benchmark: typing.ClassVar[str] = "data"
    images_packed: int
    images_source: int
    shards: int
    rows: tuple[ReaderRow, ...]
    ratios: dict[str, float]
    decoders: dict[str, float]  # images/s on one core, whole-image decode
    fastest_decoder: str
    recipes: tuple[RecipeRates, ...]
    per_core_images: int
    config: DataBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


@dataclasses.dataclass(frozen=True, slots=True)
class PathEpoch:
    """One epoch of one path (``epoch`` -1: the stage path's copy to node-local disk)."""

    path: str  # direct, stage or cache
    epoch: int
    seconds: float  # the slowest rank's
    images: int  # every rank's
    node_images_per_s: tuple[float, ...]  # each node: its ranks' images over its slowest rank's seconds
    opens: tuple[int, ...]  # each node: files under --data opened (its ranks, their loader workers, its agent)
    fs_bytes: int | None  # what the filesystem served meanwhile (--fs-counter's difference); None without one
    source_bytes: int  # cache: what the agents read from the filesystem (their count); the copies' bytes for stage
    peer_bytes: int  # cache: what the agents fetched from other nodes' agents
    local_hits: int  # cache: samples the agents answered from their node's own copies (kept or prefetched)


@dataclasses.dataclass(frozen=True, slots=True)
class DataPathReport(Report):
    benchmark: typing.ClassVar[str] = "data-path"
    nodes: int
    ranks: int
    images: int  # the dataset's
    shards: int
    dataset_bytes: int  # its shards' bytes (the manifest's)
    rows: tuple[PathEpoch, ...]
    ratios: dict[str, float]
    config: DataPathBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner
