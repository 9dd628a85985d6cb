"""The node cache (data.cache=node, hpcdl.data.cache): which node owns each sample, two real agent processes serving
each other over TCP, a damaged copy and a lost agent, and a 2-node Slurm job trained through it."""

import logging
import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PYTHON, REPO, hpcdl, sbatch_wait

from hpcdl.data.cache.spec import AgentSpec
from hpcdl.data.cache.client import CacheClient, checked_read, start_agent
from hpcdl.data.cache.owners import sample_owners, shard_owners
from hpcdl.data.dataset import ShardDataset
from hpcdl.data.format import record_crc
from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.synthetic import generate

SIZES = [7, 13, 5, 11, 9, 6, 12]  # 63 samples: divides by no rank count here


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 9])
def test_each_shard_is_owned_by_one_node_and_the_nodes_hold_as_many_samples_as_the_shards_allow(nodes):
    """A node opens only the shards it owns: each shard once per job. Owners follow from the shard sizes and the
    node count alone (not the sampler, the epoch or the rank count: a resumed run on other ranks finds the same)."""
    owners = sample_owners(SIZES, nodes)
    assert owners.dtype == np.int32 and len(owners) == sum(SIZES)
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    per_shard = [set(owners[starts[s]:starts[s + 1]].tolist()) for s in range(len(SIZES))]
    assert all(len(o) == 1 for o in per_shard)  # a shard is never split over nodes
    assert np.array_equal(owners, np.repeat(shard_owners(SIZES, nodes), SIZES))
    held = np.bincount(owners, minlength=nodes)
    assert len(held) == nodes
    if nodes <= len(SIZES):  # every node owns something, and none more than the least plus the largest shard
        assert held.min() > 0 and held.max() - held.min() <= max(SIZES)
    else:
        assert (held > 0).sum() == len(SIZES)
    assert np.array_equal(sample_owners(list(SIZES), nodes), owners)  # the same on every node
    with pytest.raises(ValueError, match="0 nodes"):
        shard_owners(SIZES, 0)


def test_data_cache_auto_reads_through_the_node_cache_only_on_several_nodes_off_node_local_storage(tmp_path):
    """data.cache=auto (the default): the node cache on a job of more than one node whose training set is on a
    filesystem the nodes share (Lustre, GPFS, NFS, a FUSE mount), direct reads on one node or from the node's own
    disk. The filesystem is found from the mount table (a written one here: no Lustre on this machine)."""
    from types import SimpleNamespace

    from hpcdl.train.build import LOCAL_FILESYSTEMS, node_cache_wanted
    from hpcdl.utils import filesystem_type

    table = tmp_path / "mountinfo"
    table.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                     "40 22 0:50 / /scratch rw - lustre 10.0.0.1@o2ib:/scratch rw\n"
                     "41 40 0:51 / /scratch/local\\040copy rw - xfs /dev/nvme0n1 rw\n"
                     "42 22 0:52 / /tmp rw - tmpfs tmpfs rw\n")
    assert filesystem_type("/scratch/imagenet/train", str(table)) == "lustre"
    assert filesystem_type("/scratch/local copy/train", str(table)) == "xfs"  # the longest mount point holds it
    assert filesystem_type("/scratchy", str(table)) == "ext4" and filesystem_type("/tmp/x", str(table)) == "tmpfs"
    assert filesystem_type("/x", str(tmp_path / "no-such-table")) == "?"
    assert {"ext4", "xfs", "tmpfs"} <= LOCAL_FILESYSTEMS and "lustre" not in LOCAL_FILESYSTEMS
    one, two = (SimpleNamespace(env=SimpleNamespace(nodes=n), rank=0, group=None) for n in (1, 2))
    lustre = lambda root: "lustre"  # noqa: E731 (the mount table above, by another name)
    assert node_cache_wanted("node", "/scratch/x", one, lustre) and not node_cache_wanted("none", "/x", two, lustre)
    assert not node_cache_wanted("auto", "/scratch/x", one, lustre)  # one node: nothing to share, no collective
    # auto on two nodes agrees over the ranks (an all-reduce): the Slurm tests run it (tests/test_pfs.py: on the
    # local cluster's MooseFS it chooses node; on the wide partition's local disk, none)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    gen = generate(str(root / "src"), classes=4, per_class=16, size=(160, 128), seed=3)
    pack(PackConfig(src=gen.root, out=str(root / "out"), shard_size="64K", workers=1))
    return root / "out"


