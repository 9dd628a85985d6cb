"""The communication benchmarks' reports: bench allreduce, sync and plugin."""

from __future__ import annotations

import dataclasses
import typing

from hpcdl.bench.configs import AllreduceBench, PluginBench, SyncBench
from hpcdl.bench.reports.base import Provenance, Report
from hpcdl.errors import DataError

__all__ = ["AllreduceMeta", "AllreduceReport", "AllreduceRow", "DDPPart", "NoFit", "Placement", "PluginImports",
           "PluginMeta", "PluginReport", "PluginRow", "PluginWorkerReport", "RingFit", "SyncFigures", "SyncHook",
           "SyncReport", "WeakScaling", "fit_ring"]


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceRow:
    bytes: int
    time_us: float  # the slowest rank's
    backend: str = ""
    elements: int = 0
    iters: int = 0
    min_time_us: float = 0.0  # the fastest rank's
    algbw_GBps: float = 0.0  # bytes / time
    busbw_GBps: float = 0.0  # algbw * 2(n-1)/n: what each rank's link carries in a ring
    correct: bool = True  # the untimed check's exact sum, on every rank


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceMeta:
    world_size: int
    backend: str = ""
    backends: tuple[str, ...] = ()  # side by side (--backends), else the one
    nodes: int = 1
    dtype: str = "float32"
    torch: str = ""
    job_id: str | None = None
    time: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank ran."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    launcher: str
    master_addr: str
    master_port: int
    threads: int
    allocator: str


@dataclasses.dataclass(frozen=True, slots=True)
class RingFit:
    """A backend's times fitted to a ring's alpha-beta cost."""

    latency_us: float  # alpha, per step
    busbw_GBps: float  # 1 / beta: the link's achieved rate


@dataclasses.dataclass(frozen=True, slots=True)
class NoFit:
    none: str  # why no fit (small messages only: latency and noise)


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceReport(Report):
    benchmark: typing.ClassVar[str] = "allreduce"
    meta: AllreduceMeta
    rows: tuple[AllreduceRow, ...]
    ranks: tuple[Placement, ...] = ()
    fit: dict[str, RingFit | NoFit] = dataclasses.field(default_factory=dict)  # per backend, with 2+ ranks and sizes
    config: AllreduceBench | None = None  # the command's flags, filled by the runner
    provenance: Provenance | None = None  # filled by the runner

    @property
    def backends(self) -> tuple[str, ...]:
        return self.meta.backends or (self.meta.backend,)

@dataclasses.dataclass(frozen=True, slots=True)
class SyncHook:
    ms: float  # median DDP sync of the gradient set
    mb_sent: float  # MiB each rank sends per step
    rounds_ms: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class DDPPart:
    ms: float  # median
    rounds_ms: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class WeakScaling:
    """Seconds per training step: rank 0 alone, every rank computing apart, every rank under DDP."""

    model: str
    batch_per_rank: int
    threads: int
    ranks: int
    rounds: int
    s_per_step_1: float
    s_per_step_apart: float
    s_per_step_n: float
    rounds_1: tuple[float, ...]
    rounds_apart: tuple[float, ...]
    rounds_n: tuple[float, ...]
    efficiency: float  # alone / DDP = node_share x sync_share
    node_share: float  # alone / apart
    sync_share: float  # apart / DDP


