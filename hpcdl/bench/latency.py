"""The small-message latency ``hpcdl bench sync`` reports: a one-float all-reduce through torch.distributed, and
beside it the floors under it (raw mpi4py, a bare Python backend that does nothing but MPI's call, raw oneCCL on
the group's communication thread), so that what torch's dispatch and hpcdl's group add is read off one table."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hpcdl.distributed.ccl.group import CCLProcessGroup
from hpcdl.distributed.group.python_backend import DoneWork, library_group
from hpcdl.distributed.mpi.group import MPIProcessGroup

__all__ = ["latency_us", "raw_mpi"]


def raw_mpi():
    from mpi4py import MPI

    return MPI.COMM_WORLD, MPI


def _bare_group(group):
    """For the latency floor only: a group of ``group``'s ranks on a Python backend whose all-reduce is
    nothing but MPI's (no op, dtype or layout checks, no queue, no timeout): what any Python backend
    pays for torch.distributed's dispatch. Not a backend to train with."""

    class BareMPI(MPIProcessGroup):
        def allreduce(self, tensors, opts):
            request = self.comm.Iallreduce(self.MPI.IN_PLACE, tensors[0].numpy())
            while not request.Test():
                pass
            return DoneWork(tensors)

    if "mpi4py-bare" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "mpi4py-bare", lambda o, _=None: BareMPI(o.group_rank, o.group_size, o.timeout,
                                                     list(o.global_ranks_in_group) or None),
            extended_api=True, devices=["cpu"])
    return dist.new_group(dist.get_process_group_ranks(group), backend="mpi4py-bare")


def latency_us(iters: int, group, mpi) -> dict[str, float]:
    """Microseconds per one-float all-reduce over ``group``, by path: torch.distributed; with ``mpi`` (:func:`raw_mpi`),
    a bare Python backend and raw mpi4py; on a oneccl group, raw oneCCL."""
    x = torch.zeros(1)
    out = {}
    cases = [("torch.distributed", lambda: dist.all_reduce(x, group=group))]
    if mpi:
        bare = _bare_group(group)
        cases += [("bare Python backend", lambda: dist.all_reduce(x, group=bare)),
                  ("raw mpi4py", lambda: mpi[0].Allreduce(mpi[1].IN_PLACE, x.numpy()))]
    for name, fn in cases:
        for _ in range(50):
            fn()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) / iters * 1e6
    raw = _raw_oneccl(group, x)
    if raw:
        raw(50)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        raw(iters)
        out["raw oneCCL"] = (time.perf_counter() - t0) / iters * 1e6
    return out


def _raw_oneccl(group, x):
    """For a oneccl group: ``loop(n)`` makes n one-float onecclAllReduce calls in a row on the thread that
    makes the group's oneCCL calls (the C thread, or the Python one without it), so no hand-off is timed:
    oneCCL's own latency through ctypes. None for other backends."""
    pg = library_group(group)
    if not isinstance(pg, CCLProcessGroup):
        return None
    args = (pg.comm, x.data_ptr(), x.data_ptr(), 1, pg.ccl.enums["onecclFloat32"], pg.ccl.enums["onecclSum"])

    def loop(n: int) -> None:
        def calls():
            for _ in range(n):
                pg.ccl.call_here("AllReduce", *args)

        pg.thread.run_here(lambda: pg.ccl.run(calls))

    return loop