def _agents(packed: Path, budget: int = 1 << 30):
    """Two agents on loopback as nodes 0 and 1, owning the shards data.cache=node deals them; each told the other's
    address."""
    ds = ShardDataset(str(packed), verify="none")
    owners = sample_owners(ds.shard_sizes, 2)
    started = [start_agent(AgentSpec(ds.root, ds.paths, ds.shard_sizes, owners, node, budget, window=16, nodes=2,
                                     host="127.0.0.1")) for node in (0, 1)]
    clients = [CacheClient(("127.0.0.1", port)) for _, port in started]
    for node, client in enumerate(clients):
        client.peers({1 - node: ("127.0.0.1", started[1 - node][1])})
    return ds, owners, [p for p, _ in started], clients


def _direct(ds: ShardDataset, index: int) -> tuple[bytes, int]:
    shard = int(np.searchsorted(ds.starts, index, side="right")) - 1
    return ds.read(shard, int(index - ds.starts[shard]))


def test_two_agents_read_each_sample_from_the_shards_once_and_serve_each_other(packed):
    ds, owners, procs, clients = _agents(packed)
    try:
        n, mine = len(ds), int((owners == 0).sum())
        assert len(ds.paths) > 2 and 0 < mine < n
        order = list(np.random.default_rng(0).permutation(n))
        clients[0].announce(0, 0, order)  # node 0's one rank reads every sample, twice
        for ahead in (True, False):
            for i in order:
                assert checked_read(clients[0], int(i), ds.root) == _direct(ds, int(i))
            if ahead:  # the announced pass: node 1's samples prefetched in runs, a round trip each
                first = clients[0].stats()[0]
                assert first["peer_exchanges"] <= first["peer_reads"] / 3, first
        a, b = clients[0].stats()[0], clients[1].stats()[0]
        assert [n["node"] for n in clients[0].stats(every_node=True)] == [0, 1]
        # node 0 read its own shards from the filesystem once and kept them; node 1's came from node 1 in each
        # pass, and node 1 read them from the filesystem once
        theirs = n - mine
        assert (a["source_reads"], a["peer_reads"], b["source_reads"], b["served_to_peers"]) == \
            (mine, 2 * theirs, theirs, 2 * theirs)
        # each node opened only the shards it owns: every shard once for the two
        owned = {int(o) for o in owners[ds.starts[:-1]]}
        assert owned == {0, 1} and a["source_opens"] + b["source_opens"] == len(ds.paths)
        assert a["kept_samples"] == mine and b["kept_samples"] == theirs
        # each owner read its shards whole, once (their index and HDF5's metadata with the images)
        assert a["source_bytes"] + b["source_bytes"] == sum(os.path.getsize(p) for p in ds.paths)
        assert a["ahead_hits"] > 0  # the announced order was prefetched
    finally:
        for p in procs:
            p.kill()


def test_a_budget_keeps_what_fits_and_a_lost_peer_s_samples_come_from_the_shards(packed, caplog):
    ds, owners, procs, clients = _agents(packed, budget=12000)
    try:
        n = len(ds)
        for i in range(n):
            checked_read(clients[0], i, ds.root)
        a = clients[0].stats()[0]
        assert 0 < a["kept_bytes"] <= 12000 and a["kept_samples"] < int((owners == 0).sum())
        procs[1].kill()
        procs[1].wait()
        for i in range(n):  # node 1 is gone: its samples are read from the shards, the reads go on
            assert checked_read(clients[0], i, ds.root) == _direct(ds, i)
        after = clients[0].stats()[0]
        assert after["peers_lost"] == [1] and [n["node"] for n in clients[0].stats(every_node=True)] == [0]
        assert after["source_reads"] - a["source_reads"] == n - a["kept_samples"]  # all but what node 0 kept
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _failing_peer() -> tuple[int, list[int], threading.Event]:
    """A fake peer agent (a real one fails a sample on demand only with a damaged shard of its own): it answers
    every sample asked of it with an error, and lists the samples asked."""
    from hpcdl.data.cache.wire import ERROR, REPLY, REQUEST, recv_exact

    server, asked, stop = socket.create_server(("127.0.0.1", 0)), [], threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    _, index = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                except (OSError, ConnectionError):
                    return
                asked.append(index)
                message = b"fake: this peer fails every sample"
                conn.sendall(REPLY.pack(ERROR, index, 0, 0, 0, len(message)) + message)

    def accept() -> None:
        while not stop.is_set():
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1], asked, stop  # the accept thread ends with the test's process


