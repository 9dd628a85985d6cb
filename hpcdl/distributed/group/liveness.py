"""Liveness: the heartbeat, and the naming of a lost rank when a collective fails.

Every rank bumps a counter in rank 0's store every ``heartbeat_s`` seconds from a daemon thread; a probe reads
the counters twice and names the ranks whose counters stood still while its own rank's went on (the store's
clock, not the wall's: :meth:`Heartbeat._measure`), and a store that does not answer within a deadline is rank 0
lost. :func:`fail_fast` turns a failed collective into a :class:`RankLostError` that names the
lost rank from them (:func:`explain_failure`); hpcdl's own groups' watchdogs ask them through
:func:`group_liveness`, the just-in-time checkpoint's watch thread through :meth:`Heartbeat.watch`.

Every request a probe sends is bounded (:attr:`Heartbeat.deadline_s`): a TCPStore client's timeout bounds
its connection and its waits for a key, not a request to a server that accepted the connection and does
not answer (:meth:`Heartbeat._bounded`). A stopped rank 0 (SIGSTOP, a node frozen) is such a server: before the bound, a probe that
asked it waited for ever, and with it the rescue's watch and the oneCCL watchdog (issue 44). A request
unanswered by its deadline reads as a store that no longer answers, rank 0 lost.

Rank 0's own counter is weak evidence where rank 0 serves the store (:func:`rank0_serves`): a store that answers
is served from rank 0's process, which therefore lives. Its counter standing still means that rank 0's Python
threads did not run (20 s in a 16-rank oneCCL rehearsal on 2 cores here, where the survivors then took rank 0 for
lost and the job failed), so it is named only once it has stood still for :attr:`Heartbeat.rank0_grace_s` (a
minute: rank 0 hung, its node the one to suspect). A store that refuses or misses its deadline is rank 0 lost at
once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist

from hpcdl.distributed.group.comm_thread import Liveness
from hpcdl.distributed.group.store import StoreUse, key, rank0_serves
from hpcdl.distributed.ranks.env import RankEnv
from hpcdl.errors import RankLostError

__all__ = ["Heartbeat", "explain_failure", "fail_fast", "group_liveness", "is_collective_error"]

log = logging.getLogger(__name__)

class Heartbeat:
    """A counter per rank in the store, bumped by a daemon thread over its own store connection: each rank
    holds two connections to rank 0 for the job's life (the rendezvous', this one) and sends one request per
    interval, whatever the number of ranks.

    :meth:`watch` is what a rank that waits asks every few seconds: the counters of rank 0 and of the next
    rank only (a ring), so that what rank 0's store serves stays one request per rank per interval at any
    rank count; only a watch that finds something reads every counter, once, to name the lost ranks."""

    def __init__(self, env: RankEnv, interval_s: float, use: StoreUse | None = None):
        self.env, self.interval_s = env, interval_s
        self.use = use or StoreUse()
        # a store request unanswered this long: rank 0 (its server) is stopped or its node frozen
        self.deadline_s = max(5.0, 2.5 * interval_s)
        self._last_lost = None  # (when, lost ranks or None) of the last probe that found a problem
        self.last_probe = None  # (when, finding) of the last probe of every counter
        self.refused = False  # the last probe found nothing listening on the store's port: rank 0 gone for certain
        self.rank0_grace_s = 60.0  # rank 0's counter still this long while its store answers: rank 0 named
        self._rank0_still_since: float | None = None
        self._store = self._client(timedelta(seconds=max(10.0, 5 * interval_s)))
        self._store.add(key("hb", env.rank), 1)
        self.use.beat()
        node = f" (Slurm node {os.environ['SLURMD_NODENAME']})" if os.environ.get("SLURMD_NODENAME") else ""
        self._store.set(key("who", env.rank), f"host {env.hostname}{node}, pid {os.getpid()}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpcdl-heartbeat", daemon=True)
        self._thread.start()
        # A daemon thread still inside a store call when the interpreter finalizes is unwound through
        # torch's C++ frames, which aborts the process ("terminate called without an active exception"):
        # stop it before that, also when the program never calls shutdown().
        atexit.register(self.stop)

    def _beat(self) -> None:
        # an interval between the end of one beat and the start of the next: a probe that sees three of them
        # (:meth:`_measure`) has seen two intervals of this rank's time
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(key("hb", self.env.rank), 1)
                self.use.beat()
            except Exception:  # the store (rank 0) is gone, or a request failed once: beat on, diagnosis says which
                continue

    def watch(self) -> list[int] | None:
        """What a waiting rank asks: rank 0's and the next rank's counters (a stopped rank is seen by the rank
        before it, rank 0 by every rank); when one stood still, every counter is read, and a rank is lost when it
        stood still in two windows: a rank whose heartbeat thread was starved through one (16 ranks to a core at
        start-up: up to 5 s here) is no loss. The ring's rank still in both names the loss; the others still in
        the second window (a node's other ranks, another node lost at once) are read through one window more, so
        that all of them are named (the supervisor leaves their nodes out). None when the store does not answer."""
        ring = sorted({0, (self.env.rank + 1) % self.env.world_size} - {self.env.rank})
        found = self._measure(ring)
        if found == []:
            return []  # not noted: last_probe is a probe of every counter (recent)
        if found:
            named = self._measure(range(self.env.world_size))
            if named:
                lost = [r for r in named if r in found]
                others = [r for r in named if r not in found]
                found = sorted(lost + ((self._measure(others) or []) if lost and others else []))
            else:
                found = named
        return self._note(found)

    def lost_ranks(self, fresh_s: float = 0.0) -> list[int] | None:
        """Ranks whose heartbeat stopped through one window (what a collective that failed asks: the failure
        is the other evidence); ``None`` when the store (served by rank 0) is unreachable. With ``fresh_s``, a
        finding of the last ``fresh_s`` seconds that named a lost rank is reused (not one of a store that did not
        answer, which the watchdogs forgive once)."""
        last = self._last_lost
        if fresh_s and last and last[1] and time.monotonic() - last[0] < fresh_s:
            return last[1]
        return self._note(self._measure(range(self.env.world_size)))

    def _note(self, found: list[int] | None) -> list[int] | None:
        """``found``, kept as the last probe of every counter (and as the last that found a problem)."""
        self.last_probe = (time.monotonic(), found)
        if found is None or found:
            self._last_lost = (time.monotonic(), found)
        return found

    def recent(self, fresh_s: float) -> list[int] | None:
        """The finding of a probe of the last ``fresh_s`` seconds, whatever it found; a new probe otherwise."""
        last = self.last_probe
        if last and time.monotonic() - last[0] < fresh_s:
            return last[1]
        return self.lost_ranks()

    def _measure(self, ranks) -> list[int] | None:
        """Those of ``ranks`` whose counter stood still over a window in which this rank's own went on by three
        beats (at least 2.5 intervals); None when the store does not answer.

        The store's clock, not the wall's. A store that stalls (rank 0's server shares its core with rank 0: a
        32-rank rendezvous on 2 cores here held every counter still for 6 s at once) stops this rank's counter
        too, and so does this rank's own heartbeat thread starved: the window grows until this rank's three beats
        have reached the store, which then served it through two of its intervals, in which a peer whose thread
        runs sent a beat too (a beat has one request in flight: a stall delays it once). After ten intervals
        without them nothing can be told apart and no rank is named: the caller probes again later."""
        self.refused = self._store_refuses()
        if self.refused:
            return None
        me = self.env.rank
        ranks = [r for r in ranks if r != me]
        keys = [key("hb", r) for r in [me, *ranks]]
        # over the heartbeat's own connection (TCPStore's client serializes its requests): a probe opens none, so
        # rank 0 serves two connections per rank whatever the probes (a new client per probe made 3 per rank in
        # a slow start-up: bench startup's count; thousands of connections at 2,048 ranks)
        store = self._store
        try:
            before = [int(v) for v in self._bounded(lambda: store.multi_get(keys))]
            start = time.monotonic()
            time.sleep(2.5 * self.interval_s)
            while True:
                after = [int(v) for v in self._bounded(lambda: store.multi_get(keys))]
                if after[0] - before[0] >= 3:
                    still = [r for r, a, b in zip(ranks, before[1:], after[1:]) if a == b]
                    return self._rank0_after_grace(ranks, still, time.monotonic() - start)
                if time.monotonic() - start > 10 * self.interval_s:
                    break
                time.sleep(0.5 * self.interval_s)
        except Exception:
            return None
        log.warning("rank %d: its own heartbeat did not reach rank 0's store in %.0f s: the rank's threads starved, or "
                    "the store stalled; no rank named from this probe", me, 10 * self.interval_s)
        return []

    def _rank0_after_grace(self, ranks: list[int], still: list[int], window_s: float) -> list[int]:
        """``still``, less rank 0 where its process served this window's requests and its counter has not stood
        still for :attr:`rank0_grace_s` (see the module's doc)."""
        if 0 not in ranks or not rank0_serves():
            return still
        now = time.monotonic()
        if 0 not in still:
            self._rank0_still_since = None
            return still
        since = self._rank0_still_since = self._rank0_still_since or now - window_s
        if now - since >= self.rank0_grace_s:
            return still
        log.warning("rank %d: rank 0's heartbeat has stood still for %.0f s while the store it serves answered: its "
                    "process lives (its threads starved or stuck); not taken as lost before %.0f s", self.env.rank,
                    now - since, self.rank0_grace_s)
        return [r for r in still if r != 0]

    def _bounded(self, request: Callable[[], object]) -> object:
        """``request()`` (a store call), or TimeoutError when it has not returned within :attr:`deadline_s`: it
        runs on a daemon thread, left behind when the server never answers (the process is about to leave)."""
        done, box = threading.Event(), {}

        def call() -> None:
            try:
                box["value"] = request()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            done.set()

        threading.Thread(target=call, name="hpcdl-store-request", daemon=True).start()
        if not done.wait(self.deadline_s):
            raise TimeoutError(f"rank 0's store at {self.env.master_addr}:{self.env.master_port} did not answer "
                               f"within {self.deadline_s:.0f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _store_refuses(self) -> bool:
        """True when rank 0's host answers but nothing listens on the store's port: rank 0 is gone, known at
        once (TCPStore's client would retry until its timeout). A host that does not answer at all is left
        to the client."""
        try:
            with socket.create_connection((self.env.master_addr, self.env.master_port),
                                          timeout=max(1.0, 2 * self.interval_s)):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def who(self, rank: int) -> str:
        try:
            return self._bounded(lambda: self._store.get(key("who", rank))).decode()
        except Exception:
            return "host unknown"

    def _client(self, timeout: timedelta) -> dist.TCPStore:
        self.use.connections += 1
        return dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=False, timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store.timeout.total_seconds())


def group_liveness(heartbeat: Heartbeat, heartbeat_s: float) -> Liveness:
    """What lets hpcdl's own groups (MPI, oneCCL) fail a collective whose peer died as soon as its heartbeat has
    stopped, instead of at the timeout (gloo notices a closed connection itself)."""

    unanswered = 0

    def probe() -> str | None:
        nonlocal unanswered
        lost = heartbeat.watch()
        unanswered = unanswered + 1 if lost is None else 0
        if lost is None:  # a store busy past the deadline once (a rendezvous loads it most) is asked at the next
            # probe; a port that refuses the connection is rank 0 gone
            return "rank 0's rendezvous store no longer answers" if unanswered >= 2 or heartbeat.refused else None
        return ("heartbeat stopped on " + ", ".join(f"rank {r}" for r in lost)) if lost else None

    return Liveness(probe, max(6.0, 3 * heartbeat_s))


@contextlib.contextmanager
def fail_fast(heartbeat: Heartbeat, hook_failure: Callable[[], BaseException | None] = lambda: None,
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
        message = explain_failure(heartbeat, failure or exc, collective=failure is not None or is_collective_error(exc))
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


def explain_failure(heartbeat: Heartbeat, exc: BaseException, collective: bool = True) -> str | None:
    """What went wrong, from the heartbeats; None when ``exc`` need not be a collective's and no rank is lost."""
    text = str(exc).strip().removeprefix("Got the following error when running the callback: ")
    first = text.splitlines()[0] if text else type(exc).__name__
    env = heartbeat.env
    lost = heartbeat.lost_ranks(fresh_s=30.0)
    if lost is None:
        return (f"rank 0 was lost (it served the rendezvous store at {env.master_addr}:{env.master_port}, "
                f"which no longer answers); rank {env.rank} stops. Collective error: {first}")
    if lost:
        names = "; ".join(f"rank {r} ({heartbeat.who(r)})" for r in lost)
        return f"lost {names}: heartbeat stopped; rank {env.rank} stops. Collective error: {first}"
    if not collective:
        return None
    return (f"a collective failed on rank {env.rank} while every rank's heartbeat is alive (a rank stuck, or the "
            f"network): {first}")
