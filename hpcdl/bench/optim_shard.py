"""``hpcdl bench optim-shard``: on a job's ranks, each optimizer's step replicated against sharded
(:mod:`hpcdl.optim.shard`), side by side: rounds alternate between the two and between optimizers, a barrier before
each, and each figure is the median of the slowest rank's rounds. Gradients are fixed random tensors, the same on
every rank. The state bytes are measured: the tensors each optimizer holds after its first step.

Each layout is timed with the gradient exchange a training step gives it: replicated, the gradients' all-reduce
(one, over a flat copy, as DDP's buckets make) and the whole update; sharded, the reduce-scatter to the owners
(on gloo, whose reduce-scatter is an all-reduce, the all-reduce: :func:`hpcdl.optim.shard.scatters`), this rank's
share of the update and the all-gather of the updated tensors. The forward and the backward are the
same in both, so the two figures differ as the whole steps do, but for the all-reduce's overlap with backward,
which the reduce-scatter does not have. The update alone (the optimizer phase) is timed inside each."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from hpcdl import names
from hpcdl.bench.configs import OptimShardBench as Config
from hpcdl.bench.reports import OptimShardReport, OptimShardRow
from hpcdl.bench.rounds import alternate
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.models import build_model
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.shard import ShardedOptimizer, scatters, state_bytes


def run(cfg: Config, job) -> OptimShardReport | None:
    ctx, chosen = job.ctx, cfg.optimizer_list()
    cases, optimizers = {}, {}
    for name in chosen:
        oc = OptimConfig(name=name, lr=names.OPTIMIZER_TABLE[name].reference_lr, weight_decay=1e-4)
        for layout in ("replicated", "sharded"):
            optimizer = _optimizer(cfg.model, oc, layout, ctx.group)
            optimizers[name, layout] = optimizer
            cases[f"{name} {layout}"] = _timed_step(optimizer, layout, ctx.group, cfg.steps)
    with fail_fast(ctx.heartbeat):
        times = alternate(cases, cfg.rounds, before=lambda: dist.barrier(group=ctx.group))
        mine = {name: [state_bytes(optimizers[name, "sharded"])] for name in chosen}
        slowest = {}
        for case, values in times.items():
            t = torch.tensor(values, dtype=torch.float64)  # rounds x (whole, update)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
            slowest[case] = t.median(dim=0).values.tolist()  # the lower median of an even count
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.group)
    if ctx.rank != 0:
        return None
    rows = tuple(OptimShardRow(optimizer=name, replicated_ms=slowest[f"{name} replicated"][0],
                               sharded_ms=slowest[f"{name} sharded"][0],
                               replicated_update_ms=slowest[f"{name} replicated"][1],
                               sharded_update_ms=slowest[f"{name} sharded"][1],
                               replicated_state_bytes=state_bytes(optimizers[name, "replicated"]),
                               sharded_state_bytes=tuple(g[name][0] for g in gathered)) for name in chosen)
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return OptimShardReport(parameters=params, world_size=ctx.world_size, backend=ctx.backend.name,
                            threads=torch.get_num_threads(), rows=rows, scatter=scatters("none", ctx.group))


def _timed_step(optimizer, layout: str, group, repeat: int):
    """A case: ``repeat`` steps with their exchange; (whole, update) in milliseconds per step."""
    flat = optimizer.flat_grads  # the gradients are views of it, as of DDP's buckets (gradient_as_bucket_view)
    size = dist.get_world_size(group)

    def case() -> tuple[float, float]:
        update = 0.0
        t0 = time.perf_counter()
        for _ in range(repeat):
            if layout == "sharded":  # on gloo, as the trainer: DDP's all-reduce, then the update from a copy
                if not optimizer.scatter:
                    _all_reduce(flat, size, group)
                optimizer.reduce()
                t = time.perf_counter()
                optimizer.update()
                update += time.perf_counter() - t
                optimizer.gather()
            else:
                _all_reduce(flat, size, group)
                t = time.perf_counter()
                optimizer.step()
                update += time.perf_counter() - t
        return (time.perf_counter() - t0) / repeat * 1e3, update / repeat * 1e3

    return case


def _all_reduce(flat: torch.Tensor, size: int, group) -> None:
    """As DDP's reduction of buckets the gradients are views of: divided in place, all-reduced (one bucket)."""
    dist.all_reduce(flat.div_(size), group=group)


def _optimizer(model_name: str, oc: OptimConfig, layout: str, group):
    torch.manual_seed(0)
    model = build_model(model_name)
    params = list(model.parameters())
    flat = torch.randn(sum(p.numel() for p in params)) * 1e-2
    for p, view in zip(params, _unflatten_dense_tensors(flat, params)):
        p.grad = view
    optimizer = build_optimizer(model, oc)
    if layout == "sharded":
        optimizer = ShardedOptimizer(optimizer, group, scatter=scatters("none", group))
    optimizer.flat_grads = flat
    return optimizer


def format_report(r: OptimShardReport) -> str:
    c, n = r.config, r.world_size
    lines = [f"optimizer step over {c.model} ({r.parameters / 1e6:.1f}M parameters) on {n} ranks ({r.backend}), "
             f"{r.threads} threads each; median of {c.rounds} rounds of {c.steps} steps, the slowest rank's",
             "update: the optimizer phase; with exchange: replicated, all-reduce + update; sharded, "
             f"{'reduce-scatter' if r.scatter else 'all-reduce (gloo)'} + update + all-gather; no backward to overlap "
             "(DDP's all-reduce overlaps it, the reduce-scatter does not)",
             f"{'optimizer':10s} {'update: replicated':>19s} {'sharded':>9s} {'ratio':>6s}  "
             f"{'with exchange: replicated':>26s} {'sharded':>9s} {'ratio':>6s}  {'state/rank':>11s} "
             f"{'sharded max':>12s} {'vs 1/N':>7s}"]
    for row in r.rows:
        most = max(row.sharded_state_bytes)
        share = row.replicated_state_bytes / n
        lines.append(f"{row.optimizer:10s} {row.replicated_update_ms:17.1f}ms {row.sharded_update_ms:7.1f}ms "
                     f"{row.sharded_update_ms / row.replicated_update_ms:5.2f}x  {row.replicated_ms:24.1f}ms "
                     f"{row.sharded_ms:7.1f}ms {row.sharded_ms / row.replicated_ms:5.2f}x  "
                     f"{row.replicated_state_bytes / 2**20:9.1f}MB {most / 2**20:10.1f}MB "
                     f"{most / share if share else 0:6.2f}x")
    return "\n".join(lines) + "\n"