@dataclasses.dataclass(frozen=True, slots=True)
class SyncFigures:
    """One backend's figures of ``bench sync``."""

    model: str
    tensors: int
    parameters: int
    buckets: int
    world_size: int
    backend: str
    ms: dict[str, float]  # medians per exchange path
    latency_us: dict[str, float]  # the one-float all-reduce
    hooks: dict[str, SyncHook]
    fused_vs_flat: float = 0.0
    rounds_ms: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    ddp_parts: dict[str, DDPPart] = dataclasses.field(default_factory=dict)
    scaling: WeakScaling | None = None
    bucket_sweep: dict[str, float] = dataclasses.field(default_factory=dict)  # FIRST:CAP -> s per step

    def hook_seconds_per_byte(self, hook: str, source: str = "the report") -> float:
        """The hook's own work per gradient byte: its sync time less the plain sync's scaled to the hook's
        wire bytes (the plain sync taken as all wire), at least 0."""
        for name in ("none", hook):
            if name not in self.hooks:
                raise DataError(f"{source}: hooks.{name} of backend {self.backend} is missing; run hpcdl bench sync "
                                f"--hooks none,{hook} --json FILE")
        none, this = self.hooks["none"], self.hooks[hook]
        wire_s = none.ms * this.mb_sent / none.mb_sent / 1e3
        return max(0.0, this.ms / 1e3 - wire_s) / (self.parameters * 4)


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport(Report):
    benchmark: typing.ClassVar[str] = "sync"
    by_backend: dict[str, SyncFigures]  # one per backend, in the order of --backends (or the one --backend)
    config: SyncBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner

    def of(self, backend: str | None = None, source: str = "the report") -> SyncFigures:
        """``backend``'s figures (torch's name, as the report keys them), default the first backend's."""
        backend = backend or next(iter(self.by_backend))
        if backend not in self.by_backend:
            raise DataError(f"{source}: no figures of backend {backend!r}; it measured {', '.join(self.by_backend)}")
        return self.by_backend[backend]


@dataclasses.dataclass(frozen=True, slots=True)
class PluginImports:
    hpcdl_before_init: bool  # hpcdl in sys.modules before init_process_group: the path was not torch's alone
    hpcdl_after_init: bool  # ... once the groups exist: the entry points loaded it


@dataclasses.dataclass(frozen=True, slots=True)
class PluginWorkerReport:
    """What ``plugin_worker.py`` writes: its sweep, its torch threads, and when hpcdl was imported."""

    rows: tuple[AllreduceRow, ...]
    threads: int
    imports: PluginImports


@dataclasses.dataclass(frozen=True, slots=True)
class PluginRow(AllreduceRow):
    path: str = "hpcdl"  # hpcdl's start-up, or "plugin": torch's entry points


@dataclasses.dataclass(frozen=True, slots=True)
class PluginMeta:
    ranks: int
    launcher: str
    backends: tuple[str, ...]  # torch's names
    rounds: int
    threads: dict[str, int]  # per path: torch threads per rank


@dataclasses.dataclass(frozen=True, slots=True)
class PluginReport(Report):
    benchmark: typing.ClassVar[str] = "plugin"
    meta: PluginMeta
    plugin_imports: PluginImports
    rows: tuple[PluginRow, ...]  # the best of the rounds per (path, backend, size)
    ratio: dict[str, float]  # per backend: plugin / hpcdl time, geometric mean over sizes
    config: PluginBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


def fit_ring(world_size: int, points: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, beta) of a ring all-reduce of ``world_size`` ranks that best explain ``points`` (bytes, seconds):
    ``t = 2(p-1) alpha + 2(p-1)/p n beta``, least squares on the relative error, so that every size counts.
    ``1 / beta`` is the bus bandwidth: the rate each rank's link achieved."""
    p = world_size
    points = [(n, t) for n, t in points if t > 0]
    if p < 2 or len(points) < 2:
        raise DataError(f"an all-reduce report of {p} rank(s) and {len(points)} sizes cannot give a link; run "
                        f"hpcdl bench allreduce on 2 or more ranks")
    # t / t = 1 = a * x1 + b * x2 with x1 = 2(p-1)/t, x2 = 2(p-1)/p * n / t: solve the 2x2 normal equations
    x1 = [2 * (p - 1) / t for _, t in points]
    x2 = [2 * (p - 1) / p * n / t for n, t in points]
    s11, s12, s22 = sum(a * a for a in x1), sum(a * b for a, b in zip(x1, x2)), sum(b * b for b in x2)
    det = s11 * s22 - s12 * s12
    alpha = (s22 * sum(x1) - s12 * sum(x2)) / det
    beta = (s11 * sum(x2) - s12 * sum(x1)) / det
    if beta <= 0:
        raise DataError("the all-reduce report's times do not grow with size; measure up to larger --max-bytes")
    return max(alpha, 0.0), beta
