"""Process groups: ``init_distributed`` and the machinery that names a lost rank.

The heartbeat lives in :mod:`hpcdl.distributed.group.liveness`. Every rank bumps a counter in the rendezvous store every ``heartbeat_s`` seconds from a daemon
thread. When a collective fails (a peer's socket closed, or the collective timed out), the rank
reads the counters twice and names the ranks whose counters stood still. If the store itself is
gone, rank 0, which serves it, is the one lost.

Every request a probe sends is bounded (:attr:`Heartbeat.deadline_s`): a TCPStore client's timeout bounds
its connection and its waits for a key, not a request to a server that accepted the connection and does
not answer (:meth:`Heartbeat._bounded`). A stopped rank 0 (SIGSTOP, a node frozen) is such a server: before the bound, a probe that
asked it waited for ever, and with it the rescue's watch and the oneCCL watchdog (issue 44). A request
unanswered by its deadline reads as a store that no longer answers, rank 0 lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.distributed.affinity import CpuPlan, allocator_in_use, plan_cpus
from hpcdl.distributed.backend import BACKENDS, BackendChoice, choose_backend
from hpcdl.distributed.ranks.env import RankEnv, discover, launcher_ends_survivors
from hpcdl.distributed.group.liveness import CountingStore, Heartbeat, StoreUse
from hpcdl.distributed.group.python_backend import Liveness, library_group
from hpcdl.errors import ConfigError, LaunchError, RankLostError
from hpcdl.utils import exit_if_stuck

__all__ = ["STARTUP_TIMEOUT", "DistContext", "apply_cpu_plan", "backend_groups", "fail_fast", "init_distributed", "new_subgroup",
           "set_group_timeout", "set_timeout",
           "shutdown"]

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
    store = _server_or_client(env, timeout)
    heartbeat = Heartbeat(env, heartbeat_s, use)
    liveness = _liveness(heartbeat, heartbeat_s)
    row.prepare(env, cpu, liveness)
    if count_store:
        store = CountingStore(store, use)
    dist.init_process_group(choice.name, store=dist.PrefixStore("pg/", store), rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    ctx = DistContext(env=env, backend=choice, cpu=cpu, timeout=timeout, group=None, heartbeat=heartbeat,
                      liveness=liveness, store=store, store_use=use)
    _log_startup(ctx)
    return ctx


def _liveness(heartbeat: Heartbeat, heartbeat_s: float) -> Liveness:
    """What lets hpcdl's own groups (MPI, oneCCL) fail a collective whose peer died as soon as its heartbeat has
    stopped, instead of at the timeout (gloo notices a closed connection itself)."""

    def probe() -> str | None:
        lost = heartbeat.watch()
        if lost is None:
            return "rank 0's rendezvous store no longer answers"
        return ("heartbeat stopped on " + ", ".join(f"rank {r}" for r in lost)) if lost else None

    return Liveness(probe, max(6.0, 3 * heartbeat_s))


def _server_or_client(env: RankEnv, timeout: timedelta) -> dist.TCPStore:
    # Under torchrun the agent already serves a store on MASTER_PORT: every rank is its client.
    serve = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=serve,
                             timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        where = f"{env.master_addr}:{env.master_port}"
        if env.rank == 0:
            raise LaunchError(f"rank 0 cannot serve the rendezvous store on {where} ({exc}); the port may be in use "
                              "by another job step on this node: set MASTER_PORT to a free port") from exc
        raise LaunchError(f"rank {env.rank} cannot reach the rendezvous store at {where} within {timeout} ({exc}); "
                          "check that rank 0 started and that this address is reachable from "
                          f"{env.hostname} (set MASTER_ADDR to override)") from exc


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


@contextlib.contextmanager
def fail_fast(ctx: DistContext, hook_failure: Callable[[], BaseException | None] = lambda: None,
              on_lost: Callable[[str], None] | None = None) -> Iterator[None]:
    """Turn a failed collective into a :class:`RankLostError` that names the lost rank.

    A ``torch.distributed.DistError`` (timeouts, the MPI group's failures) is a collective's. gloo reports
    a peer that died as a plain RuntimeError, like any bug in the model; that one becomes a RankLostError
    only when the heartbeats show a rank or the store gone, and otherwise goes on as it was raised.
    ``hook_failure``: the gradient bucket collective that failed, kept typed by the comm hook's timer
    (:attr:`hpcdl.distributed.gradients.ddp.CommTimer.failure`; DDP re-raises it as text only), or None.
    ``on_lost``: called with the message instead of raising (the trainer's just-in-time checkpoint, which
    ends the process).
    """
    try:
        yield
    except RuntimeError as exc:
        failure = hook_failure()
        message = explain_failure(ctx, failure or exc, collective=failure is not None or is_collective_error(exc))
        if message is None:
            raise
        if on_lost is not None:
            on_lost(message)
        raise RankLostError(message) from exc


# Collective failures that reach Python as plain RuntimeErrors, by their text: gloo's own outside DDP's hooks (a
# barrier, a direct all-reduce), and hpcdl's groups' through DDP's own reduction (hook none: the reducer keeps
# the text of the Work's error, ThreadedProcessGroup.failed or the watchdog's).
_COLLECTIVE_MARKS = ("gloo/transport", "Timed out waiting", "oneCCL allreduce of", "MPI allreduce of")


def is_collective_error(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or any(mark in str(exc) for mark in _COLLECTIVE_MARKS)


def explain_failure(ctx: DistContext, exc: BaseException, collective: bool = True) -> str | None:
    """What went wrong, from the heartbeats; None when ``exc`` need not be a collective's and no rank is lost."""
    text = str(exc).strip().removeprefix("Got the following error when running the callback: ")
    first = text.splitlines()[0] if text else type(exc).__name__
    lost = ctx.heartbeat.lost_ranks(fresh_s=30.0)
    if lost is None:
        return (f"rank 0 was lost (it served the rendezvous store at {ctx.env.master_addr}:{ctx.env.master_port}, "
                f"which no longer answers); rank {ctx.rank} stops. Collective error: {first}")
    if lost:
        names = "; ".join(f"rank {r} ({ctx.heartbeat.who(r)})" for r in lost)
        return f"lost {names}: heartbeat stopped; rank {ctx.rank} stops. Collective error: {first}"
    if not collective:
        return None
    return (f"a collective failed on rank {ctx.rank} while every rank's heartbeat is alive (a rank stuck, or the "
            f"network): {first}")


def shutdown(ctx: DistContext) -> None:
    ctx.heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
