"""A oneCCL process group on oneCCL's C API: oneCCL for torch.distributed on the torch we ship,
without Intel's end-of-life torch-ccl bindings.

Registered as ``oneccl`` (``--backend ccl`` selects it). The library comes from
:mod:`hpcdl.distributed.ccl.library`. Each group's communicator is created from a unique id that the group's
rank 0 makes and the others read from the group's rendezvous store (oneCCL's id carries rank 0's
key-value-store address; no PMI and no MPI launcher are needed). oneCCL reduces fp16 and bf16 itself;
AVG (which oneCCL's CPU plugin rejects) is a sum divided by the size, and the barrier a one-element
all-reduce, both from :mod:`hpcdl.distributed.group.python_backend`.

oneCCL must be called from one thread per process (two communicators used from two threads at once
crash it), so every group of a process shares one :class:`CommThread` and nothing runs inline. oneCCL
cannot abort a call: a collective whose peer is gone blocks that thread for good; the watchdog fails
its Work after the timeout, and at exit the process leaves without finalizing oneCCL. Sometimes its transport
does notice (libfabric shm reading from a peer that died mid-message) and oneCCL throws a C++ exception through its
C API, which ends in ``abort()`` on that thread: a SIGABRT handler (:func:`guard_aborts`) turns that into the same
failed Work, so the survivor names the lost rank instead of dying with a backtrace.

libfabric's ``shm`` transport keeps each process's queues in a 64 MB file ``/dev/shm/PID:UID:N``, which
only a clean finalize removes. A process that leaves without finalizing (above) removes its own files on
the way out; one killed outright leaves them behind, and a later process that gets the same PID then
failed to create its communicator ("fi_enable: Device or resource busy": libfabric takes a file named
with a live PID for one in use). Such a file is stale by construction, since its PID is now this
process's, and so is one whose PID no process has any longer: a process removes both kinds before its
first communicator and on the way out (:func:`shm_files`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.futures import Future

from hpcdl.distributed.ccl import library
from hpcdl.distributed.group.comm_thread import describe
from hpcdl.distributed.group.python_backend import CommThread, Liveness, ThreadedProcessGroup, unwrapped
from hpcdl.distributed.native import c_comm_thread, ccl_backend
from hpcdl.utils import before_leaving

__all__ = ["BACKEND_NAME", "CCLProcessGroup", "register"]

BACKEND_NAME = "oneccl"
_TYPES = {torch.float32: "onecclFloat32", torch.float64: "onecclFloat64", torch.float16: "onecclFloat16",
          torch.bfloat16: "onecclBfloat16", torch.int8: "onecclInt8", torch.uint8: "onecclUint8",
          torch.int32: "onecclInt32", torch.int64: "onecclInt64"}
_OPS = {"SUM": "onecclSum", "PRODUCT": "onecclProd", "MAX": "onecclMax", "MIN": "onecclMin"}
_thread: CommThread | None = None
_thread_lock = threading.Lock()

SHM_DIR = Path("/dev/shm")
log = logging.getLogger(__name__)


def comm_thread(liveness: Liveness | None = None) -> CommThread:
    """The process's one oneCCL thread (made with its first group, after stale shm files are gone; its watchdog
    asks that group's ``liveness`` about a long collective)."""
    global _thread
    with _thread_lock:
        if _thread is None:
            gone = remove_shm_files()
            if gone:
                log.info("removed %d stale libfabric shm file(s), named with this PID or with one no process has "
                         "any longer: %s", len(gone), ", ".join(gone))
            before_leaving(remove_shm_files)
            _thread = CommThread("hpcdl-oneccl", exit_if_stuck=True, liveness=liveness)
            _thread.fast = c_comm_thread.load()
        return _thread


_ABORTED = "aborted inside oneCCL (a C++ exception through its C API: its transport failed, usually a peer gone)"
_ON_SIGNAL = ctypes.CFUNCTYPE(None, ctypes.c_int)
_abort_guard = None  # the C handler, kept alive for the process


