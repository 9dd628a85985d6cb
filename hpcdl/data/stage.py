"""Copy a node's shards to node-local disk once (``--stage-to $TMPDIR``).

Local rank 0 copies each shard to a temporary name, hashes it on the way and renames it, then writes the
manifest and a marker holding the manifest's sha256. The other local ranks wait for the marker. A copy
whose marker matches is reused by later jobs on the node; a failed copy writes the reason into the
marker, so the waiting ranks fail with it instead of waiting out the timeout.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time

from hpcdl.data.format import MANIFEST, TMP_SUFFIX, sha256_file
from hpcdl.data.verify import check_dataset, load_manifest
from hpcdl.errors import DataError
from hpcdl.utils import atomic_write_text

log = logging.getLogger(__name__)
MARKER = ".hpcdl-staged"


def stage(root: str, dest: str, local_rank: int, timeout_s: float = 3600.0) -> str:
    """-> the staged dataset root (``dest/<name of root>``), once it is complete on this node."""
    target = os.path.join(dest, os.path.basename(os.path.normpath(root)))
    stamp = sha256_file(os.path.join(root, MANIFEST))
    if local_rank == 0:
        _copy(root, target, stamp)
    else:
        _wait(target, stamp, timeout_s)
    return target


def verdict(dataset_bytes: int, nodes: int, epochs: int = 0) -> str:
    """What staging costs the shared filesystem against the other paths, in bytes read from it: each node copies
    the whole dataset (``nodes`` x its size); direct reads take it once an epoch, the node cache
    (``data.cache=node``) once for the job. Said before the copy, so that a job that should not stage learns why."""
    d = dataset_bytes
    line = (f"stage: {nodes} node(s) each copy {_size(d)} from the shared filesystem, {_size(nodes * d)} in all; "
            f"data.cache=node would read it once")
    if not epochs:
        return line + " (give --epochs to weigh staging against direct reads)"
    line += f", direct reads at least {_size(epochs * d)} over {epochs} epochs (a client's readahead adds to it)"
    if nodes > 1 and nodes >= epochs:
        return (line + f": staging costs more than it saves here ({nodes} nodes >= {epochs} epochs); set "
                f"data.cache=node instead ('hpcdl plan --nodes {nodes}' times each path at the filesystem's bandwidth)")
    return line + f": staging saves {_size((epochs - nodes) * d)} of direct reads"


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _marker(target: str) -> str | None:
    try:
        with open(os.path.join(target, MARKER), encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _copy(root: str, target: str, stamp: str) -> None:
    if _marker(target) == stamp and not check_dataset(target, load_manifest(target)):
        log.info("stage: %s already holds this dataset", target)
        return
    os.makedirs(target, exist_ok=True)
    if os.path.exists(os.path.join(target, MARKER)):
        os.unlink(os.path.join(target, MARKER))
    manifest = load_manifest(root)
    t0, total = time.monotonic(), 0
    try:
        for entry in manifest.shards:
            _copy_verified(os.path.join(root, entry.file), os.path.join(target, entry.file), entry.sha256)
            total += entry.bytes
        shutil.copyfile(os.path.join(root, MANIFEST), os.path.join(target, MANIFEST))
    except (OSError, DataError) as exc:
        atomic_write_text(os.path.join(target, MARKER), f"failed: {exc}\n")
        raise DataError(f"stage to {target} failed: {exc}") from exc
    atomic_write_text(os.path.join(target, MARKER), stamp + "\n")
    dt = time.monotonic() - t0
    log.info("stage: copied %d shards, %.1f GB, to %s in %.0f s", len(manifest.shards), total / 1e9, target, dt)


def _copy_verified(src: str, dst: str, sha256: str, block: int = 8 << 20) -> None:
    tmp, h = f"{dst}.{os.getpid()}{TMP_SUFFIX}", hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(block):
                h.update(chunk)
                fout.write(chunk)
        if h.hexdigest() != sha256:
            raise DataError(f"{src}: sha256 differs from the manifest; run 'hpcdl verify --full' on the source")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _wait(target: str, stamp: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (mark := _marker(target)) != stamp:
        if mark and mark.startswith("failed:"):
            raise DataError(f"stage to {target}: local rank 0 {mark}")
        if time.monotonic() > deadline:
            raise DataError(f"stage to {target}: local rank 0 did not finish within {timeout_s:.0f} s; "
                            "is it alive, and does the disk have room?")
        time.sleep(0.2)
