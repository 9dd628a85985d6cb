"""The one build of hpcdl's native pieces, from their sources in this folder into the user's cache. It compiles and
starts nothing: no thread, no communicator.

- ``c_comm_thread``: ``c_comm_thread.c`` with the C compiler (``$CC``, ``cc`` or ``gcc``; 0.2 s) into
  ``libhpcdl_c_comm_thread.so``, bound with ctypes by :mod:`hpcdl.distributed.native.c_comm_thread`;
- ``ccl_backend``: ``ccl_backend.cpp`` with torch's cpp_extension (``$CXX`` or ``c++``, ninja, and torch's
  ``c10d/py/PyBackend.hpp``, shipped since torch 2.14; 25 s to 2 min), imported by
  :mod:`hpcdl.distributed.native.ccl_backend`. cpp_extension imports what it built, and an import cannot be undone
  (a second import of the module from another path fails), so it runs in a child process, whose import of the new
  module is also the check that it loads.

``hpcdl ccl install`` (which ``make venv`` runs) and ``python -m hpcdl.distributed.native.build`` call :func:`build`,
on a login node for compute nodes that share the home folder and have no compiler; it tries again a build whose
failure was recorded, and builds again a library that is there but does not load (removed first). The ranks' loaders
call :func:`ensure`: the built library, or the failure recorded for it, or, when there is neither, a build now (one
process of a node builds, under a lock; the others then find its result). A library already there is found without a
lock: thousands of ranks start on a shared home.

Each library is written whole into its final path: the C library is compiled into a temporary file beside it, the C++
extension into a temporary folder of its own, and the finished file is renamed into place (``os.replace``), so a
reader sees no file or the whole one, never one that the linker is still writing. The lock is ``.lock`` in the key's
folder; where the cache's filesystem does not lock (Lustre mounted without ``flock``, NFS without lockd: ENOSYS,
ENOLCK, EOPNOTSUPP), a lock of this node instead, ``hpcdl-native-UID-KEY.lock`` in the temporary folder: one builder
per node still, and builders on several nodes each write their own temporary file and rename a whole one.

The cache key (:func:`key`) is both sources' sha256, the flags below, torch's version, its build
(``torch.version.git_version``) and its C++ ABI (``torch.compiled_with_cxx11_abi()``), the C library
(``platform.libc_ver()``), Python's extension suffix (implementation, version, ABI) and the machine
(``platform.machine()``): a home shared by nodes of another architecture, torch build, glibc or Python never loads a
library built for another. One key's files sit in one folder, ``~/.cache/hpcdl/native/KEY/``: the two libraries, and
``PIECE.failed.json`` for a piece that failed to build (the piece, why, the key's parts, the host and the time;
written atomically). A recorded failure is not tried again by any rank of any job: each process says once why the
piece is not used, and ``hpcdl ccl install`` retries.

The link: ``ccl_backend.cpp`` calls the C thread's ``fc_submit_if_idle``, ``fc_wait`` and ``fc_done``. The C library
has a soname, and the C++ extension is linked against it (its path on the link line, its folder as rpath), so the
extension names it as a dependency: the dynamic loader maps it with the extension, or finds it mapped already by
c_comm_thread's loader (by soname), whichever comes first, and one process holds one copy (one queue, one thread).
Compiling ``c_comm_thread.c`` into the extension instead would make two copies where both are loaded (ctypes binds
the C library on its own, and must: the C thread serves without the C++ part, on a torch without ``PyBackend.hpp`` or
a node without ninja), so the extension links to the one library.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from hpcdl.utils import atomic_write_text, cache_dir

__all__ = ["PIECES", "Built", "build", "ensure", "folder", "key", "main", "rebuild_advice"]

HERE = Path(__file__).parent
SOURCES = {"c_comm_thread": HERE / "c_comm_thread.c", "ccl_backend": HERE / "ccl_backend.cpp"}
PIECES = tuple(SOURCES)  # in build order: ccl_backend links to c_comm_thread
C_LIBRARY = "libhpcdl_c_comm_thread.so"  # its file name and soname
C_FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", f"-Wl,-soname,{C_LIBRARY}")
CXX_FLAGS = ("-O2",)
PY_BACKEND_HEADER = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/py/PyBackend.hpp"
RETRY = "to retry the build: hpcdl ccl install"
NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})  # a filesystem without flock
IMPORT_TIMEOUT_S = 300
# The child that builds the C++ extension (argv[1]: cpp_extension.load's arguments, as JSON); on failure, its last
# line of output is why.
CXX_BUILD = """
import json, logging, sys
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found" on a CPU node
try:
    from torch.utils import cpp_extension
    cpp_extension.load(with_cuda=False, verbose=False, **json.loads(sys.argv[1]))
except Exception as exc:  # no compiler or ninja, the compiler's error, an import that fails: several kinds
    print()
    print(str(exc).strip() or type(exc).__name__)
    sys.exit(1)
