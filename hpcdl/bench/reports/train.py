"""The training benchmarks' reports: bench optim, large-batch, step and scaling."""

from __future__ import annotations

import dataclasses
import typing

from hpcdl.bench.configs import LargeBatchBench, OptimBench, OptimShardBench, ScalingBench, StepBench
from hpcdl.bench.reports.base import Provenance, Report

__all__ = ["Breakdown", "ClassTime", "Compiled", "LargeBatchCell", "LargeBatchReport", "NodeRound", "NotCompiled",
           "OptimReport", "OptimShardReport", "OptimShardRow", "Phases", "PrecisionCase", "RankSetup", "ScalingMeta", "ScalingPoint", "ScalingReport",
           "StepCurve", "StepOverhead", "StepPrecision", "StepReport", "StepTimes", "StepTuning", "TopOperator"]


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
class OptimShardRow:
    optimizer: str
    replicated_ms: float  # the gradients' all-reduce and the whole update (median of rounds, the slowest rank's)
    sharded_ms: float  # the reduce-scatter, this rank's share of the update, the all-gather (the same)
    replicated_update_ms: float  # the update alone, in ``replicated_ms``
    sharded_update_ms: float  # this rank's share of the update alone, in ``sharded_ms``
    replicated_state_bytes: int  # one rank's optimizer state, replicated
    sharded_state_bytes: tuple[int, ...]  # each rank's, sharded (measured: the tensors its optimizer holds)
    # the trainer's whole step (forward, backward, exchange, update), its optimizer phase and its comm_wait (what
    # computation did not hide); None: not timed
    replicated_step_ms: float | None = None
    sharded_step_ms: float | None = None
    replicated_step_update_ms: float | None = None
    sharded_step_update_ms: float | None = None
    replicated_step_comm_ms: float | None = None
    sharded_step_comm_ms: float | None = None
    # sharded with the all-gather taken in by the next forward (optimizer.gather_ahead), not at the step's end
    ahead_step_ms: float | None = None
    ahead_step_update_ms: float | None = None
    ahead_step_comm_ms: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OptimShardReport(Report):
    benchmark: typing.ClassVar[str] = "optim-shard"
    parameters: int
    world_size: int
    backend: str
    threads: int
    rows: tuple[OptimShardRow, ...]
    scatter: bool = True  # the sharded layout reduce-scatters the gradients (else all-reduces them: gloo)
    config: OptimShardBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


@dataclasses.dataclass(frozen=True, slots=True)
class LargeBatchCell:
    optimizer: str
    batch: int
    steps_per_epoch: int
    lrs: tuple[float, ...]  # the sweep
    means: tuple[float, ...]  # validation top-1 %, mean over the seeds, per lr (a diverged run counts 0)
    best_lr: float
    accuracy: tuple[float, ...]  # per seed, at the best lr
    mean: float
    stdev: float
    diverged: int = 0  # runs of the cell (all lrs) whose loss stopped being finite


@dataclasses.dataclass(frozen=True, slots=True)
class LargeBatchReport(Report):
    benchmark: typing.ClassVar[str] = "large-batch"
    data: str
    model: str
    train_images: int
    val_images: int
    classes: int
    ranks: int
    runs: int  # trainings: optimizers x batches x lrs x seeds
    estimated_s: float  # the budget stated before the start
    seconds: float  # the wall time the runs took
    cells: tuple[LargeBatchCell, ...]
    config: LargeBatchBench | None = None  # filled by the runner
    provenance: Provenance | None = None  # filled by the runner


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
    memory_auto: str = ""  # what loop.channels_last=auto picks for this model, and why


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
    together: float | None = None  # the share of the ranks' timed stretch that all of them were in (None: before it was measured)


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
class ClassTime:
    """One class of work in a step (hpcdl.bench.breakdown)."""

    ms: float  # per step
    share: float  # of the step's wall time
    calls: float  # operators per step (0 for framework)


@dataclasses.dataclass(frozen=True, slots=True)
class TopOperator:
    name: str
    kind: str  # its class
    ms: float  # per step


@dataclasses.dataclass(frozen=True, slots=True)
class Breakdown:
    """One model and precision: each class's time per step, and the matrix work's rate."""

    model: str
    precision: str
    batch: int
    ms_per_step: float  # profiled wall time per step
    classes: dict[str, ClassTime]
    flops_per_step: float
    matrix_gflops: float  # counted FLOPs over the matrix class's time
    gemm_gflops: float  # this precision's GEMM rate, same threads
    step_of_gemm: float  # counted FLOPs over the whole step, as a fraction of the GEMM rate
    top: tuple[TopOperator, ...]  # the largest five


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport(Report):
    benchmark: typing.ClassVar[str] = "step"
    config: StepBench
    precision: StepPrecision | None = None
    overhead: StepOverhead | None = None
    tuning: StepTuning | None = None
    curve: StepCurve | None = None
    profile: tuple[Breakdown, ...] = ()  # --profile: fp32, then bf16
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
