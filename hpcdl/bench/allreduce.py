"""``hpcdl bench allreduce``: latency and bandwidth of allreduce over a sweep of message sizes.

Bandwidths follow nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n``, the data
each rank's link carries in a ring allreduce, comparable across rank counts and with link speed.
Every size is also checked: an untimed allreduce of a known pattern must give the exact sum.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.distributed.affinity import allocator_in_use
from hpcdl.distributed.process_group import DistContext, backend_groups, fail_fast, init_distributed, set_timeout, shutdown
from hpcdl.errors import ConfigError
from hpcdl.utils import atomic_write_text, format_bytes, parse_bytes

__all__ = ["AllreduceConfig", "run"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


@dataclasses.dataclass(kw_only=True, slots=True)
class AllreduceConfig:
    min_bytes: int | str | None = None  # default: one element of dtype
    max_bytes: int | str = 256 << 20
    dtype: str = "float32"
    warmup: int = 2
    seconds_per_size: float = 0.5  # each size repeats until about this long, at least once
    max_iters: int = 1000
    json_path: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.min_bytes is None:
            self.min_bytes = DTYPES[self.dtype].itemsize
        if isinstance(self.min_bytes, str):
            self.min_bytes = parse_bytes(self.min_bytes, "--min-bytes")
        if isinstance(self.max_bytes, str):
            self.max_bytes = parse_bytes(self.max_bytes, "--max-bytes")
        itemsize = DTYPES[self.dtype].itemsize
        if self.min_bytes < itemsize or self.max_bytes < self.min_bytes:
            raise ConfigError(f"--min-bytes {self.min_bytes} and --max-bytes {self.max_bytes}: need "
                              f"{itemsize} <= min <= max (one {self.dtype} is {itemsize} bytes)")
        if self.warmup < 0 or self.max_iters < 1 or self.seconds_per_size <= 0:
            raise ConfigError("--warmup must be >= 0, --max-iters >= 1 and --seconds-per-size > 0")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= 2
        return out


def run(ctx: DistContext, cfg: AllreduceConfig, timeout: timedelta, backends: str | None = None) -> dict | None:
    """Run the sweep on every rank; rank 0 prints the table and returns the report.

    ``backends`` (``gloo,mpi,ccl``): a group on each, measured size by size in turn, side by side; otherwise
    the default group's backend alone.
    """
    layout = _layout(ctx)
    set_timeout(ctx, timeout)
    with fail_fast(ctx):
        groups = backend_groups(ctx, backends, timeout) if backends else {ctx.backend.name: ctx.group}
        rows = []
        for nbytes in cfg.sizes():
            for name, group in groups.items():
                row = {"backend": name, **_measure(ctx, cfg, nbytes, group)}
                rows.append(row)
                if ctx.rank == 0:
                    log.debug("%s", row)
    report = {"meta": {**_meta(ctx, cfg), "backends": list(groups)}, "ranks": layout, "rows": rows}
    if ctx.rank != 0:
        return None
    print(format_report(report), flush=True)
    if cfg.json_path:
        path = cfg.json_path.replace("%j", ctx.env.job_id or "local")  # as in Slurm's --output
        atomic_write_text(path, json.dumps(report, indent=1) + "\n")
        log.info("wrote %s", path)
    return report


def _layout(ctx: DistContext) -> list[dict]:
    env = ctx.env
    mine = {"rank": env.rank, "local_rank": env.local_rank, "node_rank": env.node_rank, "host": socket.gethostname(),
            "launcher": env.launcher, "master_addr": env.master_addr, "master_port": env.master_port,
            "threads": ctx.cpu.threads, "allocator": allocator_in_use()}
    gathered: list[dict] = [{}] * ctx.world_size
    with fail_fast(ctx):
        dist.all_gather_object(gathered, mine, group=ctx.group)
    return gathered


def _measure(ctx: DistContext, cfg: AllreduceConfig, nbytes: int, group) -> dict:
    """Time ``group``'s all-reduce of ``nbytes``; agreement (check, iterations, times) goes over the default group."""
    dtype, n = DTYPES[cfg.dtype], nbytes // DTYPES[cfg.dtype].itemsize
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
    return {"bytes": n * dtype.itemsize, "elements": n, "iters": iters, "time_us": slowest * 1e6,
            "min_time_us": fastest * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9, "correct": ok}


