"""The thread that runs a communication library's calls for hpcdl's own process groups.

Each group hands its collectives to a :class:`CommThread`, which runs them in issue order, so that the caller
(DDP's backward) goes on computing while earlier buckets are reduced. A watchdog fails the Work of a collective
that outlives its group's timeout (no library here can cancel a call) and asks the job's heartbeats
(:class:`Liveness`) which rank is gone. A library that cannot abort a call leaves the thread stuck in it; at exit
such a process leaves at once (``exit_if_stuck``) instead of crashing in the library's destructors.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist
from torch.futures import Future

from hpcdl.utils import leave_now

__all__ = ["CommThread", "Group", "Liveness", "describe"]

log = logging.getLogger(__name__)


class Group(Protocol):
    """What the thread asks of a group whose collectives it runs (a ThreadedProcessGroup): its timeout, and
    the words for a failure."""

    LIBRARY: str
    timeout: timedelta

    def rank(self) -> int: ...

    def failed(self, what, exc: Exception) -> Exception: ...

    def timed_out(self) -> str: ...


class Liveness:
    """Whether the job's ranks are alive (from init_distributed's heartbeats): a wait for a collective that has
    run longer than ``after_s`` asks :meth:`poll`, which never blocks.

    ``probe``: a message naming the ranks whose heartbeat stopped, or None; it takes a window or two of the
    heartbeats (about 6 to 12 s with a 2 s heartbeat, longer while rank 0's store is slow). It runs on a thread of
    its own, one at a time for the process whoever waits (the watchdog, a oneCCL ticket's wait): a waiter that ran
    it inline checked no timeout meanwhile, and probes started every ``after_s`` overlapped, doubling the requests
    to rank 0's store and counting one slow store twice."""

    def __init__(self, probe: Callable[[], str | None], after_s: float = 6.0):
        self.probe, self.after_s = probe, after_s
        self._lock = threading.Lock()
        self._running = False
        self._began = float("-inf")  # when the last probe started
        self._found: tuple[str | None, float] = (None, float("-inf"))  # the last finished probe's (finding, start)

    def poll(self, waited_s: float) -> str | None:
        """The finding of a probe started during this wait of ``waited_s`` that named a lost rank, else None; a
        probe starts when none runs, the wait is past ``after_s`` and the last began ``after_s`` ago."""
        now = time.monotonic()
        found, began = self._found
        if found and began >= now - waited_s:
            return found
        with self._lock:
            if waited_s > self.after_s and not self._running and now - self._began > self.after_s:
                self._running, self._began = True, now
                threading.Thread(target=self._run, args=(now,), name="hpcdl-liveness-probe", daemon=True).start()
        return None

    def _run(self, began: float) -> None:
        found = None
        try:
            found = self.probe()
        except Exception as exc:  # a probe that fails finds nothing; the timeout still bounds the wait
            log.warning("a heartbeat probe failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._found = (found, began)
            self._running = False


class CommThread:
    """One thread that runs the queued collectives of one or more groups in issue order, and a watchdog
    that fails the Work of one that outlives its group's timeout (no library here can cancel a call).

    ``exit_if_stuck``: at exit, a process whose thread is still inside a library call leaves with
    ``os._exit(1)`` after flushing its logs (oneCCL crashes in its destructors otherwise).
    """

    def __init__(self, name: str, *, exit_if_stuck: bool = False, liveness: Liveness | None = None):
        self.name, self.exit_if_stuck, self.liveness = name, exit_if_stuck, liveness
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C-implemented: the cheapest hand-off
        # A thread in C beside this one (hpcdl.distributed.native.c_comm_thread) for a library's small calls, queued there
        # only while nothing is queued here (it counts this queue too: count()); this thread lets those finish
        # before it runs its next item.
        self.fast = None
        # While collectives are queued only the thread calls the library; a caller runs one inline only when
        # none is, and holds the lock meanwhile so that nothing is queued (and started) under it.
        self.lock = threading.Lock()
        self.queued = 0  # collectives handed to the thread and not yet finished
        self._started = None  # (start time, group, operation, future) of the collective in progress
        self._closed = threading.Event()
        self.closers: dict[int, object] = {}  # what must run on the thread before it stops (live communicators)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()
        atexit.register(self.shutdown)

    def count(self, delta: int) -> None:
        """Count a collective queued here (+1) or finished (-1); the caller holds ``lock``."""
        self.queued += delta
        if self.fast is not None:
            self.fast.elsewhere(delta)

    def put(self, fn, future: Future, group: Group, what) -> None:
        """Queue ``fn(False)``; the caller holds ``lock`` and has counted it in ``queued``."""
        self._queue.put((fn, future, group, what))

    def run_here(self, fn, group: Group | None = None, what: str = "setup"):
        """Run ``fn()`` on the thread, wait for it and return its result (creating or destroying a
        communicator); timed by ``group``'s timeout when one is given."""
        done: Future = Future()
        self._enqueue(lambda inline: fn(), done, group, what)
        return done.wait()

    def _enqueue(self, fn, future: Future, group, what) -> None:
        """Count and queue ``fn`` (for callers that do not hold ``lock``)."""
        with self.lock:
            self.count(1)
        self._queue.put((fn, future, group, what))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, group, what = item
            self._started = (time.monotonic(), group, what, future)
            try:
                while self.fast is not None and not self.fast.drain(200) and not self._closed.is_set():
                    pass  # the watchdog times this item out if a call there never returns
                result = fn(False)
            except Exception as exc:  # the library's error goes to whoever waits on the Work
                result = exc if group is None else group.failed(what, exc)
            with self.lock:
                self.count(-1)
            self._started = None
            if future.done():  # the watchdog failed it already
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            started = self._started
            if not started or started[1] is None or started[3].done():
                continue
            group, running = started[1], time.monotonic() - started[0]
            limit = group.timeout.total_seconds()
            if limit and running > limit:
                started[3].set_exception(dist.DistBackendError(
                    f"rank {group.rank()}: {group.LIBRARY} {describe(started[2])} {group.timed_out()}"))
            elif self.liveness and (lost := self.liveness.poll(running)):
                # a long collective fails at once when a peer's heartbeat has stopped: no library here notices a
                # dead peer (oneCCL and MPI wait for it), and the timeout may be the start-up's 10 minutes
                started[3].set_exception(dist.DistBackendError(
                    f"rank {group.rank()}: {group.LIBRARY} {describe(started[2])} cannot complete: {lost}"))

    def _close_all(self, timeout_s: float) -> None:
        """Run the registered closers on the thread, waiting at most ``timeout_s`` (a process that exits with a
        live oneCCL communicator hangs in oneCCL's destructors)."""
        done, closers = threading.Event(), list(self.closers.values())
        self.closers.clear()

        def run(inline):
            for close in closers:
                try:
                    close()
                except Exception as exc:  # leaving anyway: say what could not be closed
                    log.warning("%s: closing at exit failed: %s", self.name, exc)
            done.set()

        self._enqueue(run, Future(), None, "closing")
        done.wait(timeout_s)

    def closed(self) -> bool:
        return self._closed.is_set()

    def is_current(self) -> bool:
        return self._thread is threading.current_thread()

    def park(self, why: str) -> None:
        """On the thread, in place of a library call that cannot return (oneCCL aborting inside one): fail the
        collective in progress with ``why`` and block here for good. The thread is then stuck as it is when a
        call never returns, and the process leaves as it does then (:meth:`shutdown`)."""
        started = self._started
        if started and not started[3].done():
            group = started[1]
            rank = f"rank {group.rank()}: " if group is not None else ""
            library = group.LIBRARY if group is not None else self.name
            started[3].set_exception(dist.DistBackendError(f"{rank}{library} {describe(started[2])} {why}"))
        threading.Event().wait()

    def stuck(self) -> bool:
        """Whether the thread, or the C thread beside it, is inside a library call that was given up on."""
        started = self._started
        if self.fast is not None and self.fast.stuck():
            return True
        return bool(started and started[3].done() and self._thread.is_alive())

    def shutdown(self) -> None:
        """Stop the threads: after what is queued has run, and before the interpreter finalizes (a daemon
        thread woken during finalization is unwound through C++ frames, which aborts the process)."""
        if self._closed.is_set():
            return
        if self.closers and not self.stuck():
            self._close_all(timeout_s=30.0)
        self._closed.set()
        if self.fast is not None:
            self.fast.stop()
        self._queue.put(None)
        if self._thread is not threading.current_thread():  # bounded: a thread stuck in a call stays behind
            self._thread.join(timeout=0.5 if self.stuck() else 5.0)
        self._watchdog.join(timeout=1.0)
        fast_stuck = self.fast is not None and self.fast.stuck()
        if self.exit_if_stuck and (self._thread.is_alive() or fast_stuck):
            log.error("%s: a collective never completed; leaving without finalizing the library (it cannot abort "
                      "the call)", self.name)
            leave_now(1)


def describe(what) -> str:
    """The operation, for messages: built only when one is needed, never on the fast path."""
    if isinstance(what, str):
        return what
    name, tensors = what
    return f"{name} of {sum(t.numel() for t in tensors)} elements ({', '.join(sorted({str(t.dtype) for t in tensors}))})"
