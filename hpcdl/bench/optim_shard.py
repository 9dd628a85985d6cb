"""``hpcdl bench optim-shard``: on a job's ranks, each optimizer's step replicated against sharded
(:mod:`hpcdl.optim.shard`), side by side: rounds alternate between the two and between optimizers, a barrier before
each, and each figure is the median of the slowest rank's rounds. Gradients are fixed random tensors, the same on
every rank. The state bytes are measured: the tensors each optimizer holds after its first step.

Each layout is timed with the gradient exchange a training step gives it: replicated, the gradients' all-reduce
(one, over the flat buffer the gradients are views of, as DDP's buckets make them) and the whole update; sharded, the
reduce-scatters to the owners (segments of 25 MB, started after the gradients are in)
(on gloo, whose reduce-scatter is an all-reduce, the all-reduce: :func:`hpcdl.optim.shard.scatters`), this rank's
share of the update and the all-gather of the updated tensors, with no backward to overlap (the whole step
below has one). The update alone (the optimizer phase) is timed inside each.

With ``batch``, the whole step too: the trainer's (:class:`hpcdl.train.step.Stepper`, in the precision
``loop.precision=auto`` picks, channels_last) on a random batch, forward and backward included, each layout with the
exchange the trainer gives it: replicated, DDP's bucket all-reduces overlapping backward; sharded, the
reduce-scatters backward starts (:meth:`hpcdl.optim.shard.ShardedOptimizer.arm`), this rank's update, the
all-gather; and "ahead", sharded with the all-gather taken in by the next forward (``optimizer.gather_ahead``,
:mod:`hpcdl.optim.shard_ahead`; each round's last one waited for inside the round). These are timed an optimizer at
a time (three models live, not ten), the layouts alternating."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from hpcdl import names
from hpcdl.bench.configs import OptimShardBench as Config
from hpcdl.bench.reports import OptimShardReport, OptimShardRow
from hpcdl.bench.rounds import alternate
from hpcdl.bench.step import synthetic_training
from hpcdl.config import SyncConfig
from hpcdl.distributed.gradients.ddp import data_parallel
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.models import build_model
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig
from hpcdl.optim.shard import ShardedOptimizer, scatters, state_bytes
from hpcdl.train.precision import choose_precision
from hpcdl.train.step import Stepper


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
        replicated = {name: state_bytes(optimizers[name, "replicated"]) for name in chosen}
        cases.clear()
        for optimizer in optimizers.values():
            getattr(optimizer, "close", lambda: None)()
        optimizers.clear()  # ten models and their state: the whole step's three more would not fit 4 ranks in 24 GB
        gc.collect()  # DDP's and the optimizers' references among the models make cycles
        whole = {name: _whole_steps(cfg, ctx, name) for name in chosen} if cfg.batch else {}
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.group)
    if ctx.rank != 0:
        return None
    rows = tuple(OptimShardRow(optimizer=name, replicated_ms=slowest[f"{name} replicated"][0],
                               sharded_ms=slowest[f"{name} sharded"][0],
                               replicated_update_ms=slowest[f"{name} replicated"][1],
                               sharded_update_ms=slowest[f"{name} sharded"][1],
                               replicated_state_bytes=replicated[name],
                               sharded_state_bytes=tuple(g[name][0] for g in gathered),
                               **whole.get(name, {})) for name in chosen)
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return OptimShardReport(parameters=params, world_size=ctx.world_size, backend=ctx.backend.name,
                            threads=torch.get_num_threads(), rows=rows, scatter=scatters("none", ctx.group))


def _timed_step(optimizer, layout: str, group, repeat: int):
    """A case: ``repeat`` steps with their exchange; (whole, update) in milliseconds per step."""
    flat = optimizer.flat_grads  # the gradients are views of it, as of DDP's buckets (gradient_as_bucket_view)
    size = dist.get_world_size(group)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    views = [p.grad for p in params]

    def case() -> tuple[float, float]:
        update = 0.0
        t0 = time.perf_counter()
        for _ in range(repeat):
            if layout == "sharded":  # on gloo, as the trainer: DDP's all-reduce, then the update from a copy
                for p, view in zip(params, views):  # as backward leaves them: the last step's were dropped or lent
                    p.grad = view
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


def _whole_steps(cfg: Config, ctx, name: str) -> dict[str, float]:
    """The trainer's whole step of ``name`` replicated and sharded, alternating: the slowest rank's median step, its
    optimizer phase (the update, the lr schedule, zeroing the gradients) and its ``comm_wait`` (communication the
    computation did not hide), in milliseconds."""
    gc.collect()  # the previous optimizer's models (cycles: DDP, the sharded optimizer's hooks)
    precision, _ = choose_precision("auto")
    sync, cases, built = SyncConfig(), {}, []
    for layout in ("replicated", "sharded", "ahead"):
        model, _, criterion, x, y = synthetic_training(cfg.model, cfg.batch, cfg.crop, seed=ctx.rank)
        oc = OptimConfig(name=name, lr=names.OPTIMIZER_TABLE[name].reference_lr, weight_decay=1e-4)
        optimizer = build_optimizer(model, oc)
        if layout != "replicated":
            optimizer = ShardedOptimizer(optimizer, ctx.group, scatter=scatters("none", ctx.group),
                                         bucket_bytes=round(sync.bucket_cap_mb * 2**20),
                                         order=list(model.parameters()),  # as hpcdl.train.build lays them out
                                         ahead=model if layout == "ahead" else None)
            built.append(optimizer)
        net, comm = data_parallel(model, ctx.env, ctx.group, backend=ctx.backend.name, bucket_cap_mb=sync.bucket_cap_mb,
                                  first_bucket_mb=sync.first_bucket_mb,
                                  exchange=not getattr(optimizer, "scatter", False),
                                  broadcast_buffers=getattr(optimizer, "ahead", None) is None)  # as the trainer
        schedule = LRSchedule(optimizer, ScheduleConfig(base_lr=oc.lr, steps_per_epoch=1000, epochs=10))
        stepper = Stepper(net, criterion, optimizer, schedule, precision=precision, comm=comm, group=ctx.group)
        cases[layout] = _timed_whole(stepper, x, y, cfg.steps)
    times = alternate(cases, cfg.rounds, before=lambda: dist.barrier(group=ctx.group))
    for optimizer in built:
        optimizer.close()
    out = {}
    for layout, values in times.items():
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
        out[f"{layout}_step_ms"], out[f"{layout}_step_update_ms"], out[f"{layout}_step_comm_ms"] = \
            t.median(dim=0).values.tolist()
    return out


def _timed_whole(stepper: Stepper, x: torch.Tensor, y: torch.Tensor, repeat: int):
    def case() -> tuple[float, float, float]:
        update = comm = 0.0
        t0 = time.perf_counter()
        for _ in range(repeat):
            result = stepper.step(iter(((x, y),)), 1)
            if not result.finite:
                raise RuntimeError("bench optim-shard: the whole step's loss was not finite: its update was skipped, "
                                   "so its time is not the update's; this is a bug in hpcdl")
            update, comm = update + result.times["optimizer"], comm + result.times["comm_wait"]
        t = time.perf_counter()  # gather_ahead: the round's last all-gather is the round's, not the next layout's
        getattr(stepper.optimizer, "settle", lambda: None)()
        comm += time.perf_counter() - t
        return (time.perf_counter() - t0) / repeat * 1e3, update / repeat * 1e3, comm / repeat * 1e3

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
        optimizer = ShardedOptimizer(optimizer, group, scatter=scatters("none", group), order=params)
    optimizer.flat_grads = flat
    return optimizer


def format_report(r: OptimShardReport) -> str:
    c, n = r.config, r.world_size
    lines = [f"optimizer step over {c.model} ({r.parameters / 1e6:.1f}M parameters) on {n} ranks ({r.backend}), "
             f"{r.threads} threads each; median of {c.rounds} rounds of {c.steps} steps, the slowest rank's",
             "update: the optimizer phase; with exchange: replicated, all-reduce + update; sharded, "
             f"{'reduce-scatter' if r.scatter else 'all-reduce (gloo)'} + update + all-gather; no backward to overlap "
             "(the whole step below has one)",
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
    timed = [row for row in r.rows if row.replicated_step_ms is not None]
    if timed:
        lines += [f"the trainer's whole step, batch {c.batch} at {c.crop}px per rank: replicated, DDP's all-reduce "
                  "overlapping backward; sharded, the reduce-scatters backward starts, the update, the all-gather; "
                  "ahead: sharded, the all-gather taken in by the next forward (optimizer.gather_ahead)",
                  f"{'optimizer':10s} {'step: replicated':>17s} {'sharded':>9s} {'ratio':>6s} {'ahead':>9s} "
                  f"{'ratio':>6s}  {'optimizer phase: replicated':>28s} {'sharded':>9s} {'ratio':>6s}  "
                  f"{'comm_wait: replicated':>22s} {'sharded':>9s} {'ahead':>9s}"]
        for row in timed:
            lines.append(f"{row.optimizer:10s} {row.replicated_step_ms:15.1f}ms {row.sharded_step_ms:7.1f}ms "
                         f"{row.sharded_step_ms / row.replicated_step_ms:5.2f}x {row.ahead_step_ms:7.1f}ms "
                         f"{row.ahead_step_ms / row.replicated_step_ms:5.2f}x  {row.replicated_step_update_ms:26.1f}ms "
                         f"{row.sharded_step_update_ms:7.1f}ms "
                         f"{row.sharded_step_update_ms / row.replicated_step_update_ms:5.2f}x  "
                         f"{row.replicated_step_comm_ms:20.1f}ms {row.sharded_step_comm_ms:7.1f}ms "
                         f"{row.ahead_step_comm_ms:7.1f}ms")
    return "\n".join(lines) + "\n"
