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
whole job, and later epochs read from the shared filesystem only what the budgets could not hold. A node owns
whole shards, so a shard is opened by its owner alone (once per job), and by another node only to read around a
lost owner. A record is sent with the CRC32 its shard's index gives; the reader checks it.

A thread per connection (a local reader's, or one of a peer's pool): thousands at thousands of nodes (docs/data.md).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpcdl.data.cache.spec import AgentSpec, Counters, Record
from hpcdl.data.cache.wire import GET_SOURCE, OK, PEER_GET, REPLY, REQUEST, recv_exact
from hpcdl.data.format import OpenShard, open_shard, read_record, read_span, record_crc

PEER_TIMEOUT_S = 30.0  # a peer's answer waited for this long, then the sample is read from the shard
PEER_RETRY_S = 60.0  # a peer that refused or dropped a connection is asked again after this
PEERS_WAIT_S = 120.0  # a request for another node's sample waits this long for the peers' addresses
WHOLE_MAX = 64 << 20  # an owned shard up to this size is read whole at its open (a larger one, record by record)
PEER_RUN = 16  # samples of one other node prefetched in one exchange with its agent
UNASKED = object()  # a sample's owner not asked yet (Agent._load)


class Agent:
    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.starts = np.concatenate([[0], np.cumsum(spec.counts)]).astype(np.int64)
        self.shards: dict[int, OpenShard] = {}
        self.kept: dict[int, Record] = {}
        self.ahead: dict[int, Record] = {}
        self.inflight: dict[int, threading.Event] = {}
        self.taken: set[int] = set()  # read by a local reader this epoch (the newest announced)
        self.read_once = np.zeros(int(self.starts[-1]), dtype=bool)  # read from the shared filesystem
        self.orders: dict[int, tuple[int, list[int]]] = {}  # local rank -> (epoch, its samples to come)
        self.wanted: set[int] = set()  # the samples of those orders (a prefetched one not wanted is not held)
        self.epoch = -1  # the newest epoch announced
        self.generation = 0
        self.cond = threading.Condition()
        self.shard_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self.peers: dict[int, tuple[str, int]] = {}
        self.peers_known = threading.Event()
        if spec.nodes <= 1:
            self.peers_known.set()
        self.lost: dict[int, float] = {}  # peer -> when it last refused or dropped a connection
        self.idle: dict[int, list[socket.socket]] = collections.defaultdict(list)  # open connections to each peer
        self.said: set[str] = set()
        self.counters = Counters()
        self.reserved = 0  # bytes of shards being read whole, held in the budget until kept
        self.pool = ThreadPoolExecutor(spec.fetchers, thread_name_prefix="fetch")
        threading.Thread(target=self._prefetch, name="prefetch", daemon=True).start()

    # -- a local reader's sample
    def get(self, index: int, op: int) -> Record:
        if not 0 <= index < self.starts[-1]:
            raise IndexError(f"sample {index} is outside the {int(self.starts[-1])} of {self.spec.root}")
        if op == GET_SOURCE:
            record = self._source(index, fresh=True)
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

    def _load(self, index: int, keep_ahead: bool, fetched: Record | None | object = UNASKED) -> Record:
        """Fetch ``index``, reserved in ``inflight``, from where it lives (``fetched``: what its owner sent in a run,
        None when the run could not bring it: read from the shard, its owner not asked again); kept when owned here;
        held for the reader when prefetched (``keep_ahead``) and still wanted, else taken by the reader that asked."""
        try:
            owner = int(self.spec.owners[index])
            record = None if fetched is UNASKED else fetched
            if fetched is UNASKED and self._peer_usable(owner):
                [record] = self._from_peer(owner, [index])
            if record is None:
                record = self._source(index)
            if owner == self.spec.node:
                self._keep(index, record)
            with self.cond:
                if keep_ahead and index in self.wanted and index not in self.kept and index not in self.taken:
                    self.ahead[index] = record
            return record
        finally:
            with self.cond:
                self.inflight.pop(index).set()
                if not keep_ahead:
                    self.taken.add(index)
                self.cond.notify_all()

    def _peer_usable(self, owner: int) -> bool:
        return owner != self.spec.node and self._peers_arrived() and owner in self.peers \
            and time.monotonic() - self.lost.get(owner, -PEER_RETRY_S) >= PEER_RETRY_S

    def _peers_arrived(self) -> bool:
        """Whether the peers' addresses are here, waiting for them once: after ``PEERS_WAIT_S`` without them, every
        sample is read from the shared filesystem without waiting again."""
        if self.peers_known.is_set():
            return True
        if not self.peers_known.wait(PEERS_WAIT_S):
            self._say_once("no peers", f"no peers' addresses within {PEERS_WAIT_S:.0f} s: every sample is read from "
                           "the shared filesystem")
            self.peers_known.set()
        return bool(self.peers)

    def _keep(self, index: int, record: Record) -> None:
        with self.cond:
            c = self.counters
            if index not in self.kept and c.kept_bytes + len(record.data) <= self.spec.budget:
                self.kept[index] = record
                c.kept_samples, c.kept_bytes = c.kept_samples + 1, c.kept_bytes + len(record.data)

    def _source(self, index: int, fresh: bool = False) -> Record:
        """``index`` from its shard on the shared filesystem (``fresh``: read again, the kept copy was damaged). The
        first read of a shard this node owns reads all of it when the budget holds it (:meth:`_keep_whole`)."""
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        s = self.shards.get(shard)
        if s is None:
            with self.cond:
                lock = self.shard_locks[shard]
            with lock:  # one open per shard; other shards open beside it
                s = self.shards.get(shard)
                if s is None:
                    whole, held = np.all(self.spec.owners[self.starts[shard]:self.starts[shard + 1]] == self.spec.node), []
                    try:
                        s = open_shard(self.spec.paths[shard], self.spec.counts[shard], self.spec.root,
                                       whole_if=(lambda size: self._reserve(size, held)) if whole else None)
                        if s.whole is not None:
                            self._keep_whole(shard, s)
                    finally:
                        with self.cond:
                            self.reserved -= sum(held)
                    with self.cond:
                        self.shards[shard] = s
                        self.counters.source_opens += 1
        with self.cond:
            record = None if fresh else self.kept.get(index)
        if record is not None:
            return record
        i = int(index - self.starts[shard])
        data = read_record(s, i, self.spec.paths[shard])
        with self.cond:
            self.counters.source_reads += 1
            self.counters.source_bytes += len(data)
            self.counters.source_again += int(self.read_once[index])
            self.read_once[index] = True
        return Record(data, int(s.labels[i]), int(s.crcs[i]), s.version)

    def _reserve(self, size: int, held: list) -> bool:
        """Whether a shard of ``size`` bytes is read whole: at most WHOLE_MAX (a request waits for the read), and its
        bytes reserved in the budget until kept (shards opened at once do not all pass against the same room)."""
        with self.cond:
            if size > WHOLE_MAX or self.counters.kept_bytes + self.reserved + size > self.spec.budget:
                return False
            self.reserved += size
            held.append(size)
            return True

    def _keep_whole(self, shard: int, s: OpenShard) -> None:
        """A shard this node owns whole, read whole by its open in one sequential pass, every record kept: the owner
        serves all of them. The client's readahead that an open starts (1.6 MB of an 8.4 MB shard on the local
        MooseFS) is then used, not dropped (record by record, the first epoch read 1.13x the dataset on 2 nodes). Cut
        outside the agent's lock; a record whose CRC32 fails is not kept (read again, named by the reader)."""
        first, n = int(self.starts[shard]), len(s.labels)
        records = [Record(read_span(s, int(s.offsets[i]), int(s.offsets[i + 1]), ""), int(s.labels[i]),
                          int(s.crcs[i]), s.version) for i in range(n)]
        good = [record_crc(r.data, r.label, r.version) == r.crc for r in records]
        with self.cond:  # a reentrant lock: _keep takes it again
            c = self.counters
            c.source_reads, c.source_bytes = c.source_reads + n, c.source_bytes + len(s.whole)
            for i in range(n):
                c.source_again += int(self.read_once[first + i])
                self.read_once[first + i] = True
                if good[i]:
                    self._keep(first + i, records[i])
        s.whole = None  # the kept records are copies

    def _from_peer(self, owner: int, indices: list[int]) -> list[Record | None]:
        """``indices`` from their owner's agent, the requests sent at once (a prefetched run of its samples costs one
        round trip); None for a sample the owner answered with an error (it is then read from the shard), and for
        every one when the connection was refused or dropped (the owner is taken as lost for ``PEER_RETRY_S``, named
        once). The connections to a peer are pooled: a request takes an idle one or opens one, and returns it."""
        with self.cond:
            sock = self.idle[owner].pop() if self.idle[owner] else None
        got: list[Record | None] = []
        try:
            if sock is None:
                try:
                    sock = socket.create_connection(self.peers[owner], timeout=PEER_TIMEOUT_S)
                except (TimeoutError, socket.timeout) as exc:  # no answer to a connect: the node is gone or cut off
                    raise ConnectionError(f"no connection within {PEER_TIMEOUT_S:.0f} s ({exc})") from None
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"".join(REQUEST.pack(PEER_GET, i) for i in indices))
            for index in indices:
                status, echoed, label, crc, version, length = REPLY.unpack(recv_exact(sock, REPLY.size))
                data = recv_exact(sock, length)
                if echoed != index:  # out of step: not pooled, the peer not taken as lost
                    sock.close()
                    self._say_once(f"step {owner}", f"node {owner}'s cache answered sample {index} with sample "
                                   f"{echoed}; read from the shard", len(indices) - len(got))
                    return self._counted(got, len(indices))
                if status != OK:
                    self._say_once(f"failed {owner}", f"node {owner}'s cache answered sample {index} with "
                                   f"{data.decode(errors='replace')}; read from the shard (later ones are counted, "
                                   "not printed)")
                got.append(Record(data, label, crc, version) if status == OK else None)
        except (TimeoutError, socket.timeout) as exc:  # slow, not gone: these samples from the shard
            sock.close()
            self._say_once(f"slow {owner}", f"node {owner}'s cache took over {PEER_TIMEOUT_S:.0f} s for sample "
                           f"{indices[len(got)]} ({exc}); read from the shared filesystem (later ones are counted, "
                           "not printed)", len(indices) - len(got))
            return self._counted(got, len(indices))
        except OSError as exc:
            if sock is not None:
                sock.close()
            with self.cond:
                first = owner not in self.counters.peers_lost
                self.lost[owner] = time.monotonic()
                if first:
                    self.counters.peers_lost.append(owner)
            if first:
                self._say(f"node {owner}'s cache at {self.peers[owner][0]}:{self.peers[owner][1]} does not answer "
                          f"({exc}); its samples are read from the shared filesystem, and it is asked again every "
                          f"{PEER_RETRY_S:.0f} s")
            return self._counted(got, len(indices))
        return self._counted(got, len(indices), owner, sock)

    def _counted(self, got: list, asked: int, owner: int = -1, sock=None) -> list:
        """The records an exchange brought (those it did not: None), counted as the peer's reads and bytes; ``sock``:
        the exchange went through, its connection back to the pool."""
        with self.cond:
            if sock is not None:
                self.idle[owner].append(sock)
                self.lost.pop(owner, None)
                self.counters.peer_exchanges += 1
            self.counters.peer_reads += sum(r is not None for r in got)
            self.counters.peer_bytes += sum(len(r.data) for r in got if r is not None)
        return got + [None] * (asked - len(got))

    def _say(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # stderr gone: never why a prefetch leaves samples reserved
            print(f"hpcdl data cache, node {self.spec.node}: {text}", file=sys.stderr, flush=True)

    def _say_once(self, key: str, text: str, samples: int = 1) -> None:
        with self.cond:
            self.counters.peer_failures += samples
            first = key not in self.said
            self.said.add(key)
        if first:
            self._say(text)

    # -- the prefetch
    def announce(self, local_rank: int, epoch: int, order: list[int]) -> None:
        """``local_rank``'s samples still to come in ``epoch``, in its order. A newer epoch than any announced
        before starts that epoch's prefetch: what is held ahead and no longer in any rank's order is dropped, and the
        samples taken are forgotten. The same epoch announced again (a rank's loader restarted) replaces its order."""
        with self.cond:
            self.orders[local_rank] = (epoch, order)
            if epoch > self.epoch:
                self.epoch = epoch
                self.taken.clear()
            self.wanted = wanted = {i for e, o in self.orders.values() if e == self.epoch for i in o}
            for index in [i for i in self.ahead if i not in wanted]:
                del self.ahead[index]
            self.generation += 1
            self.cond.notify_all()

    def _prefetch(self) -> None:
        while True:
            with self.cond:
                while not self.orders:
                    self.cond.wait()
                generation = self.generation
                orders = [o for r, (e, o) in sorted(self.orders.items()) if e == self.epoch]
            runs: dict[int, list[int]] = collections.defaultdict(list)  # reserved samples of each owner, not yet sent
            refill = max(1, min(PEER_RUN * max(self.spec.nodes - 1, 1), self.spec.window // 2))
            for j in range(max(map(len, orders), default=0)):
                for order in orders:
                    if j >= len(order):
                        continue
                    index = order[j]
                    with self.cond:
                        full = len(self.ahead) + len(self.inflight) >= self.spec.window
                    if full:
                        self._flush(runs)  # what is reserved is sent before the window is waited for
                    with self.cond:  # full, it is refilled by runs: once the readers took a run's worth
                        while (full and len(self.ahead) + len(self.inflight) > self.spec.window - refill
                               and self.generation == generation):
                            self.cond.wait(0.5)
                        if self.generation != generation:
                            break
                        if index in self.kept or index in self.ahead or index in self.inflight or index in self.taken:
                            continue
                        self.inflight[index] = threading.Event()  # reserved: a reader asking now waits for it
                    owner = int(self.spec.owners[index])
                    run = runs[owner]
                    run.append(index)
                    if owner == self.spec.node or len(run) >= PEER_RUN:
                        self.pool.submit(self._prefetch_run, owner, run)
                        runs[owner] = []
                else:
                    continue
                break
            self._flush(runs)  # the order's end, or a newer generation's start
            with self.cond:
                while self.generation == generation:
                    self.cond.wait()

    def _flush(self, runs: dict[int, list[int]]) -> None:
        for owner, run in runs.items():
            if run:
                self.pool.submit(self._prefetch_run, owner, run)
        runs.clear()

    def _prefetch_run(self, owner: int, run: list[int]) -> None:
        """A run of reserved samples of one owner: another node's in one exchange with its agent."""
        fetched: list = [UNASKED] * len(run)
        try:
            if len(run) > 1 and self._peer_usable(owner):
                fetched = self._from_peer(owner, run)
        except Exception as exc:  # every reserved sample is still loaded (and released), from the shard
            fetched = [None] * len(run)
            self._say(f"prefetching a run of node {owner}'s samples: {type(exc).__name__}: {exc}")
        for index, record in zip(run, fetched):
            try:
                self._load(index, keep_ahead=True, fetched=record)
            except Exception as exc:  # the reader that asks for it gets the error; said once for a run of them
                with self.cond:
                    self.counters.prefetch_errors += 1
                    first = self.counters.prefetch_errors == 1
                if first:
                    self._say(f"prefetching sample {index}: {exc} (further prefetch errors are counted, not printed)")

    def stats(self) -> dict:
        with self.cond:
            return {**self.counters.__dict__, "peers_lost": list(self.counters.peers_lost), "node": self.spec.node,
                    "budget": self.spec.budget, "held_ahead": len(self.ahead)}