def test_a_run_of_samples_its_owner_failed_is_read_from_the_shards_without_asking_again(packed):
    """The agent prefetches another node's samples in runs, one exchange each; a sample the run could not bring
    (its owner answered an error, or was slow past the timeout) is read from its shard. Before, each was asked of
    the owner again, alone: a slow owner cost the timeout once per sample of the run."""
    ds = ShardDataset(str(packed), verify="none")
    owners = (np.arange(len(ds)) % 2).astype(np.int32)
    port, asked, stop = _failing_peer()
    proc, agent_port = start_agent(AgentSpec(ds.root, ds.paths, ds.shard_sizes, owners, 0, 1 << 30, window=64,
                                             nodes=2, host="127.0.0.1"))
    try:
        client, n = CacheClient(("127.0.0.1", agent_port)), len(ds)
        client.peers({1: ("127.0.0.1", port)})
        order = [int(i) for i in np.random.default_rng(2).permutation(n)]
        client.announce(0, 0, order)
        for i in order:
            assert checked_read(client, i, ds.root) == _direct(ds, i)
        stats, theirs = client.stats()[0], [i for i in order if owners[i] == 1]
        assert sorted(asked) == sorted(theirs), (len(asked), len(theirs))  # each asked once
        assert stats["peer_failures"] == len(theirs) and stats["peer_reads"] == 0, stats
        assert stats["peer_exchanges"] >= 1 and stats["ahead_hits"] > 0, stats  # the runs were asked, and failed
    finally:
        stop.set()
        proc.kill()
        proc.wait()


