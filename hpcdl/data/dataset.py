"""The reader: a map-style Dataset over packed shards.

Shards are opened lazily, in the process that reads them, and reopened after a fork: a DataLoader
worker never uses an HDF5 handle its parent opened. Every read checks the record's CRC32 (the image's
bytes and its label), so damage that start-up checks did not look for is reported with the shard and
the image's key, not decoded into noise or trained on under a wrong label. A shard that is missing,
cut short or no longer HDF5, or that disagrees with the manifest, is reported when it is first opened.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import resource
from typing import Callable

import numpy as np
from torch.utils.data import Dataset

from hpcdl.data.cache.client import CacheClient, checked_read, describe
from hpcdl.data.format import Manifest, OpenShard, open_shard, read_record, record_crc, record_key
from hpcdl.data.sampler import Sample
from hpcdl.data.verify import check_dataset, load_manifest
from hpcdl.errors import ConfigError, DataError
from hpcdl.names import VERIFY

log = logging.getLogger(__name__)

PADDING_LABEL = -1  # the label of an evaluation sample repeated only to even out the ranks


class ShardDataset(Dataset):
    """``dataset[i]`` -> (transform(encoded bytes), label); without a transform, the bytes themselves.

    ``seed``: when given, each sample's augmentation draws from ``random.Random`` seeded by (seed, epoch,
    index), and the transform is called as ``transform(bytes, rng)``: the same sample gets the same crop
    whatever the number of workers and wherever a run resumed. Without it the transform is called as
    ``transform(bytes)`` and draws from the worker's global RNG.

    ``verify``: ``quick`` (default) checks at start-up that every shard is present, of the size the
    manifest says, and holds consistent index arrays; ``full`` also compares sha256 sums, each caller
    hashing the shards ``i % world == rank``; ``none`` skips both.
    """

    def __init__(self, root: str, transform: Callable | None = None, verify: str = "quick", rank: int = 0,
                 world: int = 1, seed: int | None = None, manifest: Manifest | None = None):
        if verify not in VERIFY:
            raise ConfigError(f"verify={verify!r} is unknown; choose one of {', '.join(VERIFY)}")
        self.root, self.transform, self.seed = root, transform, seed
        self.manifest: Manifest = manifest or load_manifest(root)  # a job's ranks get rank 0's (the trainer)
        if verify != "none":
            problems = check_dataset(root, self.manifest, full=verify == "full", rank=rank, world=world)
            if problems:
                raise DataError(f"{root}: {len(problems)} damaged or missing shards; run 'hpcdl verify --full "
                                f"{root}', then repack or restore them:\n  " + "\n  ".join(problems))
        self.paths = [os.path.join(root, s.file) for s in self.manifest.shards]
        self.shard_sizes = [s.count for s in self.manifest.shards]
        self.starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.classes = self.manifest.classes
        self.files_opened = 0  # in this process
        self.checksums = True  # bench data turns it off to show what the check costs
        self._open: dict[int, OpenShard] = {}
        self._pid = None
        self.cache: CacheClient | None = None  # data.cache=node: the node's agent (:mod:`hpcdl.data.cache`)
        self.cache_rank: tuple[int, bool] = (0, False)  # (local rank, logs every node's counters: the job's rank 0)
        self._cache_down_pid: int | None = None
        self._cache_seen: dict | None = None
        self._cache_log_lock = threading.Lock()
        _raise_open_file_limit()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} images of {self.root}")
        return self._sample(index, *(self._cached(int(index)) if self._cache_up() else self._direct(int(index))))

    def __getitems__(self, indices: list) -> list:
        """A loader's batch (torch's fetcher calls this with the batch's indices): through the node's agent in one
        exchange (:meth:`CacheClient.get_many`), each sample checked as one read alone is; without the cache, sample
        by sample. An exchange that fails keeps the answers that arrived and reads the rest from their shards in
        this process (a warning names the batch): not each asked of the agent again (a slow agent cost the client's
        timeout per sample)."""
        if not self._cache_up() or not all(0 <= i < len(self) for i in indices):
            return [self[i] for i in indices]
        try:
            got = self.cache.get_many([int(i) for i in indices])
        except (TimeoutError, socket.timeout, DataError, OSError) as exc:
            got = exc.answers
            if isinstance(exc, (TimeoutError, socket.timeout, DataError)):  # slow past the timeout, or out of step
                log.warning("data cache: a batch of %d samples of %s through the node's agent: %s; %d arrived, the "
                            "rest read from their shards", len(indices), self.root, exc, len(got))
            else:
                self._cache_lost(exc)
        done = [self._sample(i, *self._cached(int(i), one)) for i, one in zip(indices, got)]
        return done + [self._sample(i, *self._direct(int(i))) for i in indices[len(done):]]

    def _sample(self, index, data: bytes, label: int):
        return self._transform(data, index), (PADDING_LABEL if isinstance(index, Sample) and index.padding else label)

    def _cache_up(self) -> bool:
        return self.cache is not None and self._cache_down_pid != os.getpid()

    def _cached(self, index: int, got=None) -> tuple[bytes, int]:
        """Sample ``index`` through the node's agent (``got``: its answer in a batch). An agent that refuses or drops
        the connection is gone: this process reads the shards itself from then on. One that is slow past the
        client's timeout, or that failed this sample (its error names it), costs this sample a direct read, which
        names the shard if it fails too."""
        try:
            return checked_read(self.cache, index, self.root, got)
        except (TimeoutError, socket.timeout, DataError) as exc:
            log.warning("data cache: sample %d of %s through the node's agent: %s; read from its shard", index,
                        self.root, exc)
        except OSError as exc:
            self._cache_lost(exc)
        return self._direct(index)

    def _direct(self, index: int) -> tuple[bytes, int]:
        """Sample ``index`` read from its shard by this process."""
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.read(shard, int(index - self.starts[shard]))

    def _cache_lost(self, exc: OSError) -> None:
        """The agent is gone (its rank ended, or the node is going down): this process reads the shards itself."""
        self._cache_down_pid = os.getpid()
        log.warning("data cache: the node's agent at %s:%d does not answer (%s); process %d reads %s's shards itself "
                    "from now on", *self.cache.address, exc, os.getpid(), self.root)

    def announce(self, sampler) -> None:
        """The loader's epoch starts: tell the node's agent this rank's samples to come, in order (it prefetches
        them). The job's rank 0 also logs every node's counters since the last epoch, from a thread of its own
        and a connection of its own: asking every node takes time the step does not wait for."""
        if not self._cache_up():
            return
        local_rank, logs = self.cache_rank
        epoch = getattr(sampler, "epoch", 0)
        if logs:
            threading.Thread(target=self._log_counters, args=(epoch,), name="cache-counters", daemon=True).start()
        try:
            self.cache.announce(local_rank, epoch, [int(i) for i in sampler])
        except (TimeoutError, socket.timeout, DataError) as exc:
            log.warning("data cache: the node's agent did not take epoch %d's order (%s): it is not prefetched", epoch,
                        exc)
        except OSError as exc:
            self._cache_lost(exc)

    def _log_counters(self, epoch: int) -> None:
        with self._cache_log_lock:
            try:
                nodes = CacheClient(self.cache.address).stats(every_node=True)
            except (OSError, DataError, ValueError) as exc:
                log.warning("data cache: the counters at epoch %d's start could not be read: %s", epoch, exc)
                return
            log.info("data cache, epoch %d's start, since the last: %s", epoch, describe(nodes, self._cache_seen))
            self._cache_seen = {n["node"]: n for n in nodes}

    def _transform(self, data: bytes, index: int):
        if self.transform is None:
            return data
        if self.seed is None:
            return self.transform(data)
        epoch = index.epoch if isinstance(index, Sample) else 0
        return self.transform(data, random.Random(f"{self.seed}:{epoch}:{int(index)}"))

    def read(self, shard: int, i: int) -> tuple[bytes, int]:
        s = self._shard(shard)
        data, label = read_record(s, i, self.paths[shard]), int(s.labels[i])
        if self.checksums and (len(data) != s.offsets[i + 1] - s.offsets[i] or record_crc(data, label, s.version) != s.crcs[i]):
            raise DataError(f"{self.paths[shard]}: image {i} ({record_key(self.paths[shard], i)}) fails its CRC32, "
                            f"the shard is damaged; run 'hpcdl verify --full {self.root}', then repack or "
                            f"restore the shard")
        return data, label

    def _shard(self, shard: int) -> OpenShard:
        if self._pid != os.getpid():  # a fresh process (a forked worker): drop the parent's handles
            self._open, self._pid = {}, os.getpid()
        s = self._open.get(shard)
        if s is None:
            s = self._open[shard] = open_shard(self.paths[shard], self.shard_sizes[shard], self.root)
            self.files_opened += 1
        return s

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"], state["_pid"], state["_cache_log_lock"] = {}, None, None
        return state


class InMemory(Dataset):
    """``count`` samples of ``dataset``, read, decoded and transformed once, then served from memory for each of
    its indices in turn (index ``i`` gives sample ``i % count``): the same step with no loader in it, to measure
    what the loader costs (``data.in_memory``, ``hpcdl bench feed``). The length stays the dataset's."""

    def __init__(self, dataset: Dataset, count: int):
        n = len(dataset)
        self.length = n
        self.samples = [dataset[i * n // min(count, n)] for i in range(min(count, n))]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        sample, label = self.samples[int(index) % len(self.samples)]
        return sample, (PADDING_LABEL if isinstance(index, Sample) and index.padding else label)


def _raise_open_file_limit() -> None:
    """A reader keeps each shard it touched open; lift the soft open-file limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
