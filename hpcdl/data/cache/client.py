"""A reader's side of the node cache: a connection to the node's agent per process (each loader worker opens its
own after the fork), the agent's start by the node's first rank, and what the counters say.

Nothing here trusts the cache: each record is checked against the CRC32 of its shard's index; a damaged one is read
again from the shard by the agent (``GET_SOURCE``) and named. An agent that does not answer is named once per
process, and the process then reads the shards itself, as without the cache.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile

import numpy as np

from hpcdl.data.cache.spec import AgentSpec
from hpcdl.data.cache.wire import ANNOUNCE, ERROR, GET, GET_SOURCE, PEERS, REPLY, REQUEST, STATS, recv_exact
from hpcdl.data.format import record_crc
from hpcdl.errors import DataError

log = logging.getLogger(__name__)

AGENT_START_S = 60.0  # the agent's interpreter and imports, on a loaded node


class CacheClient:
    """One process's connection to its node's agent (reconnected in a forked worker)."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self._sock: socket.socket | None = None
        self._pid: int | None = None

    def __getstate__(self):
        return {"address": self.address, "_sock": None, "_pid": None}

    def _conn(self) -> socket.socket:
        if self._pid != os.getpid() or self._sock is None:
            self._sock = socket.create_connection(self.address, timeout=120)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pid = os.getpid()
        return self._sock

    def _ask(self, op: int, arg: int, body: bytes = b"") -> tuple[int, int, int, int, bytes]:
        [answer] = self._exchange(REQUEST.pack(op, arg) + body, [arg])
        if isinstance(answer, DataError):
            raise answer
        return answer

    def _exchange(self, requests: bytes, args: list[int]) -> list[tuple[int, int, int, int, bytes] | DataError]:
        """Send ``requests`` at once and read one answer per argument in ``args``, in order (the agent answers each
        request before it reads the next); an error the agent answered is a DataError in its place. A connection
        lost raises (OSError), and the next request starts a fresh connection, as does a stream out of step; the
        exception then carries the answers read before it (``answers``)."""
        answers: list = []
        try:
            sock = self._conn()
            sock.sendall(requests)
            for arg in args:
                status, echoed, label, crc, version, length = REPLY.unpack(recv_exact(sock, REPLY.size))
                data = recv_exact(sock, length)
                if echoed != arg:
                    raise _OutOfStep(f"the node's data cache answered request {arg} with {echoed}")
                answers.append(DataError(f"the node's data cache at {self.address[0]}:{self.address[1]}: "
                                         f"{data.decode()}") if status == ERROR else (status, label, crc, version, data))
        except (OSError, _OutOfStep) as exc:
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            if isinstance(exc, _OutOfStep):
                exc = DataError(str(exc))
            exc.answers = answers
            raise exc from None
        return answers

    def get(self, index: int, source: bool = False) -> tuple[bytes, int, int, int]:
        """(bytes, label, crc32, format version) of sample ``index``; ``source``: read from the shard itself."""
        _, label, crc, version, data = self._ask(GET_SOURCE if source else GET, index)
        return data, label, crc, version

    def get_many(self, indices: list[int]) -> list[tuple[bytes, int, int, int] | DataError]:
        """:meth:`get` of each of ``indices`` (a loader's batch), the requests sent at once: one round trip to the
        agent for the batch, not one per sample. A sample the agent failed is a DataError in its place. An exchange
        that fails raises with the batch's first answers, those that arrived, as its ``answers``."""
        def got(answers: list) -> list:
            return [a if isinstance(a, DataError) else (a[4], a[1], a[2], a[3]) for a in answers]

        try:
            return got(self._exchange(b"".join(REQUEST.pack(GET, i) for i in indices), indices))
        except (OSError, DataError) as exc:
            exc.answers = got(getattr(exc, "answers", []))
            raise

    def announce(self, local_rank: int, epoch: int, order: list[int]) -> None:
        self._ask(ANNOUNCE, local_rank, struct.pack("!qq", epoch, len(order)) + np.asarray(order, dtype=">i8").tobytes())

    def peers(self, addresses: dict[int, tuple[str, int]]) -> None:
        body = json.dumps({str(k): list(v) for k, v in addresses.items()}).encode()
        self._ask(PEERS, len(body), body)

    def stats(self, every_node: bool = False) -> list[dict]:
        """This node's agent's counters, or every node's (those that answer)."""
        return json.loads(self._ask(STATS, int(every_node))[4])


