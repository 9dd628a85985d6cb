"""The rendezvous store's use beside the process groups: each rank's requests counted, and the heartbeat.

Every rank bumps a counter in rank 0's store every ``heartbeat_s`` seconds from a daemon thread; a probe reads
the counters twice and names the ranks whose counters stood still, and a store that does not answer within a
deadline is rank 0 lost (:mod:`hpcdl.distributed.group.lifecycle` explains failures with it, the just-in-time
checkpoint's watch thread looks with it).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from hpcdl.distributed.ranks.env import RankEnv

__all__ = ["CountingStore", "Heartbeat", "StoreUse", "key"]

log = logging.getLogger(__name__)

_PREFIX = "hpcdl/"


def key(kind: str, rank: int) -> str:
    return f"{_PREFIX}{kind}/{rank}"


@dataclasses.dataclass(slots=True)
class StoreUse:
    """This rank's use of rank 0's rendezvous store: the connections it opened and its requests by kind
    (summed over the ranks: what rank 0 serves). The process groups' rendezvous is counted only through a
    :class:`CountingStore` (``init_distributed(count_store=True)``); the heartbeat always is."""

    connections: int = 0
    rendezvous: dict[str, int] = dataclasses.field(default_factory=dict)  # store operation -> requests
    heartbeat: int = 0
    heartbeat_first: float = 0.0  # time.monotonic() of the first and the last heartbeat sent
    heartbeat_last: float = 0.0

    def beat(self) -> None:
        self.heartbeat_last = time.monotonic()
        if not self.heartbeat:
            self.heartbeat_first = self.heartbeat_last
        self.heartbeat += 1

    def as_dict(self) -> dict:
        span = self.heartbeat_last - self.heartbeat_first
        return {"connections": self.connections, "rendezvous_requests": sum(self.rendezvous.values()),
                "rendezvous_by_operation": dict(self.rendezvous), "heartbeat_requests": self.heartbeat,
                # the interval the thread kept; None until it has sent two
                "heartbeat_requests_per_s": (self.heartbeat - 1) / span if span > 0 else None}


class CountingStore(dist.Store):
    """A store that counts each request it passes to ``inner`` in ``use.rendezvous`` (torch calls a Python store's
    methods from C++: gloo's and the groups' rendezvous go through it)."""

    def __init__(self, inner: dist.Store, use: StoreUse):
        super().__init__()
        self.inner, self.use = inner, use

    def _count(self, op: str) -> None:
        self.use.rendezvous[op] = self.use.rendezvous.get(op, 0) + 1

    def set(self, key, value):
        self._count("set")
        return self.inner.set(key, value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key)

    def add(self, key, value):
        self._count("add")
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def deletekey(self, key):
        self._count("delete_key")
        return self.inner.deletekey(key)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def num_keys(self):
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


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
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(key("hb", self.env.rank), 1)
                self.use.beat()
            except Exception:  # the store (rank 0) is gone, or a request failed once: beat on, diagnosis says which
                continue

    def watch(self) -> list[int] | None:
        """What a waiting rank asks: rank 0's and the next rank's counters (a stopped rank is seen by the rank
        before it, rank 0 by every rank); when one stood still, every counter is read to name the lost ranks
        (:meth:`lost_ranks`). None when the store does not answer."""
        ring = sorted({0, (self.env.rank + 1) % self.env.world_size} - {self.env.rank})
        found = self._measure(ring)
        if found is None:
            self.last_probe = self._last_lost = (time.monotonic(), None)
            return None
        return found and self.lost_ranks()

    def lost_ranks(self, fresh_s: float = 0.0) -> list[int] | None:
        """Ranks whose heartbeat stopped; ``None`` when the store (served by rank 0) is unreachable. With
        ``fresh_s``, a finding of the last ``fresh_s`` seconds that named a lost rank is reused."""
        last = self._last_lost
        if fresh_s and last and time.monotonic() - last[0] < fresh_s:
            return last[1]
        found = self._measure(range(self.env.world_size))
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
        """Those of ``ranks`` whose counter stood still over 2.5 intervals; None when the store does not answer."""
        if self._store_refuses():
            return None
        ranks = list(ranks)
        keys = [key("hb", r) for r in ranks]
        # over the heartbeat's own connection (TCPStore's client serializes its requests): a probe opens none, so
        # rank 0 serves two connections per rank whatever the probes (a new client per probe made 3 per rank in
        # a slow start-up: bench startup's count; thousands of connections at 2,048 ranks)
        store = self._store
        try:
            before = self._bounded(lambda: store.multi_get(keys))
            time.sleep(2.5 * self.interval_s)
            after = self._bounded(lambda: store.multi_get(keys))
        except Exception:
            return None
        return [r for r, a, b in zip(ranks, before, after) if a == b and r != self.env.rank]

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
