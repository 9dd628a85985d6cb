"""The oneCCL group's small collectives handed to a communication thread in C (``c_comm_thread.c``).

A collective through a Python backend crosses the interpreter twice more than the library call itself: the
caller queues it for the one thread that may call oneCCL, and that thread wakes, takes the interpreter lock,
calls, completes a future and wakes the caller, which takes the lock again. On the 2-core EPYC that hand-off
cost 30 of a one-float all-reduce's 40 us (oneCCL itself: 7.5). Here the caller queues the library's function
and its arguments for a thread in C, which spins a while before it sleeps, and waits for it in C with the
interpreter lock released; neither side runs Python between the two. The Python comm thread hands it the
library's other calls too (:meth:`FastComm.call`, :meth:`FastComm.run`), so that one thread makes them all.

The C file is built by :mod:`hpcdl.distributed.native.build` (``hpcdl ccl install``, or on first use where a
compiler is; a fraction of a second) into the user's cache; :func:`load` binds it and starts its thread. Where it
is not built (no compiler: the failure is recorded, and no rank retries it; a timeout or a full disk: not recorded,
the next process tries again), the group keeps its Python hand-off and says so once per process.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from hpcdl.distributed.native import build

__all__ = ["Aborted", "FastComm", "load"]

SPIN_US = 50  # each side polls this long before it sleeps: a one-float oneCCL all-reduce takes 7-9 us
ABORTED = -(2**62)  # the return code of a call that aborted inside the library (fc_park)
log = logging.getLogger(__name__)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_ssize_t)


class Aborted(RuntimeError):
    """A library call that :meth:`FastComm.run` made on the C thread aborted there (the thread is parked)."""


class FastComm:
    """The process's C communication thread: :meth:`submit` a library call, :meth:`wait` for it."""

    def __init__(self, path: Path, spin_us: int = SPIN_US):
        lib = ctypes.CDLL(str(path))
        lib.fc_submit.restype = ctypes.c_int64
        lib.fc_submit.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_ssize_t] * 8
        lib.fc_submit_if_idle.restype = ctypes.c_int64
        lib.fc_submit_if_idle.argtypes = lib.fc_submit.argtypes
        lib.fc_issued.restype = ctypes.c_int64
        lib.fc_drain.argtypes = [ctypes.c_long]
        lib.fc_elsewhere.argtypes = [ctypes.c_int]
        lib.fc_wait.argtypes = [ctypes.c_int64, ctypes.c_long, ctypes.POINTER(ctypes.c_ssize_t)]
        lib.fc_pending.restype = ctypes.c_int64
        lib.fc_start.argtypes = [ctypes.c_long]
        lib.fc_done.argtypes = [ctypes.c_int64]
        rc = lib.fc_start(spin_us)
        if rc:
            raise OSError(rc, f"c_comm_thread: the communication thread did not start: {os.strerror(rc)}")
        self.lib, self.path = lib, path
        self.submit = lib.fc_submit  # (function address, its argument count, 8 integers): a ticket, -1 when full
        # the same, -1 also while the Python thread has calls queued (counted by ``elsewhere``)
        self.submit_if_idle = lib.fc_submit_if_idle
        self.elsewhere = lib.fc_elsewhere  # +1 when a call is queued on the Python thread, -1 when it finished
        self.issued = lib.fc_issued  # tickets handed out so far
        self.given_up: int | None = None  # the last ticket whose waiter gave up on it (a timeout, a lost peer)
        self.parked = False

    def wait(self, ticket: int, timeout_ms: int) -> int | None:
        """The call's return code, or None if it has not finished within ``timeout_ms``."""
        rc = ctypes.c_ssize_t()  # its own: a caller's thread and the Python comm thread may wait at once
        if self.lib.fc_wait(ticket, timeout_ms, ctypes.byref(rc)):
            return rc.value
        return None

    def call(self, fn: int, *args: int) -> int:
        """Run the function at address ``fn`` on ``args`` (integers or pointers, at most 8) on the C thread and
        wait for it as long as it takes (the comm thread's watchdog times a collective): its return code, or
        :data:`ABORTED` when it aborted there."""
        padded = (*args, *(0,) * (8 - len(args)))
        while (ticket := self.submit(fn, len(args), *padded)) < 0:
            self.drain(200)  # the queue is full: let it run
        while (rc := self.wait(ticket, 1000)) is None:
            pass
        return rc

    def run(self, fn):
        """``fn()`` run on the C thread (a ctypes callback, which takes the interpreter lock there): its result,
        or its exception raised here; :class:`Aborted` when a library call in it aborted."""
        out: dict = {}

        def body() -> int:
            try:
                out["value"] = fn()
            except BaseException as exc:  # raised to the caller below, on its own thread
                out["error"] = exc
            return 0

        callback = _CALLBACK(body)  # alive until the call has finished: this frame waits for it
        if self.call(ctypes.cast(callback, ctypes.c_void_p).value) == ABORTED:
            raise Aborted("a library call on the communication thread aborted")
        if "error" in out:
            raise out["error"]
        return out["value"]

    def done(self, ticket: int) -> bool:
        return bool(self.lib.fc_done(ticket))

    def drain(self, timeout_ms: int) -> bool:
        """Wait at most ``timeout_ms`` for every call issued so far; whether none is left."""
        return bool(self.lib.fc_drain(timeout_ms))

    def pending(self) -> int:
        """Calls queued or running."""
        return self.lib.fc_pending()

    def is_current(self) -> bool:
        return bool(self.lib.fc_is_current())

    def stuck(self) -> bool:
        """Whether the thread is inside a call that will not return: one a waiter gave up on, or parked."""
        return self.parked or (self.given_up is not None and not self.done(self.given_up))

    def park(self) -> None:
        """On the C thread, from the SIGABRT handler: fail the call in progress (:data:`ABORTED`) and block."""
        self.parked = True
        self.lib.fc_park()

    def stop(self) -> None:
        self.lib.fc_stop()


_LOADED: FastComm | None = None
_TRIED = False


def load(environ=os.environ) -> FastComm | None:
    """The process's :class:`FastComm`, bound and started once (built first where it is neither built nor recorded as
    failed: :func:`hpcdl.distributed.native.build.ensure`); None, said once, where it is not there, or where
    ``HPCDL_FASTCOMM=0`` turns it off."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    if environ.get("HPCDL_FASTCOMM", "1") == "0":
        log.info("c_comm_thread: off (HPCDL_FASTCOMM=0); small oneCCL collectives go through the Python thread")
        return None
    built = build.ensure("c_comm_thread", environ)
    why, remedy = built.describe(), built.retry()
    if built.path is not None:
        try:
            _LOADED = FastComm(built.path)
            return _LOADED
        except OSError as exc:  # built for another glibc, or a thread that cannot start
            why, remedy = f"{built.path} does not load or start: {exc}", build.rebuild_advice(environ)
    log.warning("c_comm_thread: not used (%s); small oneCCL collectives go through the Python thread (about 30 us more "
                "each); %s", why, remedy)
    return None
