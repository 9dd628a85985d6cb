"""A oneCCL process group on oneCCL's C API: oneCCL for torch.distributed on the torch we ship,
without Intel's end-of-life torch-ccl bindings.

Registered as ``oneccl`` (``--backend ccl`` selects it). The library comes from
:mod:`hpcdl.distributed.ccl_runtime`. Each group's communicator is created from a unique id that the group's
rank 0 makes and the others read from the group's rendezvous store (oneCCL's id carries rank 0's
key-value-store address; no PMI and no MPI launcher are needed). oneCCL reduces fp16 and bf16 itself;
AVG (which oneCCL's CPU plugin rejects) is a sum divided by the size, and the barrier a one-element
all-reduce, both from :mod:`hpcdl.distributed.threaded`.

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
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hpcdl.distributed import ccl_runtime
from hpcdl.distributed.threaded import CommThread, Liveness, ThreadedProcessGroup
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
        return _thread


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
        if thread is not None and thread.is_current():
            thread.park("aborted inside oneCCL (a C++ exception through its C API: its transport failed, "
                        "usually a peer gone)")

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


class CCLProcessGroup(ThreadedProcessGroup):
    """A torch process group over a oneCCL communicator of its ranks."""

    BACKEND_NAME = BACKEND_NAME
    LIBRARY = "oneCCL"
    NATIVE = frozenset(_TYPES)
    inline_bytes = 0  # one thread calls oneCCL

    def __init__(self, rank: int, world_size: int, timeout: timedelta, store: dist.Store,
                 liveness: Liveness | None = None):
        super().__init__(rank, world_size, timeout, comm_thread(liveness))
        self.ccl = ccl = ccl_runtime.load()
        self._types = {dtype: ccl.enums[name] for dtype, name in _TYPES.items()}
        self._ops = {op: ccl.enums[name] for op, name in _OPS.items()}
        if rank == 0:
            store.set("hpcdl/oneccl-id", self.thread.run_here(ccl.unique_id))
        uid = store.get("hpcdl/oneccl-id")  # waits for rank 0, within the store's timeout
        self.comm = self.thread.run_here(lambda: ccl.init_rank(world_size, uid, rank), self,
                                         f"communicator creation ({world_size} ranks)")
        self.thread.closers[id(self)] = self._destroy  # at exit, if nobody destroyed the group before
        guard_aborts()
        self._one = torch.zeros(1)

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
        self.ccl.call("AllGather", self.comm, send.data_ptr(), recv.data_ptr(), send.nbytes, self._types[torch.uint8])

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
        with a live communicator hangs in oneCCL's destructors: the thread destroys what is left at exit."""
        if self.thread.closers.pop(id(self), None) and not self.thread.stuck() and not self.thread.closed():
            self.thread.run_here(self._destroy)


def create(opts, pg_options=None, *, liveness: Liveness | None = None) -> CCLProcessGroup:
    """torch's factory for ``oneccl`` groups (``extended_api``): the group's store carries the unique id."""
    return CCLProcessGroup(opts.group_rank, opts.group_size, opts.timeout, opts.store, liveness=liveness)


def register(liveness: Liveness | None = None) -> None:
    """Make ``oneccl`` a torch.distributed backend name (once per process); its groups' watchdog asks
    ``liveness`` about a long collective."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, functools.partial(create, liveness=liveness), extended_api=True,
                                      devices=["cpu"])
