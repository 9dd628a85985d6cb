"""The node's cache agent: one process per node, the only one of the node that opens the shards.

It answers over TCP, one connection per client (each rank and each of its loader workers, and the agents of other
nodes), a request at a time:

- ``GET index``: a local reader's sample, from the samples kept here, from those prefetched, or fetched now: from
  the shared filesystem when this node owns it (:mod:`hpcdl.data.cache.owners`), from its owner's agent otherwise
  (the shared filesystem when that agent does not answer; named once). ``GET_SOURCE`` reads the shard itself: a
  reader that found a record damaged asks again for the source's bytes.
- ``PEER_GET index``: another node's request. Answered from what is kept here, or read from the shared filesystem
  (and kept, when owned here); never forwarded, so no request travels in a loop.
- ``ANNOUNCE local_rank`` with the rank's samples still to come this epoch, in its order: the prefetch walks the
  node's ranks' lists step by step (``window`` samples ahead of the readers), so that each is here before asked.
- ``PEERS`` (the other agents' addresses, from the node's rank 0 once they are known) and ``STATS`` (this node's
  counters, or every node's: the job's rank 0 logs them each epoch).

Kept: the samples this node owns, in RAM, up to ``budget`` bytes; the first epoch reads each sample once for the
whole job, and later epochs read from the shared filesystem only what the budgets could not hold. A shard is
opened at most once per node. A record is sent with the CRC32 its shard's index gives; the reader checks it.

A connection per client, a thread per connection: at thousands of nodes the peer connections of every agent grow
with the node count (noted in docs/data.md).
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import pickle
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hpcdl.data.format import OpenShard, open_shard

GET, GET_SOURCE, PEER_GET, ANNOUNCE, STATS, PEERS = range(1, 7)
REQUEST = struct.Struct("!Bq")  # op, argument: a sample's index, a local rank, or the length of what follows
REPLY = struct.Struct("!bqIBi")  # status, label, crc32, the shard's format version, length of what follows
OK, ERROR = 0, 1
PEER_TIMEOUT_S = 30.0  # a peer that does not answer a request within this is taken as gone


@dataclass
class AgentSpec:
    root: str
    paths: list[str]  # the shards, in the manifest's order
    counts: list[int]  # their images
    owners: np.ndarray  # the owning node of each sample (int32)
    node: int  # this node's number
    budget: int  # bytes of owned samples kept in RAM
    window: int  # samples prefetched ahead of the readers
    fetchers: int = 4  # threads fetching ahead


@dataclass(slots=True)
class Record:
    data: bytes
    label: int
    crc: int
    version: int


@dataclass
class Counters:
    source_reads: int = 0  # samples read from the shared filesystem
    source_bytes: int = 0
    source_opens: int = 0  # shards opened
    source_again: int = 0  # samples read from the shared filesystem a second time or more (beyond the budget)
    peer_reads: int = 0  # samples fetched from other nodes' agents
    peer_bytes: int = 0
    served_to_peers: int = 0  # samples sent to other nodes' agents
    kept_hits: int = 0  # local reads answered from the samples kept here
    ahead_hits: int = 0  # local reads answered from the prefetch
    waited: int = 0  # local reads fetched while the reader waited
    kept_samples: int = 0
    kept_bytes: int = 0
    peers_lost: list = field(default_factory=list)


class Agent:
    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.starts = np.concatenate([[0], np.cumsum(spec.counts)]).astype(np.int64)
        self.shards: dict[int, OpenShard] = {}
        self.kept: dict[int, Record] = {}
        self.ahead: dict[int, Record] = {}
        self.inflight: dict[int, threading.Event] = {}
        self.taken: set[int] = set()  # read by a local reader since the last announce
        self.read_once = np.zeros(int(self.starts[-1]), dtype=bool)  # read from the shared filesystem
        self.orders: dict[int, list[int]] = {}
        self.generation = 0
        self.cond = threading.Condition()
        self.shard_lock = threading.Lock()
        self.peers: dict[int, tuple[str, int]] = {}
        self.lost: set[int] = set()
        self.local = threading.local()  # each thread's connections to the peers
        self.counters = Counters()
        self.pool = ThreadPoolExecutor(spec.fetchers, thread_name_prefix="fetch")
        threading.Thread(target=self._prefetch, name="prefetch", daemon=True).start()

    # -- a local reader's sample
    def get(self, index: int, op: int) -> Record:
        if not 0 <= index < self.starts[-1]:
            raise IndexError(f"sample {index} is outside the {int(self.starts[-1])} of {self.spec.root}")
        if op == GET_SOURCE:
            record = self._source(index)
            with self.cond:
                if index in self.kept:  # the kept copy was the damaged one: replace it
                    self.kept[index] = record
            return record
        if op == PEER_GET:
            return self._for_peer(index)
        with self.cond:
            while True:
                if index in self.kept:
                    self.counters.kept_hits += 1
                    self.taken.add(index)
                    return self.kept[index]
                if index in self.ahead:
                    self.counters.ahead_hits += 1
                    self.taken.add(index)
                    self.cond.notify_all()  # the window has room again
                    return self.ahead.pop(index)
                if index not in self.inflight:
                    break
                self.cond.wait(0.5)
            self.counters.waited += 1
            self.inflight[index] = threading.Event()
        return self._load(index, keep_ahead=False)

    def _for_peer(self, index: int) -> Record:
        """Another node's request: what is kept or prefetched here, else read from the shard (and kept when owned);
        a sample being fetched here already is waited for, not read twice."""
        with self.cond:
            self.counters.served_to_peers += 1
            while True:
                record = self.kept.get(index) or self.ahead.get(index)
                if record is not None:
                    return record
                if index not in self.inflight:
                    break
                self.cond.wait(0.5)
            self.inflight[index] = threading.Event()
        try:
            record = self._source(index)
            if int(self.spec.owners[index]) == self.spec.node:
                self._keep(index, record)
            return record
        finally:
            with self.cond:
                self.inflight.pop(index).set()
                self.cond.notify_all()

    def _load(self, index: int, keep_ahead: bool) -> Record:
        """Fetch ``index``, which the caller reserved in ``inflight``, from where it lives; kept when owned here; held
        for the reader when prefetched (``keep_ahead``), else taken by the reader that asked."""
        try:
            owner = int(self.spec.owners[index])
            record = None
            if owner != self.spec.node and owner in self.peers and owner not in self.lost:
                record = self._from_peer(owner, index)
            if record is None:
                record = self._source(index)
            if owner == self.spec.node:
                self._keep(index, record)
            with self.cond:
                if keep_ahead and index not in self.kept and index not in self.taken:
                    self.ahead[index] = record
            return record
        finally:
            with self.cond:
                self.inflight.pop(index).set()
                if not keep_ahead:
                    self.taken.add(index)
                self.cond.notify_all()

    def _keep(self, index: int, record: Record) -> None:
        with self.cond:
            c = self.counters
            if index not in self.kept and c.kept_bytes + len(record.data) <= self.spec.budget:
                self.kept[index] = record
                c.kept_samples, c.kept_bytes = c.kept_samples + 1, c.kept_bytes + len(record.data)

    def _source(self, index: int) -> Record:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        with self.shard_lock:
            s = self.shards.get(shard)
            if s is None:
                s = self.shards[shard] = open_shard(self.spec.paths[shard], self.spec.counts[shard], self.spec.root)
                self.counters.source_opens += 1
        i = int(index - self.starts[shard])
        start, stop = int(s.offsets[i]), int(s.offsets[i + 1])
        data = os.pread(s.fd, stop - start, s.base + start)
        with self.cond:
            self.counters.source_reads += 1
            self.counters.source_bytes += len(data)
            self.counters.source_again += int(self.read_once[index])
            self.read_once[index] = True
        return Record(data, int(s.labels[i]), int(s.crcs[i]), s.version)

    def _from_peer(self, owner: int, index: int) -> Record | None:
        conns = self.local.__dict__.setdefault("conns", {})
        try:
            sock = conns.get(owner)
            if sock is None:
                sock = conns[owner] = socket.create_connection(self.peers[owner], timeout=PEER_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(REQUEST.pack(PEER_GET, index))
            status, label, crc, version, length = REPLY.unpack(recv_exact(sock, REPLY.size))
            data = recv_exact(sock, length)
            if status != OK:
                raise OSError(data.decode(errors="replace"))
        except OSError as exc:
            conns.pop(owner, None)
            with self.cond:
                if owner not in self.lost:
                    self.lost.add(owner)
                    self.counters.peers_lost.append(owner)
                    print(f"hpcdl data cache, node {self.spec.node}: node {owner}'s cache at "
                          f"{self.peers[owner][0]}:{self.peers[owner][1]} does not answer ({exc}); its samples are "
                          "read from the shared filesystem from now on", file=sys.stderr, flush=True)
            return None
        with self.cond:
            self.counters.peer_reads += 1
            self.counters.peer_bytes += len(data)
        return Record(data, label, crc, version)

    # -- the prefetch
    def announce(self, local_rank: int, order: list[int]) -> None:
        with self.cond:
            self.orders[local_rank] = order
            self.generation += 1
            self.ahead.clear()
            self.taken.clear()
            self.cond.notify_all()

    def _prefetch(self) -> None:
        while True:
            with self.cond:
                while not self.orders:
                    self.cond.wait()
                generation, orders = self.generation, [self.orders[r] for r in sorted(self.orders)]
            for j in range(max(map(len, orders))):
                for order in orders:
                    if j >= len(order):
                        continue
                    index = order[j]
                    with self.cond:
                        while (len(self.ahead) + len(self.inflight) >= self.spec.window
                               and self.generation == generation):
                            self.cond.wait(0.5)
                        if self.generation != generation:
                            break
                        if index in self.kept or index in self.ahead or index in self.inflight or index in self.taken:
                            continue
                        self.inflight[index] = threading.Event()  # reserved: a reader asking now waits for it
                    self.pool.submit(self._prefetch_one, index)
                else:
                    continue
                break
            with self.cond:
                while self.generation == generation:
                    self.cond.wait()

    def _prefetch_one(self, index: int) -> None:
        try:
            self._load(index, keep_ahead=True)
        except Exception as exc:  # the reader that asks for it gets the error
            print(f"hpcdl data cache, node {self.spec.node}: prefetching sample {index}: {exc}", file=sys.stderr,
                  flush=True)

    def stats(self) -> dict:
        with self.cond:
            return {**self.counters.__dict__, "peers_lost": list(self.counters.peers_lost),
                    "node": self.spec.node, "budget": self.spec.budget}

    def stats_of_all(self) -> list[dict]:
        """This node's counters and every peer's (one request each, a connection of its own: once an epoch, from
        the job's rank 0); a peer that does not answer is left out."""
        found = [self.stats()]
        for node, address in sorted(self.peers.items()):
            try:
                with socket.create_connection(address, timeout=10) as sock:
                    sock.sendall(REQUEST.pack(STATS, 0))
                    status, _, _, _, length = REPLY.unpack(recv_exact(sock, REPLY.size))
                    body = recv_exact(sock, length)
                if status == OK:
                    found.extend(json.loads(body))
            except OSError:
                continue
        return found


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the connection closed {got} bytes into a message of {n}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        agent: Agent = self.server.agent
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                head = sock.recv(REQUEST.size, socket.MSG_WAITALL)
            except OSError:
                return
            if len(head) < REQUEST.size:
                return
            op, arg = REQUEST.unpack(head)
            try:
                if op in (GET, GET_SOURCE, PEER_GET):
                    r = agent.get(arg, op)
                    sock.sendall(REPLY.pack(OK, r.label, r.crc, r.version, len(r.data)) + r.data)
                    continue
                if op == ANNOUNCE:
                    (count,) = struct.unpack("!q", recv_exact(sock, 8))
                    agent.announce(arg, np.frombuffer(recv_exact(sock, 8 * count), dtype=">i8").tolist())
                    body = b""
                elif op == PEERS:
                    agent.peers = {int(k): (h, p) for k, (h, p) in json.loads(recv_exact(sock, arg)).items()}
                    body = b""
                elif op == STATS:  # argument 1: every node's
                    body = json.dumps(agent.stats_of_all() if arg else [agent.stats()]).encode()
                else:
                    raise ValueError(f"unknown request {op}")
                sock.sendall(REPLY.pack(OK, 0, 0, 0, len(body)) + body)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}".encode()
                try:
                    sock.sendall(REPLY.pack(ERROR, 0, 0, 0, len(message)) + message)
                except OSError:
                    return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def _die_with_parent() -> None:
    try:  # PR_SET_PDEATHSIG: the agent ends with the rank that started it, however that rank ends
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main() -> None:
    """``python -m hpcdl.data.cache.agent``: the spec pickled on stdin; prints the port it listens on."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # scancel's: the ranks checkpoint and need their data until then
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(10)  # as the loader's workers: compute wins each core the two contend for
    spec: AgentSpec = pickle.load(sys.stdin.buffer)
    server = _Server(("0.0.0.0", 0), _Handler)
    server.agent = Agent(spec)
    print(server.server_address[1], flush=True)
    server.serve_forever(poll_interval=1.0)


if __name__ == "__main__":
    main()