"""
# The child that imports a built C++ extension (argv[1]: its module name, argv[2]: its path) and nothing else.
CXX_IMPORT = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""
log = logging.getLogger(__name__)


class BuildError(Exception):
    """A piece could not be built: no compiler, the compiler's own error, a missing header."""


@dataclasses.dataclass(frozen=True, slots=True)
class Built:
    """A piece's library (``path``), or why there is none (``why``; ``record``: the file that says so)."""

    piece: str
    path: Path | None
    why: str = ""
    record: Path | None = None

    def describe(self) -> str:
        if self.path is not None:
            return f"built: {self.path}"
        return f"not built: {self.why}" + (f"; recorded in {self.record}" if self.record else "")


@functools.cache
def key_parts() -> dict[str, str]:
    """What a built library depends on: the sources' sha256, the flags, torch (its version, build and C++ ABI), the C
    library, Python and the machine."""
    sources = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in SOURCES.values()))
    return {"sources": sources.hexdigest(), "flags": " ".join((*C_FLAGS, "|", *CXX_FLAGS)),
            "torch": str(torch.__version__), "torch_build": str(torch.version.git_version),
            "cxx11_abi": str(torch.compiled_with_cxx11_abi()), "libc": " ".join(platform.libc_ver()),
            "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.version, "machine": platform.machine()}


@functools.cache
def key() -> str:
    """The cache key: readable parts, and a hash of all of them (:func:`key_parts`)."""
    parts = key_parts()
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    return f"{parts['machine']}-torch{parts['torch']}-{sys.implementation.cache_tag}-{digest}"


def folder(environ: Mapping[str, str] = os.environ) -> Path:
    """This key's folder: both libraries, and the record of a failed build."""
    return cache_dir(environ) / "native" / key()


def artifact(piece: str, environ: Mapping[str, str] = os.environ) -> Path:
    if piece == "c_comm_thread":
        return folder(environ) / C_LIBRARY
    return folder(environ) / "ccl_backend" / f"{_extension_name()}.so"


def record_path(piece: str, environ: Mapping[str, str] = os.environ) -> Path:
    return folder(environ) / f"{piece}.failed.json"


def rebuild_advice(environ: Mapping[str, str] = os.environ) -> str:
    """What a loader says of a built library that does not load here."""
    return (f"to build it again: hpcdl ccl install on this node (it builds again a library that does not load), or "
            f"remove {folder(environ)} (the next rank builds it)")


def ensure(piece: str, environ: Mapping[str, str] = os.environ) -> Built:
    """For a rank's loader: the built library, or the failure recorded for it (never tried again here), or a build
    now when neither is there (a failure is then recorded)."""
    found = _found(piece, environ)  # no lock: a library is only ever renamed into place whole
    if found is not None:
        return found
    try:
        with _locked(environ):  # the node's other ranks wait, then find what this one built or recorded
            return _found(piece, environ) or _build(piece, environ)
    except OSError as exc:  # a cache that cannot be written: nothing to record it in
        return Built(piece, None, f"cannot build into {folder(environ)}: {exc}")


def build(environ: Mapping[str, str] = os.environ, pieces: tuple[str, ...] = PIECES) -> list[Built]:
    """Build ``pieces`` now (``hpcdl ccl install``, ``make venv``): a library already built is kept if it loads here
    and built again if not, a recorded failure is removed and the build tried again (and recorded again if it
    fails). Starts nothing."""
    with _locked(environ):
        out = []
        for piece in pieces:
            record_path(piece, environ).unlink(missing_ok=True)
            _remove_if_unloadable(piece, environ)
            out.append(_found(piece, environ) or _build(piece, environ))
        return out


def _found(piece: str, environ) -> Built | None:
    target, record = artifact(piece, environ), record_path(piece, environ)
    if target.exists():
        return Built(piece, target)
    if record.exists():
        return Built(piece, None, _recorded_why(record), record)
    return None


def _recorded_why(record: Path) -> str:
    try:
        data = json.loads(record.read_text())
        return f"{data['why']} (on {data['host']} at {data['time']})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"a failed build's record that does not read ({exc})"


@contextlib.contextmanager
def _locked(environ):
    """The key's build lock: ``.lock`` in its folder, or this node's where the cache's filesystem does not lock."""
    where = folder(environ)
    where.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        lock = held.enter_context(open(where / ".lock", "a"))
        unsupported = _flock(lock)
        if unsupported is not None:
            local = Path(tempfile.gettempdir()) / f"hpcdl-native-{os.getuid()}-{where.name}.lock"
            log.info("the cache's filesystem does not lock; locked on this node instead (%s: %s; %s)", lock.name,
                     unsupported.strerror, local)
            fcntl.flock(held.enter_context(open(local, "a")), fcntl.LOCK_EX)
        yield


def _flock(lock) -> OSError | None:
    """Lock ``lock`` (waiting for it); the error where its filesystem does not lock, None once locked."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno in NO_LOCKS:
            return exc
        raise
    return None


def _remove_if_unloadable(piece: str, environ) -> None:
    """Remove ``piece``'s library if it is there and does not load in this process's environment (another glibc or
    libstdc++, another torch's C++ ABI): :func:`build` then builds it again."""
    target = artifact(piece, environ)
    why = _load_error(piece, target, environ) if target.exists() else None
    if why is not None:
        log.warning("%s: %s does not load (%s); building it again", piece, target, why)
        target.unlink(missing_ok=True)


def _load_error(piece: str, target: Path, environ) -> str | None:
    """Why ``target`` does not load: the C library in this process (loading it starts nothing), the C++ extension in
    a child (an import cannot be undone); None when it loads."""
    if piece == "c_comm_thread":
        try:
            ctypes.CDLL(str(target))
        except OSError as exc:
            return str(exc)
        return None
    try:
        run = subprocess.run([sys.executable, "-c", CXX_IMPORT, target.stem, str(target)], capture_output=True,
                             text=True, env=_child_environ(environ), timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"its import did not finish within {IMPORT_TIMEOUT_S} s"
    return None if run.returncode == 0 else _last_line(run.stderr, run.returncode)


def _build(piece: str, environ) -> Built:
    """Build ``piece`` (the caller holds the lock); record a failure."""
    log.info("building %s from %s into %s", piece, SOURCES[piece], folder(environ))
    try:
        path = _compile_c(environ) if piece == "c_comm_thread" else _compile_cxx(environ)
    except BuildError as exc:
        record = record_path(piece, environ)
        facts = {"piece": piece, "why": str(exc), "key": key_parts(), "host": socket.gethostname(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "retry": "hpcdl ccl install"}
        atomic_write_text(str(record), json.dumps(facts, indent=1) + "\n")
        return Built(piece, None, str(exc), record)
    return Built(piece, path)


def _compile_c(environ) -> Path:
    source, target = SOURCES["c_comm_thread"], artifact("c_comm_thread", environ)
    path = environ.get("PATH")
    compiler = environ.get("CC") or shutil.which("cc", path=path) or shutil.which("gcc", path=path)
    if not compiler:
        raise BuildError(f"no C compiler (cc, gcc or $CC) to build {source}")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *C_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True)
        if run.returncode != 0:
            raise BuildError(f"{compiler} could not build {source}: {(run.stderr or run.stdout).strip()[-800:]}")
        os.replace(tmp, target)  # whole, or not there
    except OSError as exc:  # $CC names no program
        raise BuildError(f"{compiler} could not build {source}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile_cxx(environ) -> Path:
    c_thread = _found("c_comm_thread", environ) or _build("c_comm_thread", environ)
    if c_thread.path is None:
        raise BuildError(f"it links to c_comm_thread, which is not built: {c_thread.why}")
    if not PY_BACKEND_HEADER.exists():
        raise BuildError(f"torch {torch.__version__} has no c10d/py/PyBackend.hpp (torch 2.14 and later ship it)")
    target = artifact("ccl_backend", environ)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))  # this build's own folder
    args = {"name": target.stem, "sources": [str(SOURCES["ccl_backend"])], "build_directory": str(staging),
            "extra_cflags": list(CXX_FLAGS),
            "extra_ldflags": [str(c_thread.path), f"-Wl,-rpath,{c_thread.path.parent}"]}
    try:
        run = subprocess.run([sys.executable, "-c", CXX_BUILD, json.dumps(args)], capture_output=True, text=True,
                             env=_child_environ(environ))
        if run.returncode != 0:
            raise BuildError(_last_line(run.stdout.strip() or run.stderr, run.returncode))
        os.replace(staging / target.name, target)  # whole, or not there: a rank may be looking for it now
    except OSError as exc:  # no Python to run, a module that was not written, a cache that cannot be written
        raise BuildError(f"could not build {target}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _child_environ(environ) -> dict[str, str]:
    return {**os.environ, **environ}


def _last_line(text: str, returncode: int) -> str:
    text = text.strip()
    return text.splitlines()[-1][:300] if text else f"its process exited with status {returncode}"


def _extension_name() -> str:
    return f"hpcdl_ccl_backend_{key()[-12:]}"


def main() -> int:
    """``python -m hpcdl.distributed.native.build``: build both pieces, say what was built or why not. Exits 0 either
    way: the oneCCL group works without them."""
    try:
        results = build()
    except OSError as exc:  # the cache cannot be written
        print(f"{', '.join(PIECES)}: not built: cannot write {folder()}: {exc}")
        return 0
    for built in results:
        print(f"{built.piece}: {built.describe()}" + ("" if built.path else "; not used: oneCCL goes through Python, "
                                                      f"and no rank retries the build ({RETRY})"))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
