"""Rank 0's rendezvous store: served or joined (:func:`serve_or_join`), and each rank's requests to it counted
(:class:`StoreUse`, :class:`CountingStore`) for ``loop.record_startup`` and ``hpcdl bench startup``: what rank 0
serves must stay flat per rank as the job grows."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta

import torch.distributed as dist

from hpcdl.distributed.ranks.env import RankEnv
from hpcdl.errors import LaunchError

__all__ = ["CountingStore", "StoreUse", "key", "rank0_serves", "serve_or_join"]

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



def rank0_serves(environ=os.environ) -> bool:
    """Whether rank 0's process serves the rendezvous store: not under torchrun, whose agent already serves one on
    MASTER_PORT (every rank is its client)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def serve_or_join(env: RankEnv, timeout: timedelta) -> dist.TCPStore:
    """Rank 0 serves the rendezvous store on MASTER_ADDR:MASTER_PORT and every other rank is its client; an error that
    names the port or the address to fix when it cannot."""
    serve = env.rank == 0 and rank0_serves()
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