def guard_aborts() -> None:
    """From now on, an ``abort()`` on the oneCCL thread fails the collective in progress and parks the thread
    (:meth:`CommThread.park`); on any other thread the process aborts as before (the handler returns, and
    glibc's ``abort`` then ends it with the default action). Set after the first communicator, since libfabric's
    providers set a SIGABRT handler of their own (a backtrace printer) while oneCCL starts."""
    global _abort_guard
    if _abort_guard is not None:
        return

    def on_abort(signum: int) -> None:
        thread = _thread
        if thread is not None and thread.fast is not None and thread.fast.is_current():
            thread.fast.park()  # its waiter reads ABORTED: see CCLProcessGroup._collect
        if thread is not None and thread.is_current():
            thread.park(_ABORTED)

    _abort_guard = _ON_SIGNAL(on_abort)
    libc = ctypes.CDLL(None)
    libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, [ctypes.c_int, _ON_SIGNAL]
    libc.signal(signal.SIGABRT, _abort_guard)


def shm_files(root: Path = SHM_DIR) -> list[Path]:
    """libfabric shm's files that are stale or about to be: ``PID:UID:N`` (libfabric 1.x's
    ``smr_endpoint_name``, with the ``fi_shm://`` prefix that ``shm_open`` does not keep) of this user whose PID
    is this process's or no running process's (a rank killed outright, which could not remove its own).

    A process in another PID namespace on the same ``/dev/shm`` looks dead from here; ranks of one job share
    the node's PID namespace (Slurm's tasks, and Apptainer's containers by default)."""
    mine, uid = os.getpid(), os.getuid()
    found = []
    for path in root.glob(f"*:{uid}:*"):
        pid, _, n = path.name.split(":", 2)
        if pid.isdigit() and n.isdigit() and (int(pid) == mine or not Path(f"/proc/{pid}").exists()):
            found.append(path)
    return sorted(found)


def remove_shm_files(root: Path = SHM_DIR) -> list[str]:
    """Unlink :func:`shm_files`; the names removed. A process that maps one keeps its memory until it unmaps."""
    gone = []
    for path in shm_files(root):
        try:
            path.unlink()
            gone.append(path.name)
        except FileNotFoundError:  # another rank of the node removed it first
            pass
    return gone


class _OnCThread:
    """``OneCCL.runner`` where c_comm_thread's C thread runs: the Python comm thread hands it every oneCCL call (a
    communicator's creation and destruction too), so that oneCCL sees one thread, the one that makes the small
    all-reduces, as it saw one before that thread existed. A call that aborted there parks the Python comm thread
    as an abort on it would (:meth:`CommThread.park`: its item fails with the abort's words, it blocks for good)."""

    def __init__(self, thread: CommThread):
        self.thread, self.fast = thread, thread.fast

    def call(self, fn: int, *args: int) -> int:
        rc = self.fast.call(fn, *args)
        if rc == c_comm_thread.ABORTED:
            self._aborted()
        return rc

    def run(self, fn):
        try:
            return self.fast.run(fn)
        except c_comm_thread.Aborted:
            self._aborted()

    def _aborted(self):
        if self.thread.is_current():
            self.thread.park(_ABORTED)
        raise library.OneCCLError(_ABORTED)


_AVG = dist.ReduceOp.RedOpType.AVG
DESTROY_WAIT_S = 20  # rank 0 waits this long at shutdown for the other ranks to destroy their communicators


