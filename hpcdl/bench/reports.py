"""The benchmarks' reports, typed: each is a dataclass that its benchmark's ``run`` fills, the runner writes as
JSON (:func:`hpcdl.schema.to_dict`) and its readers take (the table, the plot, ``hpcdl plan``'s ``--*-json``
flags, read through :func:`hpcdl.schema.from_dict`), never indexed by string keys.

Every benchmark declares its whole report here (``hpcdl tune --measure``'s result, which is no report, is
typed in :mod:`hpcdl.bench.tune`).
A file that is not JSON, is the report of another benchmark, or lacks a field gets an error that names the
file, the field and the command that writes such a report.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from hpcdl.bench.configs import (AllreduceBench, DataBench, FeedBench, LargeBatchBench, OptimBench, PluginBench,
                                 ScalingBench, StartupBench, StepBench, SyncBench)
from hpcdl.errors import DataError
from hpcdl.schema import from_dict

__all__ = ["AllreduceReport", "DataReport", "FeedReport", "LargeBatchReport", "Machine", "OptimReport", "PluginReport",
           "Provenance", "Report", "ScalingReport", "StartupReport", "StepReport", "SyncReport"]


@dataclasses.dataclass(frozen=True, slots=True)
class Machine:
    cpu: str
    cores: int  # the CPUs this process may run on
    logical_cpus: int
    flags: tuple[str, ...]  # the ISA flags that matter (avx*, amx*, fma, sse4*)


@dataclasses.dataclass(frozen=True, slots=True)
class Provenance:
    """Where and how a report was measured (:func:`hpcdl.bench.runner.provenance`)."""

    command: tuple[str, ...]
    hpcdl: str
    commit: str | None
    machine: Machine
    host: str
    job_id: str | None
    time: str


class Report:
    """A benchmark report: ``benchmark`` names it; read one with :meth:`from_json` or :meth:`from_dict`."""

    benchmark: typing.ClassVar[str]

    @classmethod
    def from_json(cls, path: str):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: cannot read it as an hpcdl bench {cls.benchmark} report ({exc})") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data, source: str = "the report"):
        found = data.get("benchmark") or (data.get("meta") or {}).get("benchmark") if isinstance(data, dict) else None
        if found and found != cls.benchmark:
            raise DataError(f"{source}: this is an hpcdl bench {found} report; give the JSON of hpcdl bench "
                            f"{cls.benchmark} --json FILE")
        return from_dict(cls, data, "", error=DataError, strict=False, source=source,
                         fix=f"give the JSON of hpcdl bench {cls.benchmark} --json FILE (one from an older hpcdl: "
                             "measure it again)")


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
class OptimReport(Report):
    benchmark: typing.ClassVar[str] = "optim"
    parameters: int
    threads: int
    ms_per_step: dict[str, float]  # medians per optimizer
    ratio_to_sgd: dict[str, float]
    rounds_ms: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    config: OptimBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


@dataclasses.dataclass(frozen=True, slots=True)
class LargeBatchRow:
    recipe: str
    batch: int
    steps_per_epoch: int
    peak_lr: float
    warmup_epochs: float
    accuracy: tuple[float, ...]  # validation %, one per seed
    mean: float
    stdev: float


@dataclasses.dataclass(frozen=True, slots=True)
class LargeBatchReport(Report):
    benchmark: typing.ClassVar[str] = "large-batch"
    train_images: int
    val_images: int
    rows: tuple[LargeBatchRow, ...]  # the small-batch baseline first
    gap_to_small_batch: dict[str, float]  # points of mean accuracy, per large-batch recipe
    config: LargeBatchBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


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


@dataclasses.dataclass(frozen=True, slots=True)
class PrecisionCase:
    ms_per_step: float
    images_per_s: float
    gflops: float  # counted FLOPs over the step's time
    gemm_gflops: float  # the same threads' GEMM rate in that precision
    of_gemm: float  # gflops / gemm_gflops


@dataclasses.dataclass(frozen=True, slots=True)
class Compiled:
    first_step_s: float  # the compiling step


@dataclasses.dataclass(frozen=True, slots=True)
class NotCompiled:
    error: str  # why torch.compile did not run here


@dataclasses.dataclass(frozen=True, slots=True)
class StepPrecision:
    """fp32 against bf16 autocast (and torch.compile of auto's pick, and auto's pick without channels_last)."""

    threads: int
    memory_format: str
    flops_per_step: float
    cases: dict[str, PrecisionCase]  # fp32, bf16, AUTO contiguous, and AUTO+compile where it ran
    bf16_emulated: bool
    rounds: int
    steps: int
    auto: str  # loop.precision=auto's pick here
    auto_why: str
    fastest: str
    auto_is_fastest: bool
    compile: Compiled | NotCompiled | None
    bf16_over_fp32: float
    channels_last_over_contiguous: float | None = None  # auto's pick: channels_last's speed over contiguous's


@dataclasses.dataclass(frozen=True, slots=True)
class StepOverhead:
    """hpcdl's step against a bare loop."""

    threads: int
    ms_per_step: dict[str, float]  # the medians: "bare loop", "hpcdl"
    rounds_ms: dict[str, tuple[float, ...]]
    ratio: float  # hpcdl / bare loop


@dataclasses.dataclass(frozen=True, slots=True)
class NodeRound:
    images_per_s: float  # the node's: its ranks' sum
    threads: int
    allocator: str
    peak_rss_mb: float  # the sum of the ranks' peaks


@dataclasses.dataclass(frozen=True, slots=True)
class RankSetup:
    threads: int
    allocator: str


@dataclasses.dataclass(frozen=True, slots=True)
class StepTuning:
    images_per_s: dict[str, float]  # medians: "tuned", "untuned"
    runs: dict[str, tuple[NodeRound, ...]] = dataclasses.field(default_factory=dict)
    ratio: float = 0.0  # tuned / untuned
    setup: dict[str, RankSetup] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class StepCurve:
    points: tuple[tuple[float, ...], ...]  # (the node's batch, images/s)
    runs: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)  # per-rank batch -> each round's


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport(Report):
    benchmark: typing.ClassVar[str] = "step"
    config: StepBench
    precision: StepPrecision | None = None
    overhead: StepOverhead | None = None
    tuning: StepTuning | None = None
    curve: StepCurve | None = None
    provenance: Provenance | None = None  # filled by the runner


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingMeta:
    ranks_per_node: int
    gradient_bytes: float
    model: str = ""
    crop: int = 0
    backend: str = ""
    hook: str = "none"
    world_size: int = 1
    nodes: int = 1
    threads: int = 1  # per rank
    steps: int = 0  # timed, per round
    warmup: int = 0
    rounds: int = 1
    torch: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class StepTimes:  # ms
    mean: float
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Phases:  # ms, each step's mean (hpcdl.train.step.PHASES)
    forward: float
    backward: float
    optimizer: float
    comm_wait: float
    data: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingPoint:
    mode: str  # weak or strong
    ranks: int
    nodes: int
    batch_per_rank: int
    global_batch: int
    images_per_s: float
    step_ms: StepTimes
    phases_ms: Phases
    steps: int = 0
    exposed_comm_share: float = 0.0  # the step's share spent waiting on gradients
    ideal_images_per_s: float = 0.0  # the fewest ranks' rate per rank, times the ranks
    efficiency: float = 0.0  # images_per_s / ideal_images_per_s


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingReport(Report):
    benchmark: typing.ClassVar[str] = "scaling"
    meta: ScalingMeta
    points: tuple[ScalingPoint, ...]
    config: ScalingBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner
