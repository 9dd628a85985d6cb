"""The reader: a map-style Dataset over packed shards.

Shards are opened lazily, in the process that reads them, and reopened after a fork: a DataLoader
worker never uses an HDF5 handle its parent opened. Every read checks the record's CRC32 (the image's
bytes and its label), so damage that start-up checks did not look for is reported with the shard and
the image's key, not decoded into noise or trained on under a wrong label. A shard that is missing,
cut short or no longer HDF5, or that disagrees with the manifest, is reported when it is first opened.
"""

from __future__ import annotations

import os
import random
import resource
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch.utils.data import Dataset

from hpcdl.data.format import Manifest, open_h5, record_crc, shard_version
from hpcdl.data.sampler import Sample
from hpcdl.data.verify import check_dataset, load_manifest
from hpcdl.errors import ConfigError, DataError
from hpcdl.names import VERIFY

PADDING_LABEL = -1  # the label of an evaluation sample repeated only to even out the ranks


@dataclass(slots=True)
class _OpenShard:
    fd: int  # of the open file object below
    file: object
    base: int  # file offset of the contiguous image bytes
    offsets: np.ndarray
    labels: np.ndarray
    crcs: np.ndarray
    version: int  # the shard's format version: what its CRC32s cover


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
        self._open: dict[int, _OpenShard] = {}
        self._pid = None
        _raise_open_file_limit()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} images of {self.root}")
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        data, label = self.read(shard, int(index - self.starts[shard]))
        sample = self._transform(data, index)
        return sample, (PADDING_LABEL if isinstance(index, Sample) and index.padding else label)

    def _transform(self, data: bytes, index: int):
        if self.transform is None:
            return data
        if self.seed is None:
            return self.transform(data)
        epoch = index.epoch if isinstance(index, Sample) else 0
        return self.transform(data, random.Random(f"{self.seed}:{epoch}:{int(index)}"))

    def read(self, shard: int, i: int) -> tuple[bytes, int]:
        s = self._shard(shard)
        start, stop = int(s.offsets[i]), int(s.offsets[i + 1])
        data, label = os.pread(s.fd, stop - start, s.base + start), int(s.labels[i])
        if self.checksums and (len(data) != stop - start or record_crc(data, label, s.version) != s.crcs[i]):
            raise DataError(f"{self.paths[shard]}: image {i} ({_key(self.paths[shard], i)}) fails its CRC32, "
                            f"the shard is damaged; run 'hpcdl verify --full {self.root}', then repack or "
                            f"restore the shard")
        return data, label

    def _shard(self, shard: int) -> _OpenShard:
        if self._pid != os.getpid():  # a fresh process (a forked worker): drop the parent's handles
            self._open, self._pid = {}, os.getpid()
        s = self._open.get(shard)
        if s is None:
            s = self._open[shard] = _open_shard(self.paths[shard], self.shard_sizes[shard], self.root)
            self.files_opened += 1
        return s

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"], state["_pid"] = {}, None
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


def _open_shard(path: str, count: int, root: str) -> _OpenShard:
    """Read the index arrays through h5py, then read images with one pread each at their file offset."""
    fix = f"run 'hpcdl verify --full {root}', then repack or restore the shard"
    try:
        raw = open(path, "rb")  # kept open for the reads; h5py leaves a file object it was given open
    except OSError as exc:
        raise DataError(f"{path}: cannot open the shard ({exc.strerror or exc}); {fix}") from None
    try:
        with open_h5(raw) as h5:
            version = shard_version(h5, path)
            base = h5["images"].id.get_offset()
            if base is None:
                raise DataError(f"{path}: the images dataset is not stored contiguously; repack it with hpcdl pack")
            s = _OpenShard(raw.fileno(), raw, int(base), h5["offsets"][:], h5["labels"][:], h5["crc32"][:], version)
            size = int(h5["images"].shape[0])
    except DataError:
        raw.close()
        raise
    except Exception as exc:  # h5py's errors on damaged metadata: OSError, KeyError, ValueError, RuntimeError
        raw.close()
        raise DataError(f"{path}: not a readable hpcdl shard ({type(exc).__name__}: {exc}); {fix}") from None
    if not (len(s.offsets) == count + 1 == len(s.labels) + 1 == len(s.crcs) + 1 and s.offsets[0] == 0
            and s.offsets[-1] == size and np.all(np.diff(s.offsets) > 0)):
        raw.close()
        raise DataError(f"{path}: its index does not match the manifest's {count} images (the shard or "
                        f"manifest.json was changed after packing); {fix}")
    return s


def _key(path: str, i: int) -> str:
    """Image ``i``'s key (its path in the source), for the message about a damaged record."""
    try:
        with open_h5(path) as h5:
            return h5["keys"].asstr()[i]
    except Exception as exc:  # the damage may be here too; the index still names the record
        return f"key unreadable: {type(exc).__name__}"


def _raise_open_file_limit() -> None:
    """A reader keeps each shard it touched open; lift the soft open-file limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
