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
on a login node for compute nodes that share the home folder and have no compiler. The ranks' loaders call
:func:`ensure`: the built library (found without a lock: thousands of ranks start on a shared home), or the failure
recorded for it, or, when there is neither, a build now (one process of a node builds, under a lock; the others then
find its result).

A library is published whole and never taken back (:mod:`hpcdl.distributed.native.cache`, with the lock): built
under a name of its own (a temporary file; for the C++ extension, a staging folder ``ccl_backend/.build-*``), then
hard-linked to its final path, which keeps a file already there. Nothing unlinks or replaces a published library: on
NFSv3 that kills the ranks of other nodes that have it mapped. So one that is there and does not load here (what the
key does not tell apart: a compute node's older libstdc++) is kept, and ``hpcdl ccl install`` names the key's folder
to remove by hand once no running job uses it; one whose load check does not finish is kept as not known. (A new
file name per build would free the name, but the loaders would choose among files, and the soname is one.)

Every wait is bounded: the C compile by ``C_TIMEOUT_S``, the C++ child by ``CXX_TIMEOUT_S``, a wait for the lock by
the build it waits for. Each compile runs in a process group of its own, ended whole at its timeout or when the
process that started it dies (:data:`DIE_WITH_PARENT`): no compile outlives its build.

One key's files (:func:`key`, :func:`key_parts`) sit in one folder, ``~/.cache/hpcdl/native/KEY/``: a home shared by
nodes of another architecture, torch build, glibc or Python never loads a library built for another. Beside the two
libraries, ``PIECE.failed.json`` records a piece that failed to build (the piece, why, the key's parts, the host and
the time; written atomically): no rank of any job tries it again, each process says once why the piece is not used,
and ``hpcdl ccl install`` retries. What another try may mend is not recorded: a timeout, a compile killed by a
signal, a full disk or quota (ENOSPC, EDQUOT), a lock held past the wait; it is "not built this time (transient)".

The link: ``ccl_backend.cpp`` calls the C thread's ``fc_submit_if_idle``, ``fc_wait`` and ``fc_done``. The C++
extension is linked against the C library (its path on the link line, its folder as rpath; found by its soname), so a
process maps that library once, whichever loader comes first: one queue, one thread. Compiled into the extension, it
would be a second copy beside the one ctypes binds (which must work alone: a torch without ``PyBackend.hpp``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from hpcdl.distributed.native import cache
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
C_TIMEOUT_S = 120  # the C compile: 0.2 s on an idle node
CXX_TIMEOUT_S = 900  # the C++ child: 25 s to 2 min on the 2-core VM, more on a busy login node
TIMEOUT_S = {"c_comm_thread": C_TIMEOUT_S, "ccl_backend": CXX_TIMEOUT_S}  # each piece's build, and a wait for it
IMPORT_TIMEOUT_S = 300
FULL = ("EDQUOT", "ENOSPC", "No space left", "Disk quota exceeded")  # a compile's words that another try may mend
# First in the C++ child (argv[-1]: its parent's pid): SIGTERM when the parent dies (Linux), passed on to the child's
# process group (its own), where ninja stops its compilers: SIGKILL to the child alone would leave ninja compiling.
DIE_WITH_PARENT = """
import ctypes, os, signal, sys
if sys.platform == "linux" and os.getpgid(0) == os.getpid():
    signal.signal(signal.SIGTERM, lambda *_: (signal.signal(signal.SIGTERM, signal.SIG_DFL), os.killpg(0, 15)))
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[-1]):  # the parent died before prctl
        os.killpg(0, signal.SIGTERM)
"""
# The child that builds the C++ extension (argv[1]: cpp_extension.load's arguments, as JSON); on failure, the
# exception's words (for a compile: ninja's output, the compiler's error in it).
CXX_BUILD = DIE_WITH_PARENT + """
import json, logging
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


class Transient(BuildError):
    """A build that another try may mend (a timeout, a signal, a full disk, a lock held past the wait): not recorded."""


@dataclasses.dataclass(frozen=True, slots=True)
class Built:
    """A piece's library (``path``), or why there is none (``why``; ``record``: the file that says so; ``transient``:
    not recorded, the next process tries again). With a ``path``, ``why`` is what is known against it."""

    piece: str
    path: Path | None
    why: str = ""
    record: Path | None = None
    transient: bool = False

    def describe(self) -> str:
        if self.path is not None:
            return f"built: {self.path}" + (f" ({self.why})" if self.why else "")
        if self.transient:
            return f"not built this time (transient): {self.why}"
        return f"not built: {self.why}" + (f"; recorded in {self.record}" if self.record else "")

    def retry(self) -> str:
        return "not recorded: the next process that needs it builds it" if self.transient else RETRY


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
    return cache_dir(environ).absolute() / "native" / key()  # absolute: the compiles run in folders of their own


def artifact(piece: str, environ: Mapping[str, str] = os.environ) -> Path:
    if piece == "c_comm_thread":
        return folder(environ) / C_LIBRARY
    return folder(environ) / "ccl_backend" / f"{_extension_name()}.so"


def record_path(piece: str, environ: Mapping[str, str] = os.environ) -> Path:
    return folder(environ) / f"{piece}.failed.json"


def rebuild_advice(environ: Mapping[str, str] = os.environ) -> str:
    """What a loader says of a built library that does not load here: removing it is left to a person (see above)."""
    return (f"to build it again: remove {folder(environ)} once no running job uses it, then run hpcdl ccl install on "
            f"this node (or let the next rank build it)")


def ensure(piece: str, environ: Mapping[str, str] = os.environ) -> Built:
    """For a rank's loader: the built library, or the failure recorded for it (never tried again here), or a build
    now when neither is there (a failure is then recorded, unless it is transient)."""
    try:
        found = _found(piece, environ)  # no lock: a library is only ever linked into place whole
        if found is not None:
            return found
        with cache.locked(folder(environ), TIMEOUT_S[piece]):  # the node's other ranks wait, then find its result
            return _found(piece, environ) or _build(piece, environ)
    except cache.Busy as exc:
        return Built(piece, None, str(exc), transient=True)
    except OSError as exc:  # a cache that cannot be read or written (EACCES, ESTALE): nothing to record it in
        return Built(piece, None, f"cannot build into {folder(environ)}: {exc}")


def build(environ: Mapping[str, str] = os.environ, pieces: tuple[str, ...] = PIECES) -> list[Built]:
    """Build ``pieces`` now (``hpcdl ccl install``, ``make venv``): a recorded failure is removed and the build tried
    again (recorded again if it fails); a library already there is kept, and checked that it loads here (never
    removed: see the module's docstring). Starts nothing."""
    try:
        with cache.locked(folder(environ), sum(TIMEOUT_S[p] for p in pieces)):
            out = []
            for piece in pieces:
                record_path(piece, environ).unlink(missing_ok=True)
                out.append(_checked(piece, environ) or _build(piece, environ))
            return out
    except cache.Busy as exc:
        return [Built(piece, None, str(exc), transient=True) for piece in pieces]


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


def _checked(piece: str, environ) -> Built | None:
    """``piece``'s library if it is there, kept whether it loads here or not (said which); None if it is not."""
    target = artifact(piece, environ)
    if not target.exists():
        return None
    try:
        why = _load_error(piece, target, environ)
    except subprocess.TimeoutExpired:
        why = f"its load check did not finish within {IMPORT_TIMEOUT_S} s: whether it loads here is not known; kept"
    else:
        if why is None:
            return Built(piece, target)
        why = (f"it does not load here ({why}); kept: ranks of another node may have it mapped; to build it again, "
               f"remove {folder(environ)} by hand once no running job uses it, then run hpcdl ccl install")
    log.warning("%s: %s: %s", piece, target, why)
    return Built(piece, target, why)


def _load_error(piece: str, target: Path, environ) -> str | None:
    """Why ``target`` does not load: the C library in this process (loading it starts nothing), the C++ extension in
    a child (an import cannot be undone); None when it loads. TimeoutExpired: not known."""
    if piece == "c_comm_thread":
        try:
            ctypes.CDLL(str(target))
        except OSError as exc:
            return str(exc)
        return None
    run = _run([sys.executable, "-c", CXX_IMPORT, target.stem, str(target)], IMPORT_TIMEOUT_S, environ, target.parent)
    return None if run.returncode == 0 else (run.stderr.strip().splitlines() or [f"status {run.returncode}"])[-1][:300]


def _build(piece: str, environ) -> Built:
    """Build ``piece`` (the caller holds the lock); record a failure, unless it is transient."""
    log.info("building %s from %s into %s", piece, SOURCES[piece], folder(environ))
    try:
        path = _compile_c(environ) if piece == "c_comm_thread" else _compile_cxx(environ)
    except Transient as exc:
        log.info("%s: not built this time (transient): %s", piece, exc)
        return Built(piece, None, str(exc), transient=True)
    except BuildError as exc:
        record = record_path(piece, environ)
        facts = {"piece": piece, "why": str(exc), "key": key_parts(), "host": socket.gethostname(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "retry": "hpcdl ccl install"}
        atomic_write_text(str(record), json.dumps(facts, indent=1) + "\n")
        return Built(piece, None, str(exc), record)
    return Built(piece, path)


def _compile_c(environ) -> Path:
    source, target = SOURCES["c_comm_thread"], artifact("c_comm_thread", environ)
    env = _child_environ(environ)  # as the C++ child sees it; $CC may be words ("ccache gcc")
    try:
        compiler = shlex.split(env.get("CC") or "") or [shutil.which("cc", path=env.get("PATH")) or
                                                         shutil.which("gcc", path=env.get("PATH")) or ""]
    except ValueError as exc:
        raise BuildError(f"$CC ({env['CC']!r}) does not parse: {exc}") from None
    if not compiler[0]:
        raise BuildError(f"no C compiler (cc, gcc or $CC) to build {source}")
    said = " ".join(compiler)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        run = _run([*compiler, *C_FLAGS, "-o", tmp, str(source)], C_TIMEOUT_S, environ, target.parent)
        if run.returncode != 0:
            raise _failure(f"{said} could not build {source}", run)
        cache.publish(Path(tmp), target)
    except subprocess.TimeoutExpired:
        raise Transient(f"{said} did not build {source} within {C_TIMEOUT_S} s") from None
    except OSError as exc:  # $CC names no program, a full disk
        raise _os_failure(f"{said} could not build {source}", exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # its own name: once linked, the library lives on under the final one
    return target


def _compile_cxx(environ) -> Path:
    c_thread = _found("c_comm_thread", environ) or _build("c_comm_thread", environ)
    if (c_library := c_thread.path) is None:
        failed = Transient if c_thread.transient else BuildError
        raise failed(f"it links to c_comm_thread, which is not built: {c_thread.why}")
    if not PY_BACKEND_HEADER.exists():
        raise BuildError(f"torch {torch.__version__} has no c10d/py/PyBackend.hpp (torch 2.14 and later ship it)")
    target = artifact("ccl_backend", environ)
    target.parent.mkdir(parents=True, exist_ok=True)
    cache.remove_leftovers([*target.parent.glob(".build-*"), *folder(environ).glob(f".{C_LIBRARY}.*")])
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))  # this build's own folder
    args = {"name": target.stem, "sources": [str(SOURCES["ccl_backend"])], "build_directory": str(staging),
            "extra_cflags": list(CXX_FLAGS), "extra_ldflags": [str(c_library), f"-Wl,-rpath,{c_library.parent}"]}
    try:
        run = _run([sys.executable, "-c", CXX_BUILD, json.dumps(args), str(os.getpid())], CXX_TIMEOUT_S, environ,
                   staging)  # there, not in the rank's folder, where a torch/ or json.py would shadow the modules
        if run.returncode != 0:
            raise _failure(f"could not build {target.name}", run)
        cache.publish(staging / target.name, target)
    except subprocess.TimeoutExpired:
        raise Transient(f"the C++ build of {target.name} did not finish within {CXX_TIMEOUT_S} s") from None
    except OSError as exc:  # no Python to run, a module that was not written, a cache that cannot be written
        raise _os_failure(f"could not build {target}", exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # the staging names only: a linked library lives on
    return target


def _failure(what: str, run: subprocess.CompletedProcess) -> BuildError:
    """A compile's error: the compiler's first line that names one, and the output's last 800 characters; Transient
    for a compile killed by a signal or one that found the disk or quota full."""
    text = f"{run.stdout.strip()}\n{run.stderr.strip()}".strip()
    if run.returncode < 0:
        return Transient(f"{what}: its process was killed by signal {-run.returncode}")
    lines = text.splitlines()
    first = next((ln for ln in lines if "error:" in ln), None) or next((ln for ln in lines if "Error" in ln), "")
    tail = text[-800:] or f"its process exited with status {run.returncode}"
    why = f"{what}: " + (f"{first.strip()[:300]} ... " if first and first not in tail else "") + tail
    return Transient(why) if any(word in text for word in FULL) else BuildError(why)


def _os_failure(what: str, exc: OSError) -> BuildError:
    return (Transient if exc.errno in (errno.ENOSPC, errno.EDQUOT) else BuildError)(f"{what}: {exc}")


def _run(argv: list[str], timeout_s: float, environ, cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run in ``cwd``, in a process group of its own that is ended whole (the compilers it started with it)
    past ``timeout_s`` (then TimeoutExpired) or when the caller is interrupted: no compile outlives its build."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          cwd=cwd, env=_child_environ(environ), start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)  # ninja, in it, stops the compilers it started in their groups
                time.sleep(1)
                os.killpg(child.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _child_environ(environ) -> dict[str, str]:
    return {**os.environ, **environ}


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
        after = built.retry() if built.transient else f"and no rank retries the build ({RETRY})"
        print(f"{built.piece}: {built.describe()}" + ("" if built.path else f"; not used: oneCCL goes through "
                                                      f"Python, {after}"))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