class _FastWork(dist.Work):
    """The Work of an all-reduce queued on the C thread (:mod:`hpcdl.distributed.native.c_comm_thread`)."""

    def __init__(self, group: "CCLProcessGroup", ticket: int, tensors: list[torch.Tensor], average: bool):
        super().__init__()
        self.group, self.ticket, self.tensors, self.average = group, ticket, tensors, average
        self._error: Exception | None = None
        self._collected = False

    def _collect(self) -> list[torch.Tensor]:
        if not self._collected:
            self._error = self.group._collect(self.ticket, ("allreduce", self.tensors))
            self._collected = True
            if self._error is None and self.average:
                self.group._divide(self.tensors[0])
        if self._error is not None:
            raise self._error
        return self.tensors

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._collect()
        return True

    def is_completed(self) -> bool:
        return self._collected or self.group.thread.fast.done(self.ticket)

    def get_future(self) -> Future:
        """Completed by the Python thread, which runs an item only once the C thread's calls have finished."""
        future: Future = Future()
        if self._collected:
            try:
                future.set_result(self._collect())
            except Exception as exc:
                future.set_exception(exc)
            return future
        return self.group.ticket_future(self.ticket, self.tensors).then(self._after)

    def _after(self, future: Future) -> list[torch.Tensor]:
        self._collected, tensors = True, future.value()  # raises the collective's error
        if self.average:
            self.group._divide(tensors[0])
        return tensors


