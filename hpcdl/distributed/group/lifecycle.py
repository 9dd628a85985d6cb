"""A rank's life in the job's process group: ``init_distributed`` (rank discovery, the CPU plan applied, the
rendezvous store, the heartbeat, the backend chosen and joined), the timeouts and subgroups, and ``shutdown``.
What a failed collective means is :mod:`hpcdl.distributed.group.liveness`'s to say; the store is
:mod:`hpcdl.distributed.group.store`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.distributed.affinity import CpuPlan, allocator_in_use, plan_cpus
from hpcdl.distributed.backend import BACKENDS, BackendChoice, choose_backend
from hpcdl.distributed.group.liveness import Heartbeat, group_liveness
from hpcdl.distributed.group.python_backend import Liveness, library_group
from hpcdl.distributed.group.store import CountingStore, StoreUse, serve_or_join
from hpcdl.distributed.ranks.env import RankEnv, discover, launcher_ends_survivors
from hpcdl.errors import ConfigError
from hpcdl.utils import exit_if_stuck

__all__ = ["STARTUP_TIMEOUT", "DistContext", "apply_cpu_plan", "backend_groups", "init_distributed", "leave_together",
           "new_subgroup", "set_group_timeout", "set_timeout", "shutdown"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = timedelta(minutes=10)  # first rendezvous: ranks start minutes apart on big jobs


@dataclasses.dataclass(slots=True, kw_only=True)
class DistContext:
    """What ``init_distributed`` set up; pass ``group`` to collectives."""

    env: RankEnv
    backend: BackendChoice
    cpu: CpuPlan
    timeout: timedelta
    group: dist.ProcessGroup | None
    heartbeat: Heartbeat
    liveness: Liveness  # the heartbeats, as the watchdogs of hpcdl's own groups ask them
    # rank 0's rendezvous store, as the groups were given it (a Python store such as CountingStore is called from
    # C++ only while a Python reference to it lives)
    store: dist.Store
    store_use: StoreUse  # this rank's connections and requests to rank 0's store
    subgroups: list = dataclasses.field(default_factory=list)  # made with new_group: set_timeout moves them too

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def keep_data_cores(self, cores: int) -> None:
        """Re-plan this rank's threads with ``cores`` whole cores kept for the data loader, and apply the plan."""
        if cores == len(self.cpu.data_cpus):
            return
        self.cpu = plan_cpus(local_rank=self.env.local_rank, local_size=self.env.local_size,
                             comm_threads=len(self.cpu.comm_cpus), data_cores=cores, task_cpus=set(self.cpu.task_cpus))
        apply_cpu_plan(self.cpu)


def apply_cpu_plan(plan: CpuPlan, environ: dict[str, str] | None = None) -> None:
    """Bind this process, set OMP_NUM_THREADS (for child processes) and torch's thread count."""
    environ = os.environ if environ is None else environ
    limit = environ.get("OMP_THREAD_LIMIT")
    if limit is not None and int(limit) < plan.threads:
        raise ConfigError(f"OMP_THREAD_LIMIT={limit} is below the {plan.threads} threads this rank computes with; "
                          f"backward can hang when the limit is reached. Unset OMP_THREAD_LIMIT or set it >= {plan.threads}")
    if set(plan.task_cpus) != os.sched_getaffinity(0):
        os.sched_setaffinity(0, plan.task_cpus)
    environ["OMP_NUM_THREADS"] = str(plan.threads)
    torch.set_num_threads(plan.threads)


