"""The on-disk format, version 2 (docs/data-format.md): HDF5 shards of encoded images and a JSON manifest.

Version 2 differs from 1 only in what each record's checksum covers: the image's bytes and its label
(version 1: the bytes alone, so a flipped label read as a valid record). Both are read.

A shard holds the encoded images back to back in one contiguous uint8 dataset, so reading an image is
one contiguous read at a known offset, and reading a shard front to back is one sequential stream.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import struct
import zlib
from dataclasses import dataclass, field

import h5py
import numpy as np

from hpcdl.errors import DataError, StorageError
from hpcdl.utils import atomic_write_text

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SHARD_FORMAT = "hpcdl-shard"
MANIFEST_FORMAT = "hpcdl-dataset"
MANIFEST = "manifest.json"
PARTS_DIR = "parts"
TMP_SUFFIX = ".tmp"
# The shard datasets a reader needs; docs/data-format.md describes these and the optional ones.
REQUIRED_DATASETS = ("images", "offsets", "labels", "crc32")


def shard_name(part: int, index: int) -> str:
    return f"shard-p{part:04d}-{index:05d}.h5"


def part_name(part: int, parts: int) -> str:
    return os.path.join(PARTS_DIR, f"part-{part:04d}-of-{parts:04d}.json")


@contextlib.contextmanager
def open_h5(path):
    """Open a shard (a path, or a binary file object) read-only through a Python file object.

    HDF5 then takes no file lock (locks fail on Lustre and NFS), and every open is a Python ``open``
    that the data benchmark can count. A file object passed in stays open; one opened here is closed.
    """
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(open(path, "rb")) if isinstance(path, str) else path
        yield stack.enter_context(h5py.File(raw, "r"))


def sha256_file(path: str, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def crc32(data: bytes | np.ndarray) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


_LABEL = struct.Struct("<q")


def record_crc(data: bytes | np.ndarray, label: int, version: int = FORMAT_VERSION) -> int:
    """The ``crc32`` dataset's value for one record: CRC32 of the image bytes, continued over the label
    as a little-endian int64 (version 2); of the bytes alone in version 1."""
    crc = zlib.crc32(data)
    if version >= 2:
        crc = zlib.crc32(_LABEL.pack(label), crc)
    return crc & 0xFFFFFFFF


def shard_version(h5, path: str) -> int:
    """A shard's format version, refused with the fix when this hpcdl cannot read it."""
    version = int(h5.attrs.get("format_version", 1))
    if version not in READABLE_VERSIONS:
        raise DataError(f"{path}: shard format version {version}; this hpcdl reads versions "
                        f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade hpcdl, or repack with this one")
    return version


@dataclass(slots=True)
class ShardEntry:
    """One shard as the manifest lists it."""

    file: str
    count: int
    bytes: int
    sha256: str
    first: int = 0  # the part's item range this shard covers, for --resume
    stop: int = 0
    rejected: list = field(default_factory=list)


ENTRY_FIELDS = ("file", "count", "bytes", "sha256")  # what a merged manifest lists per shard


def write_shard(path: str, images: list[bytes], labels: list[int], keys: list[str], sizes: list[tuple[int, int]],
                orig_sizes: list[tuple[int, int]], attrs: dict) -> ShardEntry:
    """Write one shard under a temporary name, fsync, rename into place, and return its entry."""
    offsets = np.zeros(len(images) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in images], out=offsets[1:])
    tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            # Contiguous, uncompressed: one read per image, no chunk index to walk (see docs).
            f.create_dataset("images", data=np.frombuffer(b"".join(images), dtype=np.uint8))
            f.create_dataset("offsets", data=offsets)
            f.create_dataset("labels", data=np.asarray(labels, dtype=np.int64))
            f.create_dataset("crc32", data=np.asarray([record_crc(b, y) for b, y in zip(images, labels)],
                                                      dtype=np.uint32))
            f.create_dataset("sizes", data=np.asarray(sizes, dtype=np.int32).reshape(-1, 2))
            f.create_dataset("orig_sizes", data=np.asarray(orig_sizes, dtype=np.int32).reshape(-1, 2))
            f.create_dataset("keys", data=keys, dtype=h5py.string_dtype())
            f.attrs.update({"format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "encoding": "jpeg",
                            "count": len(images), **attrs})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return ShardEntry(file=os.path.basename(path), count=len(images), bytes=os.path.getsize(path),
                      sha256=sha256_file(path))


@dataclass(slots=True)
class Manifest:
    """The dataset root's ``manifest.json`` (and, with ``complete`` false, a part's progress file)."""

    tree: str  # how the packed SRC was organized (pack --tree)
    classes: list[dict]  # {"index", "wnid", "name"}
    shards: list[ShardEntry]
    rejected: list[dict]  # {"path", "reason"}
    options: dict
    part: int = 0
    parts: int = 1
    complete: bool = False
    stats: dict = field(default_factory=dict)  # hpcdl.data.stats: channel statistics, class counts, sizes
    format: str = MANIFEST_FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def num_images(self) -> int:
        return sum(s.count for s in self.shards)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to_json(self) -> str:
        body = {k: getattr(self, k) for k in self.__slots__}
        # first, stop and rejected matter to a part's progress only; a merged manifest leaves them at 0
        body["shards"] = [{k: getattr(s, k) for k in ShardEntry.__slots__ if s.stop or k in ENTRY_FIELDS}
                          for s in self.shards]
        body["num_images"], body["num_classes"] = self.num_images, self.num_classes
        body["summary"] = summarize(self)
        return json.dumps(body, indent=1, ensure_ascii=False) + "\n"

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "Manifest":
        try:
            with open(path, encoding="utf-8") as f:
                body = json.load(f)
        except FileNotFoundError:
            raise DataError(f"{path}: no manifest here; pack the dataset with 'hpcdl pack' first") from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: unreadable manifest ({exc}); repack, or restore it from the pack's output")
        if body.get("format") != MANIFEST_FORMAT or body.get("format_version") not in READABLE_VERSIONS:
            raise DataError(f"{path}: format {body.get('format')!r} version {body.get('format_version')!r}; "
                            f"this hpcdl reads {MANIFEST_FORMAT!r} versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}: repack with it")
        try:
            shards = [ShardEntry(**s) for s in body["shards"]]
            if "tree" not in body and "layout" in body:  # written before pack --layout became --tree
                body["tree"] = body["layout"]
            optional = ("stats",)  # absent from manifests packed before hpcdl measured them
            return cls(**{k: body[k] for k in cls.__slots__ if k != "shards" and (k in body or k not in optional)},
                       shards=shards)
        except (KeyError, TypeError) as exc:
            raise DataError(f"{path}: manifest field missing or malformed ({exc}); repack the dataset") from None


def summarize(m: Manifest) -> dict:
    reasons: dict[str, int] = {}
    for r in m.rejected:
        kind = r["reason"].split(":")[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    return {"images": m.num_images, "shards": len(m.shards), "rejected": len(m.rejected),
            "rejected_by_reason": reasons}


def check_shard(root: str, entry: ShardEntry, num_classes: int, full: bool) -> list[str]:
    """Problems with one shard, each naming the file; empty when it is sound.

    Quick checks read the size and the HDF5 index arrays; ``full`` also hashes the whole file and,
    when the hash differs, finds the damaged images by their CRC32.
    """
    path = os.path.join(root, entry.file)
    if not os.path.exists(path):
        return [f"{path}: missing (the manifest lists it with {entry.count} images)"]
    size = os.path.getsize(path)
    if size != entry.bytes:
        return [f"{path}: {size} bytes, the manifest says {entry.bytes} (truncated or overwritten)"]
    try:
        problems = _check_structure(path, entry, num_classes)
    except (OSError, KeyError, ValueError) as exc:
        return [f"{path}: not a readable hpcdl shard ({exc})"]
    if full and not problems and sha256_file(path) != entry.sha256:
        bad = damaged_images(path)
        what = f"images {bad[:10]} fail their CRC32" if bad else "the damage is in HDF5 metadata"
        problems.append(f"{path}: sha256 differs from the manifest; {what}")
    return problems


def _check_structure(path: str, entry: ShardEntry, num_classes: int) -> list[str]:
    with open_h5(path) as f:
        missing = [d for d in REQUIRED_DATASETS if d not in f]
        if missing:
            return [f"{path}: datasets {missing} missing"]
        offsets, labels, n = f["offsets"][:], f["labels"][:], int(f["images"].shape[0])
        count = int(f.attrs.get("count", -1))
    problems = []
    if count != entry.count or len(labels) != entry.count or len(offsets) != entry.count + 1:
        problems.append(f"{path}: holds {len(labels)} labels and {len(offsets)} offsets for count {count}; "
                        f"the manifest says {entry.count}")
    elif offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
        problems.append(f"{path}: offsets do not tile the {n}-byte image array")
    elif len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        problems.append(f"{path}: labels outside 0..{num_classes - 1}")
    return problems


def damaged_images(path: str) -> list[int]:
    with open_h5(path) as f:
        version = shard_version(f, path)
        offsets, crcs, labels, images = f["offsets"][:], f["crc32"][:], f["labels"][:], f["images"]
        return [i for i in range(len(crcs))
                if record_crc(images[offsets[i]:offsets[i + 1]], int(labels[i]), version) != crcs[i]]


@dataclass(slots=True)
class OpenShard:
    """A shard opened for reading its images: the file, where its image bytes start, and its index arrays."""

    fd: int  # of the open file object below
    file: object
    base: int  # file offset of the contiguous image bytes
    offsets: np.ndarray
    labels: np.ndarray
    crcs: np.ndarray
    version: int  # the shard's format version: what its CRC32s cover
    whole: bytes | None = None  # the whole file, when open_shard read it whole (its images at base + offsets)


def open_shard(path: str, count: int, root: str, whole_if=None) -> OpenShard:
    """Read the index arrays through h5py, then read images with one pread each at their file offset.

    ``whole_if(file size)`` true: read the whole file first, in one sequential pass, and its index from those bytes
    (the node cache's owner of a shard, which serves all of it: a parallel filesystem's client reads ahead at an
    open, bytes that are used only when the read that follows is sequential)."""
    fix = f"run 'hpcdl verify --full {root}', then repack or restore the shard"
    try:
        raw = open(path, "rb")  # kept open for the reads; h5py leaves a file object it was given open
    except OSError as exc:
        if storage_failed(exc):  # a lost mount (ENOTCONN), a stale handle: not a missing shard
            raise storage_error(path, exc) from None
        raise DataError(f"{path}: cannot open the shard ({exc.strerror or exc}); {fix}") from None
    try:
        whole = None
        if whole_if is not None and whole_if(length := os.fstat(raw.fileno()).st_size):
            whole = read_at(raw.fileno(), 0, length, path)
        with open_h5(io.BytesIO(whole) if whole is not None else raw) as h5:
            version = shard_version(h5, path)
            base = h5["images"].id.get_offset()
            if base is None:
                raise DataError(f"{path}: the images dataset is not stored contiguously; repack it with hpcdl pack")
            s = OpenShard(raw.fileno(), raw, int(base), h5["offsets"][:], h5["labels"][:], h5["crc32"][:], version,
                          whole)
            size = int(h5["images"].shape[0])
    except DataError:
        raw.close()
        raise
    except Exception as exc:  # h5py's errors on damaged metadata: OSError, KeyError, ValueError, RuntimeError
        raw.close()
        if storage_failed(exc):
            raise storage_error(path, exc) from None
        raise DataError(f"{path}: not a readable hpcdl shard ({type(exc).__name__}: {exc}); {fix}") from None
    if not (len(s.offsets) == count + 1 == len(s.labels) + 1 == len(s.crcs) + 1 and s.offsets[0] == 0
            and s.offsets[-1] == size and np.all(np.diff(s.offsets) > 0)):
        raw.close()
        raise DataError(f"{path}: its index does not match the manifest's {count} images (the shard or "
                        f"manifest.json was changed after packing); {fix}")
    return s


# What a filesystem returns when it cannot reach the data, not when the data is damaged: a storage server (a
# Lustre OST, a MooseFS chunk server) down, a mount lost. The same file reads again once the server is back.
# EREMOTEIO, ESHUTDOWN, ECOMM: a Lustre client evicted by its servers; EIO also a failing local disk.
_STORAGE_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ETIMEDOUT, errno.ENOTCONN, errno.ESTALE, errno.EHOSTDOWN,
                             errno.EHOSTUNREACH, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENODEV, errno.EREMOTEIO,
                             errno.ESHUTDOWN, errno.ECOMM})


