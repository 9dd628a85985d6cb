"""The data benchmarks' reports: bench feed and data."""

from __future__ import annotations

import dataclasses
import typing

from hpcdl.bench.configs import DataBench, FeedBench
from hpcdl.bench.reports.base import Provenance, Report

__all__ = ["DataReport", "FeedReport", "FeedRow", "FeedRun", "ReaderRow", "RecipeRates"]


@dataclasses.dataclass(frozen=True, slots=True)
class FeedRun:
    images_per_s: float  # the median of the run's steps after the warm-up
    data_share: float  # the median share of a step spent waiting on data
    loader: str = ""  # rank 0's loader sizing line


@dataclasses.dataclass(frozen=True, slots=True)
class FeedRow:
    layout: str  # RANKSxTHREADS on this node
    precision: str
    images_per_s: dict[str, float]  # medians: "jpeg", "memory"
    ratio: float  # jpeg / memory
    data_share: float  # the last jpeg run's
    loader: str  # the last jpeg run's
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
