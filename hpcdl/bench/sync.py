"""``hpcdl bench sync``: synchronizing a model's real gradient set, path against path, in one job.

Run it on the ranks of a job (mpiexec, srun, torchrun). The gradients have the model's shapes (ResNet-50:
161 tensors, 25.6M parameters) and random values. Cases, alternating rounds, medians:

- ``per-tensor``: one all-reduce per gradient tensor, in backward's order;
- ``fused``: hpcdl's path: DDP-sized buckets (``bucket_cap_mb``) that the gradients live in (DDP with
  ``gradient_as_bucket_view``: no packing copy), each all-reduced asynchronously, all awaited at the end;
- ``flat``: one all-reduce of all the bytes at once (the lower bound for fusion);
- ``fused fp16``: the fused path with each bucket cast to fp16, all-reduced and cast back (the ``fp16`` hook);
- ``raw mpi4py`` (``--backend mpi`` only): one ``Allreduce`` of the same bytes straight from mpi4py.

Then each comm hook (``sync.hook``) through DDP on the same gradient set: a module with the model's
parameter shapes whose backward yields random gradients at once, so that the time is the hook's sync
(and DDP's bucketing), with the bytes each rank sends per step. Two references in the same alternation
split hook ``none``'s time: DDP with a hook that returns each bucket at once (DDP's own work) and DDP with
torch's built-in all-reduce (what hpcdl's hook adds is the rest).

It also times a one-float all-reduce (small-message latency), through torch.distributed and, with
``--backend mpi``, through raw mpi4py and through a bare Python backend that does nothing but the MPI
call (the floor torch's dispatch sets for any backend written in Python), with ``--backend ccl`` through
raw oneCCL (ctypes calls in a row on the communication thread); weak scaling: ``scaling_model`` trained at the same per-rank
batch by rank 0 alone (the other ranks wait) and by all ranks with hpcdl's DDP, efficiency = t(1) / t(N);
and a bucket-size sweep: that DDP training step for each ``FIRST:CAP`` in ``buckets`` (MB), alternating
rounds, which is how ``sync.bucket_cap_mb`` and ``sync.first_bucket_mb`` got their defaults.
Launch it with one core per rank (e.g. ``srun --cpus-per-task=1``); the ranks' threads follow hpcdl's
CPU plan.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpcdl.bench.configs import SyncBench as Config
from hpcdl.bench.configs import bucket_spec
from hpcdl.bench.latency import latency_us, raw_mpi
from hpcdl.bench.reports import DDPPart, SyncFigures, SyncHook, SyncReport, WeakScaling
from hpcdl.bench.rounds import alternate, medians
from hpcdl.config import SyncConfig
from hpcdl.distributed.gradients.ddp import bucket_caps, data_parallel
from hpcdl.distributed.gradients.hooks import ChunkSparse
from hpcdl.models import build_model, model_info


def _buckets(grads: list, cap_bytes: int) -> list[list]:
    buckets, current, size = [], [], 0
    for g in reversed(grads):  # backward produces the last layers' gradients first
        current.append(g)
        size += g.numel() * g.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _fused(buckets: list, dtype, group) -> None:
    sent = [b.to(dtype) if dtype != b.dtype else b for b in buckets]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in sent]
    for w, t, b in zip(works, sent, buckets):
        w.wait()
        if t is not b:
            b.copy_(t)


def _timed_ms(fn, group, prepare=None):
    """A case for :func:`alternate`: ``prepare()`` (untimed), the ranks line up at a barrier, then ``fn`` is timed,
    in ms."""
    def case() -> float:
        if prepare is not None:
            prepare()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return case


def run(cfg: Config, job) -> SyncReport | None:
    """Every path on each of the job's groups (``--backends``: side by side); rank 0 gets the figures, the
    other ranks None."""
    figures = {name: _bench(cfg, job.env, group) for name, group in job.groups.items()}
    return SyncReport(by_backend=figures) if job.rank == 0 else None


def _bench(cfg: Config, env, group=None) -> SyncFigures:
    torch.manual_seed(dist.get_rank())
    grads = [torch.randn_like(p) for p in build_model(cfg.model).parameters()]
    flat = torch.cat([g.view(-1) for g in grads])
    buckets = [torch.cat([g.view(-1) for g in b]) for b in _buckets(grads, int(cfg.bucket_cap_mb * 2 ** 20))]
    cases = {
        "per-tensor": lambda: [dist.all_reduce(g, group=group) for g in reversed(grads)],
        "fused": lambda: _fused(buckets, torch.float32, group),
        "flat": lambda: dist.all_reduce(flat, group=group),
        "fused fp16": lambda: _fused(buckets, torch.float16, group),
    }
    mpi = raw_mpi() if dist.get_backend(group) == "mpi4py" else None
    if mpi is not None:
        comm, MPI = mpi
        buf = flat.numpy()
        cases["raw mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, buf)
    times = alternate({name: _timed_ms(fn, group) for name, fn in cases.items()}, cfg.rounds)
    median = medians(times)
    latency = latency_us(cfg.latency_iters, group, mpi)
    hooks, parts = hook_rows(cfg, env, group)
    return SyncFigures(model=cfg.model, tensors=len(grads), parameters=flat.numel(), buckets=len(buckets),
                       world_size=dist.get_world_size(group), backend=dist.get_backend(group), ms=median,
                       rounds_ms={k: tuple(v) for k, v in times.items()}, fused_vs_flat=median["fused"] / median["flat"],
                       latency_us=latency, hooks=hooks, ddp_parts=parts,
                       scaling=weak_scaling(cfg, env, group) if cfg.scaling_steps else None,
                       bucket_sweep=bucket_sweep(cfg, env, group) if cfg.buckets else {})


@functools.cache
def _gradient_set_class():
    """The module class below, made on first use (it subclasses torch's classes: no torch at import)."""
    class _Emit(torch.autograd.Function):
        """Backward hands each parameter the gradient :meth:`_GradientSet.prepare` made, at once: no arithmetic,
        so DDP's sync is all there is."""

        @staticmethod
        def forward(ctx, owner, *params):
            ctx.owner = owner
            return params[0].new_zeros(())

        @staticmethod
        def backward(ctx, _):
            grads, ctx.owner.pending = ctx.owner.pending, None
            return (None, *grads)


    class _GradientSet(torch.nn.Module):
        """The model's parameter shapes; backward gives each a random gradient at once.

        As a real backward's, each gradient is a fresh tensor that nothing else holds, so autograd hands it to
        the parameter without a copy and DDP copies it into its bucket once (the trainer's ``zero_grad(
        set_to_none=True)`` leaves no gradient to add to). A gradient the module kept would be cloned first."""

        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros_like(p)) for p in model.parameters())
            self.noise = [torch.randn_like(p) for p in model.parameters()]
            self.pending = None

        def prepare(self) -> None:
            """The next backward's gradients (untimed: a real backward computes them)."""
            self.pending = [n.clone() for n in self.noise]

        def forward(self) -> torch.Tensor:
            return _Emit.apply(self, *self.weights)

    return _GradientSet