class _OutOfStep(Exception):
    pass


def checked_read(client: CacheClient, index: int, where: str, got: tuple | DataError | None = None) -> tuple[bytes, int]:
    # a copy damaged at its owner stays so there (only the asking node's kept copy is replaced): each node that reads
    # it reads it from the shard instead, and says so, each epoch
    """Sample ``index`` through the cache (``got``: the agent's answer, from :meth:`CacheClient.get_many`), its CRC32
    checked; a damaged copy is named and read from the shard."""
    if isinstance(got, DataError):
        raise got
    data, label, crc, version = got if got is not None else client.get(index)
    if record_crc(data, label, version) == crc:
        return data, label
    log.warning("data cache: sample %d of %s came damaged from the node's cache (CRC32 mismatch); reading it "
                "from its shard", index, where)
    data, label, crc, version = client.get(index, source=True)
    if record_crc(data, label, version) != crc:
        raise DataError(f"{where}: sample {index} fails its CRC32 read from its shard too, the shard is damaged; run "
                        f"'hpcdl verify --full {where}', then repack or restore it")
    return data, label


def start_agent(spec: AgentSpec, timeout_s: float = AGENT_START_S) -> tuple[subprocess.Popen, int]:
    """The node's agent, in a process of its own that ends with this one; returns it and its port. The spec (5 MB
    of owners for ImageNet) goes through a file, so that nothing here waits on the agent's imports; every failure to
    start, within ``timeout_s``, is a DataError."""
    try:
        with tempfile.NamedTemporaryFile(prefix="hpcdl-cache-spec-", suffix=".pickle", delete=False) as f:
            pickle.dump(spec, f)
        proc = subprocess.Popen([sys.executable, "-m", "hpcdl.data.cache.server", str(os.getpid()), f.name],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    except OSError as exc:
        raise DataError(f"the node's data cache agent did not start ({exc}). Set data.cache=none to read the shards "
                        "directly") from None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        proc.kill()
        why = f"exit code {proc.wait()}; its error is above" if ready else f"no port within {timeout_s:.0f} s"
        raise DataError(f"the node's data cache agent did not start ({why}). Set data.cache=none to read the shards "
                        "directly")
    return proc, int(line)


def describe(nodes: list[dict], before: dict[int, dict] | None = None) -> str:
    """The job's counters (every node's :meth:`CacheClient.stats`) since ``before`` (the last call's, by node), as a
    log line: the sums, and the most any one node read from the shared filesystem."""
    before = before or {}
    delta = [{k: v - before.get(n["node"], {}).get(k, 0) for k, v in n.items() if isinstance(v, int)} for n in nodes]
    total = {k: sum(d[k] for d in delta) for k in delta[0]} if delta else {}
    if not total:
        return "no node's agent answered"
    mb, lost = 1 << 20, sorted({p for n in nodes for p in n["peers_lost"]})
    kept = sum(n["kept_bytes"] for n in nodes)
    return (f"{len(nodes)} node(s): shared filesystem {total['source_reads']} samples, "
            f"{total['source_bytes'] / mb:.1f} MiB ({total['source_again']} read again), {total['source_opens']} opens (at most "
            f"{max(d['source_opens'] for d in delta)} on a node); from peers {total['peer_reads']} samples, "
            f"{total['peer_bytes'] / mb:.1f} MiB; local reads {total['kept_hits']} kept, {total['ahead_hits']} "
            f"prefetched, {total['waited']} waited for; kept {sum(n['kept_samples'] for n in nodes)} samples, "
            f"{kept / mb:.1f} MiB" + (f"; nodes lost: {lost}" if lost else ""))
