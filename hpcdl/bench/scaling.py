"""``hpcdl bench scaling``: training throughput at 1, 2, 4 ... N ranks of one job, weak and strong.

Run it on the ranks of a job (srun, mpiexec, torchrun, submitit). Each point is a process group over
the job's first ``k`` ranks, training ``model`` on one synthetic batch held in memory, through hpcdl's
own step (:class:`hpcdl.train.step.Stepper`: DDP with hpcdl's buckets, the control all-reduce, LARS);
the other ranks wait. One rank is the model alone, without DDP, as a one-rank job runs.

- weak scaling: ``batch`` images per rank at every ``k``, so the global batch grows with ``k``;
- strong scaling: ``global_batch`` split over the ``k`` ranks.

Points are measured in alternating rounds (a fresh model each time, ``warmup`` steps first), so that
drift of a shared machine spreads over all of them. A step's time is the slowest rank's. Per point:
images/s (global batch over the mean step), efficiency (images/s per rank against the smallest rank
count's: 1.0 is linear), the exposed communication share (backward's wait for buckets still in flight,
plus the control all-reduce, over the step: ``t_comm_wait`` of the trainer), the phases, and step-time
percentiles. Rank 0 prints a table and writes the JSON (the input of ``hpcdl plan --calibrate``) and a PNG.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
import torch.distributed as dist

from hpcdl.bench.configs import MODES
from hpcdl.bench.configs import ScalingBench as Config
from hpcdl.bench.reports import Phases, ScalingMeta, ScalingPoint, ScalingReport, StepTimes
from hpcdl.bench.rounds import alternate
from hpcdl.bench.step import synthetic_training
from hpcdl.config import SyncConfig
from hpcdl.distributed.gradients.ddp import data_parallel
from hpcdl.distributed.gradients.hooks import ChunkSparse
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.model_facts import model_facts
from hpcdl.models import model_info
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig
from hpcdl.plot import counts_axis, pyplot, save_png
from hpcdl.train.step import PHASES, Stepper

__all__ = ["Config", "figure", "format_report", "plot", "run"]

log = logging.getLogger(__name__)


def run(cfg: Config, job) -> ScalingReport | None:
    """Measure every point on the job's ranks; rank 0 gets the report."""

    ctx = job.ctx
    points = cfg.points(ctx.world_size)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with fail_fast(ctx.heartbeat):
        nodes = _node_ranks(ctx)
        groups = {k: dist.new_group(ranks=list(range(k)), timeout=job.timeout, backend=ctx.backend.name)
                  for k in sorted({p[1] for p in points}) if k > 1}  # every rank creates every group
        rounds = alternate({p: (lambda p=p: _measure(ctx, cfg, p, groups.get(p[1])) if ctx.rank < p[1] else [])
                            for p in points}, cfg.rounds, warmup=0, before=lambda: dist.barrier(group=ctx.group))
        dist.barrier(group=ctx.group)
    if ctx.rank != 0:
        return None
    steps = {p: [row for r in rows for row in r] for p, rows in rounds.items()}
    return ScalingReport(meta=_meta(ctx, cfg, nodes), points=_summaries(steps, nodes))


def _node_ranks(ctx) -> list[int]:
    mine = torch.tensor([ctx.env.node_rank], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine, group=ctx.group)
    return [int(t.item()) for t in every]