def hook_rows(cfg: Config, env, group=None) -> tuple[dict[str, SyncHook], dict[str, DDPPart]]:
    """For each hook: median ms per DDP sync of the gradient set, and MB each rank sends per step; and the
    medians of :data:`DDP_PARTS`, timed in the same alternation."""

    training = SyncConfig()
    model = build_model(cfg.model)
    parameters = sum(p.numel() for p in model.parameters())
    nets, sent = {}, {}
    for hook in cfg.hooks:  # a module each: DDP hooks its parameters
        torch.manual_seed(dist.get_rank())
        sparse = ChunkSparse(keep=training.keep, chunk=training.chunk) if hook == "chunk_sparse" else None
        nets[hook], _ = data_parallel(_gradient_set_class()(model), env, group, hook=hook, backend=dist.get_backend(group),
                                      bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_mb=cfg.first_bucket_mb, sparse=sparse)
        sent[hook] = sparse

    parts = _ddp_parts(cfg, env, model, group)

    def sync(net):
        net().backward()
        net.zero_grad(set_to_none=True)  # as the trainer's step

    # two warm-ups: the first builds DDP's buckets, the second the hooks' state for them (chunk_sparse's
    # residual buffers: a one-time allocation, 2x the step it falls in)
    times = alternate({hook: _timed_ms(lambda net=net: sync(net), group, prepare=getattr(net, "module", net).prepare)
                       for hook, net in {**nets, **parts}.items()}, cfg.rounds, warmup=2)
    rows = {}
    for hook in nets:
        elements = sent[hook].last_step_sent[0] if sent[hook] else parameters
        size = 2 if hook in ("fp16", "bf16") or (hook == "chunk_sparse" and sent[hook].fp16) else 4
        rows[hook] = SyncHook(ms=medians(times)[hook], mb_sent=elements * size / 2 ** 20, rounds_ms=tuple(times[hook]))
    return rows, {part: DDPPart(ms=medians(times)[part], rounds_ms=tuple(times[part])) for part in parts}