def storage_failed(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def storage_error(path: str, exc: OSError) -> StorageError:
    """The error for a read the filesystem failed (:func:`storage_failed`): it names the file and the filesystem,
    not damage; nothing is to be repacked."""
    return StorageError(f"{path}: the filesystem did not return its data ({exc.strerror or exc}, errno {exc.errno}): "
                        f"a storage server (a Lustre OST) down, the mount lost or a failing disk, not known damage "
                        f"to the shard; when 'df {os.path.dirname(path)}' and a read of the file answer again, "
                        f"resume the run")


def read_record(s: OpenShard, i: int, path: str) -> bytes:
    """Image ``i``'s bytes from shard ``s`` (opened from ``path``): one pread at its offset; a read the filesystem
    fails is a :class:`~hpcdl.errors.StorageError` naming ``path``."""
    return read_span(s, int(s.offsets[i]), int(s.offsets[i + 1]), path)


def read_span(s: OpenShard, start: int, stop: int, path: str) -> bytes:
    """The image bytes ``start:stop`` of shard ``s`` (offsets into its images): from the bytes it was read whole
    into, else read; a read the filesystem fails is a :class:`~hpcdl.errors.StorageError` naming ``path``."""
    if s.whole is not None:
        return s.whole[s.base + start:s.base + stop]
    return read_at(s.fd, s.base + start, s.base + stop, path)


def read_at(fd: int, start: int, stop: int, path: str, block: int = 8 << 20) -> bytes:
    """Bytes ``start:stop`` of the file ``fd`` (opened from ``path``), in preads of at most ``block``; a read that
    ends short of ``stop`` (the file shorter than its index says) is a DataError, never a shifted record."""
    parts, at = [], start
    try:
        while at < stop:
            part = os.pread(fd, min(block, stop - at), at)
            if not part:
                raise DataError(f"{path}: the file ends at byte {at}, short of the {stop} its index needs; run "
                                f"'hpcdl verify --full' on its dataset, then repack or restore it")
            parts.append(part)
            at += len(part)
    except OSError as exc:
        if storage_failed(exc):
            raise storage_error(path, exc) from None
        raise
    return parts[0] if len(parts) == 1 else b"".join(parts)


def record_key(path: str, i: int) -> str:
    """Image ``i``'s key (its path in the source), for the message about a damaged record."""
    try:
        with open_h5(path) as h5:
            return h5["keys"].asstr()[i]
    except Exception as exc:  # the damage may be here too; the index still names the record
        return f"key unreadable: {type(exc).__name__}"