def _measure(ctx, cfg: Config, point: tuple[str, int, int], group) -> list[dict]:
    """This rank's part of one round of ``point``: per timed step, the slowest rank's wall and phase times."""

    stepper = _stepper(ctx, cfg, point[2], group)
    for _ in range(cfg.warmup):
        stepper()
    rows = [stepper() for _ in range(cfg.steps)]
    fields = ("wall", *PHASES)
    table = torch.tensor([[r[f] for f in fields] for r in rows], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return [dict(zip(fields, row)) for row in table.tolist()]


def _stepper(ctx, cfg: Config, batch: int, group):
    """A fresh model on ``group`` (DDP with hpcdl's defaults; the model alone on one rank) and a function that
    runs one timed step of it."""

    model, optimizer, criterion, x, y = synthetic_training(cfg.model, batch, cfg.crop or model_info(cfg.model).crop)
    schedule = LRSchedule(optimizer, ScheduleConfig(base_lr=1.0, steps_per_epoch=1000, epochs=10, warmup_epochs=1))
    size = 1 if group is None else dist.get_world_size(group)
    sync = SyncConfig()
    sparse = ChunkSparse(keep=sync.keep, chunk=sync.chunk) if cfg.hook == "chunk_sparse" else None
    net, comm = data_parallel(model, dataclasses.replace(ctx.env, world_size=size), group, hook=cfg.hook,
                              backend=ctx.backend.name, bucket_cap_mb=sync.bucket_cap_mb, sparse=sparse,
                              first_bucket_mb=sync.first_bucket_mb, gradient_as_bucket_view=sync.gradient_as_bucket_view)
    stepper = Stepper(net, criterion, optimizer, schedule, comm=comm, group=group, distributed=group is not None)

    def step() -> dict:
        t0 = time.perf_counter()
        result = stepper.step(iter(((x, y),)), 1)
        return {"wall": time.perf_counter() - t0, **result.times}

    return step


def _summaries(steps: dict[tuple, list[dict]], nodes: list[int]) -> tuple[ScalingPoint, ...]:
    out = []
    for (mode, k, batch), rows in steps.items():
        walls = sorted(r["wall"] for r in rows)
        mean = statistics.fmean(walls)
        out.append(ScalingPoint(
            mode=mode, ranks=k, nodes=len(set(nodes[:k])), batch_per_rank=batch, global_batch=batch * k,
            steps=len(rows), images_per_s=batch * k / mean,
            step_ms=StepTimes(mean * 1e3, *(_percentile(walls, q) * 1e3 for q in (50, 90, 99))),
            phases_ms=Phases(**{p: statistics.fmean(r[p] for r in rows) * 1e3 for p in PHASES}),
            exposed_comm_share=statistics.fmean(r["comm_wait"] for r in rows) / mean))
    base = {}  # each mode's point of fewest ranks: linear scaling from it is the ideal
    for p in out:
        if p.mode not in base or p.ranks < base[p.mode].ranks:
            base[p.mode] = p
    ideal = [base[p.mode].images_per_s / base[p.mode].ranks * p.ranks for p in out]
    return tuple(dataclasses.replace(p, ideal_images_per_s=i, efficiency=p.images_per_s / i) for p, i in zip(out, ideal))


def _percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile (the value below which ``q`` percent of the steps fall)."""
    index = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return sorted_values[int(index)]


def _meta(ctx, cfg: Config, nodes: list[int]) -> ScalingMeta:
    return ScalingMeta(model=cfg.model, crop=cfg.crop or model_info(cfg.model).crop,
                       gradient_bytes=model_facts(cfg.model).gradient_bytes, backend=ctx.backend.name, hook=cfg.hook,
                       world_size=ctx.world_size, nodes=len(set(nodes)), ranks_per_node=ctx.env.local_size,
                       threads=torch.get_num_threads(), steps=cfg.steps, warmup=cfg.warmup, rounds=cfg.rounds,
                       torch=torch.__version__)


def format_report(report: ScalingReport) -> str:
    m = report.meta
    lines = [f"# scaling: {m.model} at {m.crop} px on {m.world_size} ranks ({m.nodes} node(s), "
             f"{m.ranks_per_node} per node), backend {m.backend}, hook {m.hook}, {m.threads} threads per rank, "
             f"{m.rounds} rounds of {m.steps} steps per point; {report.provenance.machine.cpu}",
             f"{'mode':6} {'ranks':>5} {'nodes':>5} {'batch/rank':>10} {'global':>6} {'images/s':>9} {'ideal':>9} "
             f"{'efficiency':>10} {'exposed comm':>12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"]
    for p in report.points:
        s = p.step_ms
        lines.append(f"{p.mode:6} {p.ranks:>5} {p.nodes:>5} {p.batch_per_rank:>10} {p.global_batch:>6} "
                     f"{p.images_per_s:>9.2f} {p.ideal_images_per_s:>9.2f} {p.efficiency:>9.1%} "
                     f"{p.exposed_comm_share:>11.1%} {s.p50:>8.1f} {s.p90:>8.1f} {s.p99:>8.1f}")
    return "\n".join(lines)


def plot(report: ScalingReport, out: str) -> str:
    """Write :func:`figure` of ``report`` as a PNG at ``out``."""
    return save_png(figure(report), out)


def figure(report: ScalingReport):
    """Throughput and efficiency against rank count, each mode with its ideal (linear) line."""
    plt = pyplot("hpcdl bench scaling --plot")
    m = report.meta
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(MODES, ("#4c72b0", "#dd8452")):
        pts = sorted((p for p in report.points if p.mode == mode), key=lambda p: p.ranks)
        if not pts:
            continue
        ranks = [p.ranks for p in pts]
        left.plot(ranks, [p.images_per_s for p in pts], "o-", color=color, label=f"{mode} (measured)")
        left.plot(ranks, [p.ideal_images_per_s for p in pts], "--", color=color, label=f"{mode} ideal")
        right.plot(ranks, [p.efficiency * 100 for p in pts], "o-", color=color, label=mode)
        for p in pts:
            right.annotate(f"{p.efficiency:.0%}", (p.ranks, p.efficiency * 100), textcoords="offset points",
                           xytext=(0, 6), ha="center", fontsize=8, color=color)
    right.axhline(100, color="grey", linestyle="--", label="ideal")
    counts_axis((left, right), list({p.ranks for p in report.points}), "ranks")
    left.set_ylabel("images/s")
    right.set_ylabel("efficiency, % of linear")
    right.set_ylim(0, 110)
    fig.suptitle(f"{m.model} at {m.crop} px, {m.backend}, {m.nodes} node(s) x {m.ranks_per_node} ranks, "
                 f"{m.threads} threads per rank", fontsize=10)
    fig.tight_layout()
    return fig