DDP_PARTS = {"no exchange": "DDP with a hook that returns each bucket at once: its own work (autograd hooks, "
                            "the copy of each gradient into its bucket)",
             "torch's all-reduce": "DDP with no comm hook: torch's C++ all-reduce of each bucket (hook none's "
                                   "path since issue 37)",
             "Python hook": "hook none through hpcdl's timed Python hook (its path before issue 37; now only "
                            "with loop.timeline's per-bucket spans)"}


def _ddp_parts(cfg: Config, env, model, group) -> dict:
    """The references that split hook ``none``'s DDP sync (:data:`DDP_PARTS`), on the same gradient set and
    buckets, timed in the same alternation."""

    def no_exchange(_, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    nets = {}
    for part in ("no exchange", "torch's all-reduce"):
        torch.manual_seed(dist.get_rank())
        with bucket_caps(cfg.bucket_cap_mb, cfg.first_bucket_mb) as caps:
            nets[part] = DistributedDataParallel(_gradient_set_class()(model), process_group=group,
                                                 gradient_as_bucket_view=True, **caps)
    nets["no exchange"].register_comm_hook(None, no_exchange)
    torch.manual_seed(dist.get_rank())
    nets["Python hook"], _ = data_parallel(_gradient_set_class()(model), env, group, backend=dist.get_backend(group),
                                           bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_mb=cfg.first_bucket_mb,
                                           bucket_spans=True)
    return nets


def _train_steps(cfg: Config):
    """(a fresh ``scaling_model``, a function timing n training steps of a net over it)."""

    torch.manual_seed(0)
    model = build_model(cfg.scaling_model)
    crop = model_info(cfg.scaling_model).crop
    x, y = torch.randn(cfg.scaling_batch, 3, crop, crop), torch.randint(0, 1000, (cfg.scaling_batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def steps(net, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / max(n, 1)

    return model, steps


def weak_scaling(cfg: Config, env, group=None) -> WeakScaling | None:
    """Seconds per step of rank 0 alone, of every rank at once without a gradient exchange ("apart": what the
    ranks cost each other through the node's shared memory bandwidth and caches), and of every rank under
    hpcdl's DDP, same per-rank batch. Efficiency is alone / DDP; it splits into the node's share (alone /
    apart) and the exchange's (apart / DDP). The three alternate for ``rounds`` rounds and each is the median
    of its rounds: a VM's compute drifts by 10% between minutes, which one measurement of each turned into the
    efficiency's noise."""


    model, steps = _train_steps(cfg)
    ddp, _ = data_parallel(model, env, group, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_mb=cfg.first_bucket_mb)
    rank0 = dist.get_rank(group) == 0
    alone, apart, together = [], [], []
    for r in range(1 + cfg.rounds):  # round 0 warms all up (and lets DDP rebuild its buckets)
        n = 1 if r == 0 else cfg.scaling_steps
        dist.barrier(group=group)
        if rank0:  # the other ranks wait in the barrier, on their own cores
            alone.append(steps(model, n))
        dist.barrier(group=group)
        apart.append(steps(model, n))
        dist.barrier(group=group)
        together.append(steps(ddp, n))
    if not rank0:  # only rank 0 timed itself alone
        return None
    one, free, synced = (statistics.median(t[1:]) for t in (alone, apart, together))
    return WeakScaling(model=cfg.scaling_model, batch_per_rank=cfg.scaling_batch, threads=torch.get_num_threads(),
                       ranks=dist.get_world_size(group), rounds=cfg.rounds, s_per_step_1=one, s_per_step_apart=free,
                       s_per_step_n=synced, rounds_1=tuple(alone[1:]), rounds_apart=tuple(apart[1:]),
                       rounds_n=tuple(together[1:]), efficiency=one / synced, node_share=one / free,
                       sync_share=free / synced)


def bucket_sweep(cfg: Config, env, group=None) -> dict[str, float]:
    """Median seconds per DDP training step of ``scaling_model`` for each ``FIRST:CAP`` (MB) in ``buckets``."""

    nets = {}
    for spec in cfg.buckets:
        first, cap = bucket_spec(spec)
        model, steps_of = _train_steps(cfg)
        nets[spec] = (data_parallel(model, env, group, bucket_cap_mb=cap, first_bucket_mb=first)[0], steps_of)
    # the warm-up step lets DDP rebuild its buckets
    times = alternate({spec: (lambda net=net, steps=steps: steps(net, cfg.scaling_steps)) for spec, (net, steps)
                       in nets.items()}, cfg.sweep_rounds, before=lambda: dist.barrier(group=group))
    return medians(times)


def format_comparison(reports: dict[str, SyncFigures]) -> str:
    """Backends side by side (``--backends``): the flat and fused all-reduce of the gradient set, DDP's sync
    (hook ``none``) and the one-float all-reduce, each against the first backend."""
    first = next(iter(reports))
    rows = [("flat all-reduce", "ms", lambda r: r.ms["flat"]), ("fused all-reduce", "ms", lambda r: r.ms["fused"]),
            ("DDP sync (none)", "ms", lambda r: r.hooks["none"].ms if "none" in r.hooks else None),
            ("one-float all-reduce", "us", lambda r: r.latency_us["torch.distributed"])]
    lines = [f"side by side, {reports[first].model}'s gradients: " + ", ".join(reports) + f" (ratio: / {first})"]
    for name, unit, get in rows:
        base = get(reports[first])
        if base is None:
            continue
        lines.append(f"  {name:22s}" + "".join(f"  {b} {get(r):.1f} {unit} ({get(r) / base:.2f}x)"
                                                for b, r in reports.items()))
    return "\n".join(lines) + "\n"


def _ddp_split(r: SyncFigures, none_ms: float) -> list[str]:
    """Where hook ``none``'s DDP sync goes: DDP's own work, the exchange as torch's DDP issues it, and what
    hpcdl adds to that; the same buckets exchanged outside DDP (``fused``) and hpcdl's timed Python hook (hook
    none's path before issue 37) for comparison."""
    own, torchs = r.ddp_parts["no exchange"].ms, r.ddp_parts["torch's all-reduce"].ms
    lines = [f"where DDP's sync (hook none, {none_ms:.1f} ms, {none_ms / r.ms['flat']:.2f}x flat) goes:",
             f"  DDP's own work (a hook that returns each bucket at once)  {own:9.1f} ms",
             f"  + the exchange, as DDP with torch's all-reduce issues it   {torchs - own:9.1f} ms  "
             f"(the same buckets outside DDP: fused {r.ms['fused']:.1f} ms)",
             f"  + hpcdl over torch's all-reduce (its gradient timing)      {none_ms - torchs:9.1f} ms"]
    if "Python hook" in r.ddp_parts:
        python = r.ddp_parts["Python hook"].ms
        lines.append(f"  hook none through hpcdl's Python hook (before issue 37; loop.timeline): {python:.1f} ms, "
                     f"{python / none_ms:.2f}x")
    return lines


def format_report(report: SyncReport) -> str:
    text = "".join(_format_one(r, report.config) for r in report.by_backend.values())
    return text + format_comparison(report.by_backend) if len(report.by_backend) > 1 else text


def _format_one(r: SyncFigures, cfg: Config) -> str:
    lines = [f"gradient sync of {r.model}: {r.tensors} tensors, {r.parameters / 1e6:.1f}M parameters "
             f"({r.parameters * 4 / 2 ** 20:.0f} MB fp32), {r.buckets} buckets; {r.world_size} ranks, "
             f"backend {r.backend}; medians",
             *(f"  {name:12s} {ms:9.1f} ms  ({ms / r.ms['flat']:.2f}x flat)" for name, ms in r.ms.items()),
             f"  fused / flat: {r.fused_vs_flat:.2f}x",
             "one-float all-reduce: " + ", ".join(f"{k} {v:.1f} us" for k, v in r.latency_us.items())]
    base = r.hooks["none"].ms if "none" in r.hooks else None
    lines.append("DDP sync of the same gradients, by comm hook (sync.hook): ms, MB sent per rank per step")
    lines += [f"  {hook:12s} {row.ms:9.1f} ms" + (f"  ({row.ms / base:.2f}x none)" if base else "")
              + f"  {row.mb_sent:8.1f} MB" for hook, row in r.hooks.items()]
    if base and r.ddp_parts:
        lines += _ddp_split(r, base)
    if w := r.scaling:
        lines += [f"weak scaling, {w.model} at batch {w.batch_per_rank} per rank, {w.threads} threads per "
                  f"rank: 1 rank {w.s_per_step_1:.3f} s/step, {w.ranks} ranks {w.s_per_step_n:.3f} s/step, "
                  f"efficiency {100 * w.efficiency:.1f}% (medians of {w.rounds} alternating rounds)",
                  f"  = the node's share {100 * w.node_share:.1f}% ({w.ranks} ranks computing apart, no "
                  f"exchange: {w.s_per_step_apart:.3f} s/step) x the exchange's {100 * w.sync_share:.1f}%"]
    if r.bucket_sweep:
        best = min(r.bucket_sweep.values())
        lines.append(f"bucket sweep, {cfg.scaling_model}: s per DDP step by FIRST:CAP (MB; CAP alone: the first "
                     "bucket as big)")
        lines += [f"  {spec:10s} {t:.3f} s  ({t / best:.2f}x best)" for spec, t in r.bucket_sweep.items()]
    return "\n".join(lines) + "\n"