def init_distributed(backend: str = "auto", *, timeout: timedelta = STARTUP_TIMEOUT, comm_threads: int | None = None,
                     data_cores: int = 0, heartbeat_s: float = 2.0, env: RankEnv | None = None,
                     ccl_lib: str | None = None, count_store: bool = False) -> DistContext:
    """Discover this rank, tune its CPUs, and join the default process group.

    ``timeout`` bounds every collective, the first rendezvous included, and MPI's start (past it the rank
    exits 1 printing its stack: :func:`hpcdl.utils.exit_if_stuck`); shorten it with :func:`set_timeout` once
    the ranks are running. ``ccl_lib``: the libccl to use (see
    :mod:`hpcdl.distributed.ccl.library`). ``count_store``: count the process groups' requests to rank 0's
    store (``ctx.store_use``; for ``loop.record_startup``).
    """
    env = env or discover()
    with exit_if_stuck(timeout.total_seconds()):  # the check starts MPI, whose MPI_Init waits for every rank
        row, choice = choose_backend(backend, ccl_lib=ccl_lib)
    cpu = plan_cpus(local_rank=env.local_rank, local_size=env.local_size,
                    comm_threads=choice.comm_threads if comm_threads is None else comm_threads,
                    data_cores=data_cores)
    apply_cpu_plan(cpu)
    use = StoreUse(connections=1)
    store = serve_or_join(env, timeout)
    heartbeat = Heartbeat(env, heartbeat_s, use)
    liveness = group_liveness(heartbeat, heartbeat_s)
    row.prepare(env, cpu, liveness)
    if count_store:
        store = CountingStore(store, use)
    dist.init_process_group(choice.name, store=dist.PrefixStore("pg/", store), rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    ctx = DistContext(env=env, backend=choice, cpu=cpu, timeout=timeout, group=None, heartbeat=heartbeat,
                      liveness=liveness, store=store, store_use=use)
    _log_startup(ctx)
    return ctx


def _log_startup(ctx: DistContext) -> None:
    env = ctx.env
    log.info("distributed: %s", env.describe())
    log.info("backend %s (%s); collective timeout %s", ctx.backend.name, ctx.backend.reason, ctx.timeout)
    log.info("cpu: %s", ctx.cpu.describe())
    log.info("allocator: %s", allocator_in_use())
    ends = launcher_ends_survivors(env) if env.rank == 0 and env.world_size > 1 else None
    if ends:
        log.warning("%s (docs/launching.md)", ends)


def backend_groups(ctx: DistContext, names: str, timeout: timedelta | None = None) -> dict[str, dist.ProcessGroup]:
    """A group of all ranks on each backend in ``names`` (comma-separated rows of the table), beside the default
    group, for benchmarks that compare them in one job (collective). Created in the table's order: a process that
    loaded oneCCL first could not load the mpich wheel's MPI (their libfabrics differ; see docs/communication.md)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BACKENDS]
    if unknown or not wanted:
        raise ConfigError(f"--backends {names!r}: choose from {', '.join(BACKENDS)}, comma-separated")
    groups = {}
    for name in (n for n in BACKENDS if n in wanted):
        row, choice = choose_backend(name)
        row.prepare(ctx.env, ctx.cpu, ctx.liveness)
        groups[choice.name] = dist.new_group(list(range(ctx.world_size)), timeout=timeout or ctx.timeout,
                                             backend=choice.name)
        log.info("backend %s beside the default group (%s)", choice.name, choice.reason)
    return groups


def set_timeout(ctx: DistContext, timeout: timedelta) -> None:
    """Bound every later collective by ``timeout``: on ``ctx.group`` (the first call creates it over all ranks,
    a collective call) and on every group made with :func:`new_subgroup`, in place, so that a DDP or a hook
    built on them keeps them."""
    if ctx.group is None:
        ctx.group = dist.new_group(ranks=list(range(ctx.world_size)), timeout=timeout, backend=ctx.backend.name)
    else:
        for group in (ctx.group, *ctx.subgroups):
            set_group_timeout(group, timeout)
    ctx.timeout = timeout
    log.info("collective timeout now %s", timeout)


def new_subgroup(ctx: DistContext, ranks: list[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` (collective, every rank) on the job's backend, under ``ctx``'s timeout now and
    after every :func:`set_timeout`."""
    group = dist.new_group(ranks, timeout=ctx.timeout, backend=ctx.backend.name)
    ctx.subgroups.append(group)
    return group


def set_group_timeout(group, timeout: timedelta) -> None:
    """Change a group's collective timeout in place: hpcdl's own groups (MPI, oneCCL) keep it as an attribute
    their watchdog reads; torch's (gloo) through ``dist.set_timeout`` (torch 2.9+)."""
    ours = library_group(group)
    if ours is not None:
        ours.timeout = timeout
    elif dist.get_rank(group) >= 0:  # a member (new_group returns a placeholder to the others)
        dist.set_timeout(timeout, group)


def shutdown(ctx: DistContext) -> None:
    ctx.heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_together(ctx: DistContext, within_s: float, name: str | None = None,
                   alone: Callable[[], None] = lambda: None) -> bool:
    """For a rank that stops on an error: True once every rank of the job has called this too (they all raised the
    error after the collective that agreed on it), False after ``within_s`` (the error is this rank's alone, and the
    others wait in a collective with it), when ``alone()`` is called before this returns.

    Every rank is past the agreeing collective before any leaves: one that left right after it could take with it a
    message that a peer's side of it still waited for (hpcdl.train.leaving). Rank 0 serves the store, so it leaves
    last, once every other rank has had its answer (or ``within_s`` more). Over rank 0's store (torchrun's agent's
    under torchrun), flat in the rank count: an add and a wait per rank, and one more add or wait; ``name``: this
    start's own (the rescue folder's: a store that outlives a start holds an earlier start's keys). The requests run
    on a thread, so that a store that does not answer (rank 0 stopped) costs ``within_s``; the thread is waited for,
    ``within_s`` at most, so that none is left inside a store call when the interpreter finalizes (that aborts it)."""
    arrived, done = threading.Event(), threading.Event()
    base = f"hpcdl/leaving/{name or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    others = ctx.world_size - 1

    def arrive(store: dist.Store) -> None:
        with contextlib.suppress(Exception):  # a store gone or slow: the bounds decide
            if store.add(f"{base}/here", 1) == ctx.world_size:
                store.set(f"{base}/all", "1")
            store.wait([f"{base}/all"], timedelta(seconds=within_s))
            arrived.set()
            if ctx.rank == 0 and others:
                store.wait([f"{base}/heard"], timedelta(seconds=within_s))
            elif ctx.rank and store.add(f"{base}/answered", 1) == others:
                store.set(f"{base}/heard", "1")
            done.set()

    thread = threading.Thread(target=arrive, args=(ctx.store,), name="hpcdl-leaving", daemon=True)
    thread.start()
    if arrived.wait(within_s):
        done.wait(within_s)
        return True
    alone()
    thread.join(within_s)
    return False
