"""How the native pieces' files enter the shared cache (for :mod:`hpcdl.distributed.native.build`): one builder at a
time, under a lock waited for within a deadline; each library published whole, never taken back; and what killed
builds left removed once it is old.

- **The lock** is ``.lock`` in the key's folder. Where the cache's filesystem does not lock (Lustre mounted without
  ``flock``, NFS without lockd: ENOSYS, ENOLCK, EOPNOTSUPP), it is a lock of this node instead,
  ``hpcdl-native-UID-KEY.lock`` in the temporary folder: one builder per node still. It is polled, not waited for
  blindly: past the deadline (as long as the build it waits for may take), :class:`Busy`.
- **Publishing.** A library is written under a name of its own beside its final path (a temporary file, a staging
  folder), then hard-linked to that path (``os.link``), which fails where a file is there already: that one is whole
  (a builder on another node, whose lock is not this one's, linked it first) and is used. Nothing published is ever
  unlinked or replaced: on NFSv3 a rename onto a file, or its unlink, by one client deletes its inode on the server,
  and ranks of other nodes that have the library mapped then die of SIGBUS (ESTALE). Unlinking the builder's own
  temporary name afterwards leaves the inode to the final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Busy", "locked", "publish", "remove_leftovers"]

NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})  # a filesystem without flock
LEFTOVER_S = 3600  # a staging folder or temporary file this old was left by a killed build (each build is bounded)
log = logging.getLogger(__name__)


class Busy(Exception):
    """Another process held the build lock past the deadline."""


@contextlib.contextmanager
def locked(where: Path, wait_s: float) -> Iterator[None]:
    """The build lock of the key's folder ``where``: its ``.lock``, or this node's where its filesystem does not lock;
    :class:`Busy` when it is not had within ``wait_s``."""
    where.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with contextlib.ExitStack() as held:
        lock = held.enter_context(open(where / ".lock", "a"))
        unsupported = _flock(lock, deadline, f"{where.name} for {wait_s:.0f} s")
        if unsupported is not None:
            local = Path(tempfile.gettempdir()) / f"hpcdl-native-{os.getuid()}-{where.name}.lock"
            log.info("the cache's filesystem does not lock; locked on this node instead (%s: %s; %s)", lock.name,
                     unsupported.strerror, local)
            _flock(held.enter_context(open(local, "a")), deadline, f"{where.name} for {wait_s:.0f} s")
        yield


def _flock(lock, deadline: float, what: str) -> OSError | None:
    """Lock ``lock``, polling until ``deadline``; the error where its filesystem does not lock, None once locked."""
    pause = 0.05
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:  # another process builds
            if time.monotonic() >= deadline:
                raise Busy(f"another process has been building {what}; not used this time") from None
            time.sleep(max(min(pause, deadline - time.monotonic()), 0))
            pause = min(pause * 2, 2.0)  # thousands of ranks may poll one NFS lock
        except OSError as exc:
            if exc.errno in NO_LOCKS:
                return exc
            raise


def publish(tmp: Path, target: Path) -> None:
    """``tmp``, whole, at ``target`` too (a hard link), readable by everyone who shares the cache; where a file is at
    ``target`` already, it is kept. The caller then removes ``tmp``, its own name."""
    os.chmod(tmp, 0o755)  # mkstemp's 0600: others sharing an XDG_CACHE_HOME could not dlopen it
    try:
        os.link(tmp, target)
    except FileExistsError:
        log.info("%s was published by another build meanwhile; that one is used", target)


def remove_leftovers(paths: list[Path]) -> None:
    """Remove ``paths`` (staging folders, temporary files) that are ``LEFTOVER_S`` old: a build still running is
    younger, and none of them is published."""
    cutoff = time.time() - LEFTOVER_S
    for path in paths:
        with contextlib.suppress(OSError):
            if path.lstat().st_mtime < cutoff:
                log.info("removing %s, left by a build that was killed", path)
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
