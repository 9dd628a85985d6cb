"""``hpcdl bench optim-shard``: on a job's ranks, each optimizer's step replicated (the whole update on every rank)
against sharded (:mod:`hpcdl.optim.shard`: this rank's tensors, then the all-gather of every rank's), side by side:
rounds alternate between the two and between optimizers, a barrier before each, and each figure is the median of
the slowest rank's rounds. Gradients are fixed random tensors, the same on every rank (as an all-reduce leaves
them). The state bytes are measured: the tensors each optimizer holds after its first step.

What the sharded figure holds is all that sharding changes in a training step: the forward, the backward and the
gradients' all-reduce are the same, so a sharded figure below the replicated one is a faster whole step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpcdl import names
from hpcdl.bench.configs import OptimShardBench as Config
from hpcdl.bench.reports import OptimShardReport, OptimShardRow
from hpcdl.bench.rounds import alternate, timed_ms
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.models import build_model
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.shard import ShardedOptimizer, state_bytes


def run(cfg: Config, job) -> OptimShardReport | None:
    ctx, chosen = job.ctx, cfg.optimizer_list()
    cases, optimizers = {}, {}
    for name in chosen:
        oc = OptimConfig(name=name, lr=names.OPTIMIZER_TABLE[name].reference_lr, weight_decay=1e-4)
        for layout in ("replicated", "sharded"):
            optimizer = _optimizer(cfg.model, oc, layout, ctx.group)
            optimizers[name, layout] = optimizer
            cases[f"{name} {layout}"] = timed_ms(optimizer.step, cfg.steps)
    with fail_fast(ctx.heartbeat):
        times = alternate(cases, cfg.rounds, before=lambda: dist.barrier(group=ctx.group))
        mine = {name: [state_bytes(optimizers[name, "sharded"])] for name in chosen}
        slowest = {}
        for case, values in times.items():
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
            slowest[case] = sorted(t.tolist())[len(values) // 2]
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.group)
    if ctx.rank != 0:
        return None
    rows = tuple(OptimShardRow(optimizer=name, replicated_ms=slowest[f"{name} replicated"],
                               sharded_ms=slowest[f"{name} sharded"],
                               replicated_state_bytes=state_bytes(optimizers[name, "replicated"]),
                               sharded_state_bytes=tuple(g[name][0] for g in gathered)) for name in chosen)
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return OptimShardReport(parameters=params, world_size=ctx.world_size, backend=ctx.backend.name,
                            threads=torch.get_num_threads(), rows=rows)


def _optimizer(model_name: str, oc: OptimConfig, layout: str, group):
    torch.manual_seed(0)
    model = build_model(model_name)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    optimizer = build_optimizer(model, oc)
    return ShardedOptimizer(optimizer, group) if layout == "sharded" else optimizer


def format_report(r: OptimShardReport) -> str:
    c, n = r.config, r.world_size
    lines = [f"optimizer step over {c.model} ({r.parameters / 1e6:.1f}M parameters) on {n} ranks ({r.backend}), "
             f"{r.threads} threads each; median of {c.rounds} rounds of {c.steps} steps, the slowest rank's",
             f"{'optimizer':10s} {'replicated':>11s} {'sharded':>9s} {'ratio':>7s}  {'state/rank':>11s} "
             f"{'sharded max':>12s} {'vs 1/N':>7s}"]
    for row in r.rows:
        most = max(row.sharded_state_bytes)
        share = row.replicated_state_bytes / n
        lines.append(f"{row.optimizer:10s} {row.replicated_ms:9.1f}ms {row.sharded_ms:7.1f}ms "
                     f"{row.sharded_ms / row.replicated_ms:6.2f}x  {row.replicated_state_bytes / 2**20:9.1f}MB "
                     f"{most / 2**20:10.1f}MB {most / share if share else 0:6.2f}x")
    return "\n".join(lines) + "\n"