def _check(ctx: DistContext, dtype: torch.dtype, n: int, group) -> bool:
    """Allreduce ``(rank+1) + i % 7`` and compare with the exact sum; True only if every rank agrees."""
    w = ctx.world_size
    pattern = torch.arange(n, dtype=torch.int64) % 7
    buf = (pattern + ctx.rank + 1).to(dtype)
    dist.all_reduce(buf, group=group)
    expected = (pattern * w + w * (w + 1) // 2).to(dtype)
    flag = torch.tensor([int(torch.equal(buf, expected))], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def _agree_on_iters(ctx: DistContext, cfg: AllreduceConfig, buf: torch.Tensor, group) -> int:
    start = time.perf_counter()
    dist.all_reduce(buf, group=group)
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=ctx.group)  # every rank computes the same count
    return max(1, min(cfg.max_iters, int(cfg.seconds_per_size / max(probe.item(), 1e-9))))


def _max_min(ctx: DistContext, value: float) -> tuple[float, float]:
    t = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t[0].item(), -t[1].item()


def _meta(ctx: DistContext, cfg: AllreduceConfig) -> dict:
    return {"benchmark": "allreduce", "backend": ctx.backend.name, "world_size": ctx.world_size,
            "nodes": ctx.env.nodes, "dtype": cfg.dtype, "torch": torch.__version__,
            "job_id": ctx.env.job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def format_report(report: dict) -> str:
    meta = report["meta"]
    backends = meta.get("backends") or [meta["backend"]]
    lines = [f"# allreduce on {meta['world_size']} ranks, {meta['nodes']} node(s), backend {', '.join(backends)}, "
             f"dtype {meta['dtype']}, torch {meta['torch']}"]
    lines += [f"#   rank {r['rank']}: node {r['node_rank']} local {r['local_rank']} host {r['host']} "
              f"({r['launcher']}, {r['threads']} threads) rendezvous {r['master_addr']}:{r['master_port']}"
              for r in report["ranks"]]
    for backend in backends:
        if len(backends) > 1:
            lines.append(f"## {backend}")
        lines.append(f"{'size':>10} {'elements':>10} {'iters':>6} {'time(us)':>11} {'min(us)':>11} "
                     f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check")
        for row in (r for r in report["rows"] if r.get("backend", backend) == backend):
            lines.append(f"{format_bytes(row['bytes']):>10} {row['elements']:>10} {row['iters']:>6} "
                         f"{row['time_us']:>11.1f} {row['min_time_us']:>11.1f} {row['algbw_GBps']:>12.3f} "
                         f"{row['busbw_GBps']:>12.3f}  {'ok' if row['correct'] else 'WRONG'}")
    if len(backends) > 1:
        lines += _comparison(report["rows"], backends)
    bad = [f"{format_bytes(r['bytes'])} ({r.get('backend', meta['backend'])})" for r in report["rows"] if not r["correct"]]
    lines.append(f"# reduced values: {'all correct' if not bad else 'WRONG at ' + ', '.join(bad)}")
    return "\n".join(lines)


def _comparison(rows: list[dict], backends: list[str]) -> list[str]:
    """Side by side: each backend's time per size, and the bandwidth ratio of every later backend to every earlier one."""
    pairs = [(b, a) for i, a in enumerate(backends) for b in backends[i + 1:]]
    by = {(r["backend"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    lines = ["## side by side: time (us) per all-reduce, and bandwidth ratios",
             f"{'size':>10} " + " ".join(f"{b:>10}" for b in backends) + " " + " ".join(f"{b + '/' + a:>14}"
                                                                                      for b, a in pairs)]
    for size in sizes:
        lines.append(f"{format_bytes(size):>10} " + " ".join(f"{by[b, size]['time_us']:>10.1f}" for b in backends) + " "
                     + " ".join(f"{by[b, size]['busbw_GBps'] / by[a, size]['busbw_GBps']:>13.2f}x" for b, a in pairs))
    return lines


def bench(*, backend: str = "auto", backends: str | None = None, timeout_s: float = 300.0,
          startup_timeout_s: float = 600.0, heartbeat_s: float = 2.0, **config) -> dict | None:
    """Join the job's process group, run the sweep, leave. Rank 0 returns the report.

    This is what ``hpcdl bench allreduce`` runs, and what a submitit job can call directly. ``backends``
    (``gloo,mpi,ccl``) compares several in one run; the default group is then gloo's.
    """
    cfg = AllreduceConfig(**config)
    ctx = init_distributed("gloo" if backends else backend, timeout=timedelta(seconds=startup_timeout_s),
                           heartbeat_s=heartbeat_s)
    report = run(ctx, cfg, timedelta(seconds=timeout_s), backends)
    shutdown(ctx)  # not reached after a RankLostError: a broken group cannot be torn down cleanly
    return report
