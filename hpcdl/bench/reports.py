"""The benchmarks' reports, typed: each is a dataclass that its benchmark's ``run`` fills, the runner writes as
JSON (:func:`hpcdl.schema.to_dict`) and its readers take (the table, the plot, ``hpcdl plan``'s ``--*-json``
flags, read through :func:`hpcdl.schema.from_dict`), never indexed by string keys.

``bench allreduce``, ``bench scaling`` and ``bench step`` declare their whole report here. ``bench sync`` still
returns a plain dict; its class names only the fields ``hpcdl plan`` reads (a report may hold more).
A file that is not JSON, is the report of another benchmark, or lacks a field gets an error that names the
file, the field and the command that writes such a report.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from hpcdl.bench.configs import AllreduceBench, ScalingBench, StepBench
from hpcdl.errors import DataError
from hpcdl.schema import from_dict

__all__ = ["AllreduceReport", "Machine", "Provenance", "Report", "ScalingReport", "StepReport", "SyncReport"]


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


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport(Report):
    benchmark: typing.ClassVar[str] = "sync"
    model: str
    parameters: int
    hooks: dict[str, SyncHook]

    def hook_seconds_per_byte(self, hook: str, source: str = "the report") -> float:
        """The hook's own work per gradient byte: its sync time less the plain sync's scaled to the hook's
        wire bytes (the plain sync taken as all wire), at least 0."""
        for name in ("none", hook):
            if name not in self.hooks:
                raise DataError(f"{source}: hooks.{name} is missing; run hpcdl bench sync --hooks none,{hook} "
                                f"--json FILE")
        none, this = self.hooks["none"], self.hooks[hook]
        wire_s = none.ms * this.mb_sent / none.mb_sent / 1e3
        return max(0.0, this.ms / 1e3 - wire_s) / (self.parameters * 4)


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
    """fp32 against bf16 autocast (and torch.compile of auto's pick)."""

    threads: int
    memory_format: str
    flops_per_step: float
    cases: dict[str, PrecisionCase]  # fp32, bf16, and AUTO+compile where it ran
    bf16_emulated: bool
    rounds: int
    steps: int
    auto: str  # loop.precision=auto's pick here
    auto_why: str
    fastest: str
    auto_is_fastest: bool
    compile: Compiled | NotCompiled | None
    bf16_over_fp32: float


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