class CCLProcessGroup(ThreadedProcessGroup):
    """A torch process group over a oneCCL communicator of its ranks.

    An all-reduce of one tensor of at most ``fast_bytes`` (a control flag, a metric, a loss) issued while the
    Python thread has nothing queued goes to the C thread instead (:mod:`hpcdl.distributed.native.c_comm_thread`); its
    Work's ``wait`` applies the group's timeout and asks the heartbeats about a long wait, as the watchdog does. Its
    ``ticket_*`` methods are what ccl_backend.cpp calls (:class:`ccl_backend.BackendCallbacks`).
    """

    BACKEND_NAME = BACKEND_NAME
    LIBRARY = "oneCCL"
    NATIVE = frozenset(_TYPES)
    inline_bytes = 0  # one thread calls oneCCL
    IN_PLACE_ALLGATHER = True  # NCCL's convention: the send buffer at this rank's part of the receive buffer
    fast_bytes = 64 * 1024

    def __init__(self, rank: int, world_size: int, timeout: timedelta, store: dist.Store,
                 liveness: Liveness | None = None):
        super().__init__(rank, world_size, timeout, comm_thread(liveness))
        self.ccl = ccl = library.load()
        if self.thread.fast is not None and ccl.runner is None:
            ccl.runner = _OnCThread(self.thread)  # from here on every oneCCL call of the process is made there
        self._types = {dtype: ccl.enums[name] for dtype, name in _TYPES.items()}
        self._ops = {op: ccl.enums[name] for op, name in _OPS.items()}
        self.store = store
        if rank == 0:
            store.set("hpcdl/oneccl-id", self.thread.run_here(ccl.unique_id))
        uid = store.get("hpcdl/oneccl-id")  # waits for rank 0, within the store's timeout
        self.comm = self.thread.run_here(lambda: ccl.init_rank(world_size, uid, rank), self,
                                         f"communicator creation ({world_size} ranks)")
        self.thread.closers[id(self)] = self._destroy  # at exit, if nobody destroyed the group before
        guard_aborts()
        self._one = torch.zeros(1)
        self._fast_allreduce = ctypes.cast(self.ccl.lib.onecclAllReduce, ctypes.c_void_p).value
        self._fast_ops = {getattr(dist.ReduceOp.RedOpType, name): op for name, op in self._ops.items()}
        self._fast_ops[_AVG] = self._ops["SUM"]
        if hasattr(self, "_configure_fast") and self.thread.fast is not None:  # ccl_backend's C++ all-reduce
            self._configure_fast(self._fast_allreduce, self.comm.value, list(self._types.items()),
                                 {int(k): v for k, v in self._fast_ops.items() if k != _AVG}, self.fast_bytes)

    def allreduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        fast = self.thread.fast
        if fast is not None and len(tensors) == 1:
            t, kind = tensors[0], opts.reduceOp.op
            op, dtype = self._fast_ops.get(kind), self._types.get(t.dtype)
            if op is not None and dtype is not None and t.nbytes <= self.fast_bytes and t.is_contiguous():
                ptr = t.data_ptr()  # onecclAllReduce(send, recv, count, dtype, op, comm, stream), unless the Python
                ticket = fast.submit_if_idle(self._fast_allreduce, 7, ptr, ptr, t.numel(), dtype, op,  # thread has
                                             self.comm.value, 0, 0)  # calls queued: then behind them, in issue order
                if ticket >= 0:
                    return _FastWork(self, ticket, tensors, kind == _AVG)
        return super().allreduce(tensors, opts)

    def _collect(self, ticket: int, what) -> Exception | None:
        """Wait for the C thread's ``ticket``: None when it succeeded, else the error its Work carries (the
        group's timeout, a lost peer named by the heartbeats, oneCCL's own error, an abort inside oneCCL)."""
        fast, start = self.thread.fast, time.monotonic()
        while (rc := fast.wait(ticket, 200)) is None:
            why = self.ticket_overdue(ticket, time.monotonic() - start, what)
            if why:
                return dist.DistBackendError(why)
        return dist.DistBackendError(self.ticket_error(ticket, rc, what)) if rc else None

    # -- BackendCallbacks: asked by the wait of a C thread's call, here and from ccl_backend.cpp (off the fast path)
    def ticket_overdue(self, ticket: int, waited_s: float, what) -> str | None:
        """The error of a wait for ``ticket`` that has run ``waited_s``: past the group's timeout, or a peer whose
        heartbeat stopped (:meth:`Liveness.poll`, as the watchdog asks: it never blocks); None to go on waiting."""
        why, liveness, limit = None, self.thread.liveness, self.timeout.total_seconds()
        if limit and waited_s > limit:
            why = self.timed_out()
        elif liveness and (lost := liveness.poll(waited_s)):
            why = f"cannot complete: {lost}"
        if not why:
            return None
        self.thread.fast.given_up = ticket  # at exit, the process leaves without finalizing oneCCL
        return f"rank {self.rank()}: {self.LIBRARY} {describe(_what(what))} {why}"

    def ticket_error(self, ticket: int, rc, what) -> str:
        """The error of a C thread's call that returned ``rc``: oneCCL's own words, or the abort inside it."""
        if int(rc) == c_comm_thread.ABORTED:
            return f"rank {self.rank()}: {self.LIBRARY} {describe(_what(what))} {_ABORTED}"
        try:
            self.ccl._check(int(rc), self.comm, "AllReduce")
        except library.OneCCLError as exc:
            return str(self.failed(_what(what), exc))
        return f"rank {self.rank()}: {self.LIBRARY} {describe(_what(what))} failed: return code {int(rc)}"

    def ticket_future(self, ticket: int, tensors: list[torch.Tensor]) -> Future:
        """A future of the C thread's all-reduce ``ticket``, completed by the Python thread (which runs an item
        only once the C thread's calls have finished)."""
        future: Future = Future()

        def collect(inline):
            error = self._collect(ticket, ("allreduce", tensors))
            if error is not None:
                raise error
            return tensors

        self.thread._enqueue(collect, future, self, ("allreduce", tensors))
        return future.then(unwrapped)

    def library_op(self, name: str):
        return self._ops.get(name)

    def _allreduce(self, buf, op, inline):
        self.ccl.call("AllReduce", self.comm, buf.data_ptr(), buf.data_ptr(), buf.numel(), self._types[buf.dtype], op)

    def _reduce(self, buf, op, root, inline):
        self.ccl.call("Reduce", self.comm, buf.data_ptr(), buf.data_ptr(), buf.numel(), self._types[buf.dtype], op,
                      root)

    def _broadcast(self, buf, root, inline):
        self.ccl.call("Broadcast", self.comm, buf.data_ptr(), buf.data_ptr(), buf.nbytes, self._types[torch.uint8],
                      root)

    def _allgather(self, send, recv, inline):
        part = recv.nbytes // self.size()  # in place (send None): this rank's part of recv, as NCCL's in-place call
        at = send.data_ptr() if send is not None else recv.data_ptr() + self.rank() * part
        self.ccl.call("AllGather", self.comm, at, recv.data_ptr(), part, self._types[torch.uint8])

    def _reduce_scatter(self, send, recv, op, inline):
        self.ccl.call("ReduceScatter", self.comm, send.data_ptr(), recv.data_ptr(), recv.numel(),
                      self._types[send.dtype], op)

    def _barrier(self, inline):
        self._allreduce(self._one, self._ops["SUM"], inline)

    def _destroy(self) -> None:
        """On the thread: destroy the communicator, once."""
        comm, self.comm = self.comm, None
        if comm is not None:
            self.ccl.destroy(comm)

    def shutdown(self) -> None:
        """Destroy the communicator on the thread (unless a call there never returned). A process that exits
        with a live communicator hangs in oneCCL's destructors: the thread destroys what is left at exit.

        Rank 0 destroys last: the other ranks' destruction removes their keys from the key-value store that
        oneCCL's id points at, which lives in rank 0's process, and a rank 0 gone first fails it ("kvs_remove_
        name_key ... Broken pipe", then a C++ exception and exit code 1: seen in a fresh clone's 4-rank job).
        The others say on the group's store that they are done; rank 0 waits for them, at most
        :data:`DESTROY_WAIT_S`, then destroys its own."""
        if self.thread.closers.pop(id(self), None) and not self.thread.stuck() and not self.thread.closed():
            if self.rank() != 0:
                self.thread.run_here(self._destroy)
                self.store.set(f"hpcdl/oneccl-destroyed/{self.rank()}", "1")
                return
            try:
                self.store.wait([f"hpcdl/oneccl-destroyed/{r}" for r in range(1, self.size())],
                                timedelta(seconds=DESTROY_WAIT_S))
            except (RuntimeError, dist.DistError) as exc:  # a rank gone: destroy anyway
                log.warning("oneccl group: not every rank destroyed its communicator within %d s (%s); rank 0 "
                            "destroys its own", DESTROY_WAIT_S, str(exc).splitlines()[0] if str(exc) else "timeout")
            self.thread.run_here(self._destroy)


