"""An MPI process group through mpi4py: MPI for torch.distributed without rebuilding torch.

torch's wheels carry no MPI backend, and the name ``mpi`` is reserved for the one a source build
has, so this registers as ``mpi4py`` (``--backend mpi`` selects it). It runs on whatever MPI mpi4py
was built against: the MPICH or Open MPI wheels from PyPI, or a cluster's Intel MPI or MVAPICH.

The queue, the communication thread (one per group), the watchdog and the error messages are
:mod:`hpcdl.distributed.group.python_backend`'s. Small collectives run on the caller's thread when nothing is queued: both
paths use MPI's nonblocking calls, because MPI does not match a nonblocking collective on one rank with
a blocking one on another and ranks choose their path independently; the inline one polls its request
against the timeout, so a lost peer still fails it. The thread's lock keeps MPI calls from two threads
apart and in issue order, so MPI needs ``MPI_THREAD_SERIALIZED``, which is checked. MPI has no fp16 or
bf16 type everywhere: those tensors are reduced in fp32.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.distributed.group.python_backend import CommThread, Liveness, ThreadedProcessGroup
from hpcdl.distributed.mpi.runtime import load_mpi
from hpcdl.errors import LaunchError

__all__ = ["BACKEND_NAME", "MPIProcessGroup", "register"]

BACKEND_NAME = "mpi4py"


class MPIProcessGroup(ThreadedProcessGroup):
    """A torch process group whose collectives run on an MPI communicator of its ranks.

    ``global_ranks``: the job ranks in the group (``None``: all of them); a new communicator over
    exactly those is created (collective over them only, as ``dist.new_group`` is).
    """

    BACKEND_NAME = BACKEND_NAME
    LIBRARY = "MPI"
    NATIVE = frozenset({torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
    inline_bytes = 64 * 1024
    IN_PLACE_ALLGATHER = True  # MPI_IN_PLACE

    def __init__(self, rank: int, world_size: int, timeout: timedelta, global_ranks: list[int] | None = None,
                 liveness: Liveness | None = None):
        super().__init__(rank, world_size, timeout, CommThread("hpcdl-mpi", liveness=liveness))
        MPI = self.MPI = load_mpi(timeout.total_seconds() or None)  # MPI starts here: bounded by the timeout
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise LaunchError(f"MPI runs at thread level {level}, below MPI_THREAD_SERIALIZED: hpcdl's communication "
                              "thread cannot call it. Initialize MPI with threads (mpi4py.rc.thread_level='multiple', "
                              "the default) or use an MPI built with thread support")
        world = MPI.COMM_WORLD
        if global_ranks is None or list(global_ranks) == list(range(world.Get_size())):
            self.comm = world.Dup()
        else:
            self.comm = world.Create_group(world.Get_group().Incl(list(global_ranks)))
        if (self.comm.Get_rank(), self.comm.Get_size()) != (rank, world_size):
            raise LaunchError(f"MPI says rank {self.comm.Get_rank()} of {self.comm.Get_size()} but the launcher's "
                              f"variables say rank {rank} of {world_size}: start the job with mpiexec or srun --mpi, "
                              "not with a launcher that MPI does not know")
        self._ops = {"SUM": MPI.SUM, "MAX": MPI.MAX, "MIN": MPI.MIN, "PRODUCT": MPI.PROD}

    def library_op(self, name: str):
        return self._ops.get(name)

    def _wait(self, request, inline: bool) -> None:
        """Wait for MPI's nonblocking ``request``: polled against the timeout when inline."""
        if not inline:
            request.Wait()
            return
        for _ in range(1000):  # a small collective completes within microseconds: poll before reading clocks
            if request.Test():
                return
        deadline = time.monotonic() + (self.timeout.total_seconds() or float("inf"))
        while not request.Test():
            if time.monotonic() > deadline:
                raise TimeoutError()

    def _allreduce(self, buf, op, inline):
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf.numpy(), op=op), inline)

    def _reduce(self, buf, op, root, inline):
        mine = self.comm.Get_rank() == root
        self._wait(self.comm.Ireduce(self.MPI.IN_PLACE if mine else buf.numpy(), buf.numpy() if mine else None,
                                     op=op, root=root), inline)

    def _broadcast(self, buf, root, inline):
        self._wait(self.comm.Ibcast(_raw(buf), root=root), inline)

    def _allgather(self, send, recv, inline):
        self._wait(self.comm.Iallgather(self.MPI.IN_PLACE if send is None else _raw(send), _raw(recv)), inline)

    def _reduce_scatter(self, send, recv, op, inline):
        self._wait(self.comm.Ireduce_scatter_block(send.numpy(), recv.numpy(), op=op), inline)

    def _barrier(self, inline):
        self._wait(self.comm.Ibarrier(), inline)

    def shutdown(self) -> None:
        self.thread.shutdown()


def _raw(t: torch.Tensor):
    """A byte view for MPI calls that only move data (no arithmetic), any dtype."""
    return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy()


def create(opts, pg_options=None, *, liveness: Liveness | None = None) -> MPIProcessGroup:
    """torch's factory for ``mpi4py`` groups (``extended_api``)."""
    return MPIProcessGroup(opts.group_rank, opts.group_size, opts.timeout, list(opts.global_ranks_in_group) or None,
                           liveness=liveness)


def register(liveness: Liveness | None = None) -> None:
    """Make ``mpi4py`` a torch.distributed backend name (once per process); its groups' watchdogs ask
    ``liveness`` about a long collective."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, functools.partial(create, liveness=liveness), extended_api=True,
                                      devices=["cpu"])