def test_a_rank_that_announces_late_neither_makes_the_agent_read_twice_nor_fills_its_window(packed):
    """Two local ranks, the second announcing its epoch after the first has read ahead, a window of 6 samples, half
    the samples another node's (a node that is not there: read from the shards, held ahead, not kept): every sample
    read from the shards once, nothing left held ahead at the epoch's end; the next epoch reads only the other
    node's half from the shards again."""
    ds = ShardDataset(str(packed), verify="none")
    owners = (np.arange(len(ds)) % 2).astype(np.int32)
    proc, port = start_agent(AgentSpec(ds.root, ds.paths, ds.shard_sizes, owners, 0, 1 << 30, window=6,
                                       host="127.0.0.1"))
    try:
        client, n = CacheClient(("127.0.0.1", port)), len(ds)
        order = [int(i) for i in np.random.default_rng(1).permutation(n)]
        mine, late = order[0::2], order[1::2]
        client.announce(0, 0, mine)
        for i in mine[:10]:
            assert checked_read(client, i, ds.root) == _direct(ds, i)
        client.announce(1, 0, late)
        for i in mine[10:] + late:
            assert checked_read(client, i, ds.root) == _direct(ds, i)
        first = client.stats()[0]
        assert (first["source_reads"], first["source_again"], first["held_ahead"]) == (n, 0, 0), first
        client.announce(0, 1, mine)
        client.announce(1, 1, late)
        for i in order:
            checked_read(client, i, ds.root)
        second = client.stats()[0]
        assert (second["source_again"], second["kept_hits"] - first["kept_hits"]) == (n // 2, n // 2), second
        assert first["ahead_hits"] > 0 and second["held_ahead"] == 0
    finally:
        proc.kill()
        proc.wait()


class DamagingClient(CacheClient):
    """A fake agent connection (named so): its first answer for a sample carries one flipped byte, as a damaged
    copy in a cache's RAM or on the wire would; a real agent cannot be made to damage a record on demand."""

    def __init__(self, ds: ShardDataset):
        super().__init__(("fake", 0))
        self.ds, self.asked = ds, []

    def get(self, index: int, source: bool = False):
        self.asked.append((index, source))
        data, label = _direct(self.ds, index)
        crc = record_crc(data, label)
        if not source:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data, label, crc, 2


def test_a_damaged_copy_is_named_and_read_again_from_its_shard_never_trained_on(packed, caplog):
    ds = ShardDataset(str(packed), verify="none")
    fake = DamagingClient(ds)
    with caplog.at_level(logging.WARNING):
        assert checked_read(fake, 5, ds.root) == _direct(ds, 5)
    assert fake.asked == [(5, False), (5, True)]
    assert "sample 5" in caplog.text and "damaged" in caplog.text and "reading it from its shard" in caplog.text


def test_a_reader_whose_agent_is_gone_reads_the_shards_itself(packed, caplog):
    ds, owners, procs, clients = _agents(packed)
    ds.cache = clients[0]
    try:
        assert ds[3][0] == _direct(ds, 3)[0]
        procs[0].kill()
        procs[0].wait()
        with caplog.at_level(logging.WARNING):
            assert ds[4][0] == _direct(ds, 4)[0] and ds[9][0] == _direct(ds, 9)[0]
        assert caplog.text.count("does not answer") == 1 and "reads" in caplog.text
    finally:
        for p in procs:
            p.kill()


def test_a_loaders_batch_is_one_exchange_with_the_agent_and_reads_as_sample_by_sample(packed, caplog):
    """torch's fetcher hands ShardDataset a batch's indices (__getitems__): through the node's agent they go in one
    exchange, not one round trip per sample, and give what the reads one by one give; when the agent is gone, the
    batch is read from the shards, the agent named once."""
    ds, owners, procs, clients = _agents(packed)
    ds.cache = clients[0]
    exchanges = []
    real = clients[0]._exchange
    clients[0]._exchange = lambda requests, args: exchanges.append(len(args)) or real(requests, args)
    try:
        batch = [int(i) for i in np.random.default_rng(1).permutation(len(ds))[:24]]  # both nodes' samples
        assert {int(owners[i]) for i in batch} == {0, 1}
        assert ds.__getitems__(batch) == [_direct(ds, i) for i in batch]
        assert exchanges == [24]
        procs[0].kill()
        procs[0].wait()
        with caplog.at_level(logging.WARNING):
            assert ds.__getitems__(batch[:5]) == [_direct(ds, i) for i in batch[:5]]
        assert caplog.text.count("does not answer") == 1
    finally:
        for p in procs:
            p.kill()


def test_an_agent_ends_with_the_process_that_started_it(packed, tmp_path):
    """Its rank killed outright (the OOM killer, a node's loss), the agent does not outlive it."""
    script = ("import sys, numpy as np, time\nfrom hpcdl.data.cache.spec import AgentSpec\n"
              "from hpcdl.data.cache.client import start_agent\nfrom hpcdl.data.dataset import ShardDataset\n"
              f"ds = ShardDataset({str(packed)!r}, verify='none')\n"
              "p, port = start_agent(AgentSpec(ds.root, ds.paths, ds.shard_sizes, np.zeros(len(ds), np.int32), 0, 1, 4))\n"
              "print(p.pid, flush=True)\ntime.sleep(600)\n")
    rank = subprocess.Popen([PYTHON, "-c", script], stdout=subprocess.PIPE, text=True)
    agent = int(rank.stdout.readline())
    rank.send_signal(signal.SIGKILL)
    rank.wait()
    for _ in range(100):
        if not Path(f"/proc/{agent}").exists() or "Z" in Path(f"/proc/{agent}/stat").read_text().split()[2]:
            break
        import time
        time.sleep(0.1)
    else:
        raise AssertionError(f"the agent {agent} outlived its rank")


@pytest.mark.timeout(900)
def test_two_nodes_train_through_the_cache_as_without_it(two_nodes, data, tmp_path):
    """A 2-node job of 4 ranks over 3 epochs of a dataset of 240 images at a global batch of 64 (each epoch ends on a
    short step), the default 4 loader workers: the same weights as reading the shards directly, each
    sample trained once an epoch, and the counters in the log: after the first epoch nothing from the shards."""
    runs = {}
    for cache in ("none", "node"):
        run = tmp_path / cache
        script = tmp_path / f"{cache}.sbatch"
        made = hpcdl("sbatch", "--profile", "local", "--partition", "debug", "--nodes", 2, "--tasks-per-node", 2,
                     "--time", 5, "--output", f"{tmp_path}/{cache}-%j.out", "--python", PYTHON, "--write", script, "--",
                     "train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}", "--set", "data.val=",
                     "--set", f"run_dir={run}", "--set", "loop.backend=gloo", "--set", "epochs=3", "--set", "ranks=4",
                     "--set", "global_batch=64", "--set", "data.workers=4", "--set", f"data.cache={cache}",
                     "--set", "checkpoint.every_minutes=0", "--set", "loop.record_samples=true")
        assert made.returncode == 0, made.stderr
        job = sbatch_wait(script, f"--chdir={tmp_path}", env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        runs[cache] = (run, (tmp_path / f"{cache}-{job}.out").read_text())
    (a, _), (b, out) = runs["none"], runs["node"]
    final = sorted((a / "checkpoints").glob("ckpt-*.pt"))[-1].name
    x, y = (torch.load(r / "checkpoints" / final, map_location="cpu", weights_only=True)["model"] for r in (a, b))
    assert all(torch.equal(x[k], y[k]) for k in x), out[-3000:]
    counts = {}
    for f in (b / "samples").iterdir():  # "epoch index step" for each sample a rank trained
        for line in f.read_text().splitlines():
            e, i, _ = line.split()
            counts.setdefault(int(e), []).append(int(i))
    assert sorted(counts) == [0, 1, 2], sorted(counts)
    assert all(sorted(v) == list(range(240)) for v in counts.values())  # each once: none twice, none left out
    lines = re.findall(r"data cache, epoch (\d+)'s start, since the last: (\d) node\(s\): shared filesystem (\d+) "
                       r"samples, [\d.]+ MiB \(0 read again\), (\d+) opens", out)
    assert len(lines) == 3 and all(n == "2" for _, n, _, _ in lines), out[-3000:]
    # by the second epoch's start every sample was read from the shards once (the start-up's reads included)
    assert sum(int(c) for _, _, c, _ in lines[:2]) == 240 and int(lines[2][2]) == 0, lines
    shards = len(list((data / "train").glob("*.h5")))
    assert sum(int(o) for _, _, _, o in lines) <= 2 * shards, lines  # each shard opened at most once per node


def _agent_out_of_step_after(ds: ShardDataset, good: int) -> tuple[int, list[int]]:
    """A fake node agent (a real one answers out of step only when broken): it answers the first ``good`` requests
    with their records, then a request with another sample's index; lists the samples asked."""
    from hpcdl.data.cache.wire import OK, REPLY, REQUEST, recv_exact
    from hpcdl.data.format import FORMAT_VERSION

    server, asked = socket.create_server(("127.0.0.1", 0)), []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                try:
                    _, index = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                except (OSError, ConnectionError):
                    return
                asked.append(index)
                data, label = _direct(ds, index)
                echoed = index if len(asked) <= good else index + 1
                try:
                    conn.sendall(REPLY.pack(OK, echoed, label, record_crc(data, label), FORMAT_VERSION, len(data)) + data)
                except OSError:  # the client closed the connection out of step
                    return

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1], asked


def test_a_batch_whose_exchange_fails_keeps_what_arrived_and_reads_only_the_rest_from_its_shards(packed):
    """A loader's batch of 8 through the node's agent, which answers 3 and then out of step: the 3 answers are used,
    the other 5 read from their shards in this process, nothing asked of the agent twice; the batch is the one the
    shards hold. Before, the whole batch was read from the shards again."""
    ds = ShardDataset(str(packed), verify="none")
    port, asked = _agent_out_of_step_after(ds, good=3)
    cached = ShardDataset(str(packed), verify="none")
    cached.cache = CacheClient(("127.0.0.1", port))
    batch = [5, 0, 17, 3, 9, 11, 2, 8]
    read = []
    cached._direct = lambda i, direct=cached._direct: read.append(i) or direct(i)  # counts the direct reads
    got = cached.__getitems__(batch)
    assert [(bytes(x), y) for x, y in got] == [(bytes(x), y) for x, y in (ds[i] for i in batch)]
    # the 8 requests were sent at once; the fake read them until the client closed on the 4th answer
    assert 4 <= len(asked) and asked == batch[:len(asked)] and read == batch[3:], (asked, read)
