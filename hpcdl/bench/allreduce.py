"""``hpcdl bench allreduce``: latency and bandwidth of allreduce over a sweep of message sizes.

Bandwidths follow nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n``, the data
each rank's link carries in a ring allreduce, comparable across rank counts and with link speed.
Every size is also checked: an untimed allreduce of a known pattern must give the exact sum. Each
backend's times are fitted to a ring's alpha-beta cost (:func:`hpcdl.bench.reports.comm.fit_ring`): the fitted bus bandwidth is
the link's achieved rate, to compare with its nominal one.
"""

from __future__ import annotations

import logging
import socket
import time

import torch
import torch.distributed as dist

from hpcdl.bench.configs import AllreduceBench as Config
from hpcdl.bench.configs import ITEMSIZE
from hpcdl.bench.reports import AllreduceMeta, AllreduceReport, AllreduceRow, NoFit, Placement, RingFit, fit_ring
from hpcdl.distributed.affinity import allocator_in_use
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.errors import DataError
from hpcdl.utils import format_bytes

__all__ = ["Config", "format_report", "run"]

log = logging.getLogger(__name__)


def run(cfg: Config, job) -> AllreduceReport | None:
    """The sweep on every rank of ``job``, each size on each of its groups in turn (``--backends``: side by
    side); rank 0 returns the report."""
    ctx = job.ctx
    placement = _placement(ctx)
    with fail_fast(ctx.heartbeat):
        rows = []
        for nbytes in cfg.sizes():
            for name, group in job.groups.items():
                row = measure(ctx, cfg, nbytes, group, name)
                rows.append(row)
                if ctx.rank == 0:
                    log.debug("%s", row)
    if ctx.rank != 0:
        return None
    fits = {}
    if ctx.world_size > 1 and len(cfg.sizes()) > 1:
        for name in job.groups:
            try:
                alpha, beta = fit_ring(ctx.world_size, [(r.bytes, r.time_us * 1e-6) for r in rows if r.backend == name])
            except DataError as exc:  # small messages only: latency and noise; the sweep itself stands
                fits[name] = NoFit(str(exc))
                continue
            fits[name] = RingFit(latency_us=alpha * 1e6, busbw_GBps=1 / beta / 1e9)
    meta = AllreduceMeta(backend=ctx.backend.name, backends=tuple(job.groups), world_size=ctx.world_size,
                         nodes=ctx.env.nodes, dtype=cfg.dtype, torch=torch.__version__, job_id=ctx.env.job_id,
                         time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return AllreduceReport(meta=meta, ranks=placement, rows=tuple(rows), fit=fits)


def _placement(ctx) -> tuple[Placement, ...]:
    """Where each rank runs: its local and node rank and host, gathered on every rank."""
    env = ctx.env
    mine = Placement(rank=env.rank, local_rank=env.local_rank, node_rank=env.node_rank, host=socket.gethostname(),
                     launcher=env.launcher, master_addr=env.master_addr, master_port=env.master_port,
                     threads=ctx.cpu.threads, allocator=allocator_in_use())
    gathered: list = [None] * ctx.world_size
    with fail_fast(ctx.heartbeat):
        dist.all_gather_object(gathered, mine, group=ctx.group)
    return tuple(gathered)


def measure(ctx, cfg: Config, nbytes: int, group, backend: str) -> AllreduceRow:
    """Time ``group``'s all-reduce of ``nbytes``; agreement (check, iterations, times) goes over the default group."""
    dtype, n = getattr(torch, cfg.dtype), nbytes // ITEMSIZE[cfg.dtype]
    ok = _check(ctx, dtype, n, group)
    buf = torch.zeros(n, dtype=dtype)
    for _ in range(cfg.warmup):
        dist.all_reduce(buf, group=group)
    iters = _agree_on_iters(ctx, cfg, buf, group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    per_iter = (time.perf_counter() - start) / iters
    slowest, fastest = _max_min(ctx, per_iter)
    algbw = n * dtype.itemsize / slowest
    busbw = algbw * 2 * (ctx.world_size - 1) / ctx.world_size
    return AllreduceRow(backend=backend, bytes=n * dtype.itemsize, elements=n, iters=iters, time_us=slowest * 1e6,
                        min_time_us=fastest * 1e6, algbw_GBps=algbw / 1e9, busbw_GBps=busbw / 1e9, correct=ok)


def _check(ctx, dtype, n: int, group) -> bool:
    """Allreduce ``(rank+1) + i % 7`` and compare with the exact sum; True only if every rank agrees."""
    w = ctx.world_size
    pattern = torch.arange(n, dtype=torch.int64) % 7
    buf = (pattern + ctx.rank + 1).to(dtype)
    dist.all_reduce(buf, group=group)
    expected = (pattern * w + w * (w + 1) // 2).to(dtype)
    flag = torch.tensor([int(torch.equal(buf, expected))], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def _agree_on_iters(ctx, cfg: Config, buf, group) -> int:
    start = time.perf_counter()
    dist.all_reduce(buf, group=group)
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=ctx.group)  # every rank computes the same count
    return max(1, min(cfg.max_iters, int(cfg.seconds_per_size / max(probe.item(), 1e-9))))


def _max_min(ctx, value: float) -> tuple[float, float]:
    t = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t[0].item(), -t[1].item()


def format_report(report: AllreduceReport) -> str:
    meta, backends = report.meta, report.backends
    lines = [f"# allreduce on {meta.world_size} ranks, {meta.nodes} node(s), backend {', '.join(backends)}, "
             f"dtype {meta.dtype}, torch {meta.torch}"]
    lines += [f"#   rank {r.rank}: node {r.node_rank} local {r.local_rank} host {r.host} "
              f"({r.launcher}, {r.threads} threads) rendezvous {r.master_addr}:{r.master_port}" for r in report.ranks]
    for backend in backends:
        if len(backends) > 1:
            lines.append(f"## {backend}")
        lines.append(f"{'size':>10} {'elements':>10} {'iters':>6} {'time(us)':>11} {'min(us)':>11} "
                     f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check")
        for row in (r for r in report.rows if r.backend == backend):
            lines.append(f"{format_bytes(row.bytes):>10} {row.elements:>10} {row.iters:>6} {row.time_us:>11.1f} "
                         f"{row.min_time_us:>11.1f} {row.algbw_GBps:>12.3f} {row.busbw_GBps:>12.3f}  "
                         f"{'ok' if row.correct else 'WRONG'}")
    for backend, f in report.fit.items():
        if isinstance(f, NoFit):
            lines.append(f"# fit ({backend}): none, {f.none}")
            continue
        lines.append(f"# fit ({backend}, ring): alpha {f.latency_us:.1f} us per step, bus bandwidth "
                     f"{f.busbw_GBps:.3f} GB/s = {f.busbw_GBps * 8:.3f} Gbit/s of payload")
    if len(backends) > 1:
        lines += _comparison(report.rows, backends)
    bad = [f"{format_bytes(r.bytes)} ({r.backend})" for r in report.rows if not r.correct]
    lines.append(f"# reduced values: {'all correct' if not bad else 'WRONG at ' + ', '.join(bad)}")
    return "\n".join(lines)


def _comparison(rows: tuple[AllreduceRow, ...], backends: tuple[str, ...]) -> list[str]:
    """Side by side: each backend's time per size, and the bandwidth ratio of every later backend to every earlier one."""
    pairs = [(b, a) for i, a in enumerate(backends) for b in backends[i + 1:]]
    by = {(r.backend, r.bytes): r for r in rows}
    sizes = sorted({r.bytes for r in rows})
    lines = ["## side by side: time (us) per all-reduce, and bandwidth ratios",
             f"{'size':>10} " + " ".join(f"{b:>10}" for b in backends) + " " + " ".join(f"{b + '/' + a:>14}"
                                                                                      for b, a in pairs)]
    for size in sizes:
        lines.append(f"{format_bytes(size):>10} " + " ".join(f"{by[b, size].time_us:>10.1f}" for b in backends) + " "
                     + " ".join(f"{by[b, size].busbw_GBps / by[a, size].busbw_GBps:>13.2f}x" for b, a in pairs))
    return lines


def check(report: AllreduceReport) -> str | None:
    """Why the run failed (a wrong reduced value), or None: ``hpcdl bench allreduce`` exits 1 on it."""
    if not all(row.correct for row in report.rows):
        return "allreduce produced wrong values; see the check column"
    return None