def _what(what):
    """A C++ caller's ``what`` is the tensors alone."""
    return what if isinstance(what, (str, tuple)) else ("allreduce", what)


@functools.cache
def group_class() -> type:
    """:class:`CCLProcessGroup`, on ccl_backend's C++ backend where it builds (its small all-reduce without Python)."""
    ext = ccl_backend.load()
    if ext is None:
        return CCLProcessGroup
    ccl_backend.check_callbacks(CCLProcessGroup)  # a TypeError naming what differs: a bug, not a setting
    try:
        return type("CCLProcessGroup", (CCLProcessGroup, ext.FastBackend), {"__module__": __name__,
                                                                             "__doc__": CCLProcessGroup.__doc__})
    except TypeError as exc:  # a torch whose Python backends are not Backends (torch 2.8's ProcessGroup)
        log.warning("ccl_backend: its backend cannot be a base of the oneCCL group here (%s)", exc)
        return CCLProcessGroup


def create(opts, pg_options=None, *, liveness: Liveness | None = None) -> CCLProcessGroup:
    """torch's factory for ``oneccl`` groups (``extended_api``): the group's store carries the unique id."""
    return group_class()(opts.group_rank, opts.group_size, opts.timeout, opts.store, liveness=liveness)


def register(liveness: Liveness | None = None) -> None:
    """Make ``oneccl`` a torch.distributed backend name (once per process); its groups' watchdog asks
    ``liveness`` about a long collective."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, functools.partial(create, liveness=liveness), extended_api=True,
                                      devices=["cpu"])
