"""oneCCL's C API (``libccl.so.2``: ``onecclAllReduce``...) from Python, and where the library comes from.

hpcdl looks for libccl in this order, and uses the first source that is present (a broken one is an
error, never a silent fallback to another library):

1. a path the user names: ``HPCDL_CCL_LIB`` (or ``loop.ccl_lib``), the library or its folder;
2. a cluster's oneAPI: ``CCL_ROOT``, as ``module load ccl`` or ``setvars.sh`` set it (``$CCL_ROOT/lib``);
3. the runtime ``hpcdl ccl install`` assembled (``HPCDL_CCL_HOME``, by default
   ``~/.cache/hpcdl/oneccl-2022.2.0``).

What the pinned runtime is and its assembly are :mod:`hpcdl.distributed.ccl.install`'s; a runtime found
there is checked against its pinned sha256 at every load (:func:`hpcdl.distributed.ccl.install.verify`).

The enums (data types, reduce ops) are read from the runtime's own ``oneapi/ccl/v2/types.h`` when it
has one; ``ENUMS`` holds 2022.2.0's, used for a library that comes without headers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from hpcdl.distributed.ccl import install
from hpcdl.errors import ConfigError

__all__ = ["ENUMS", "OneCCL", "OneCCLError", "Runtime", "describe", "enums", "find_runtime", "load"]

log = logging.getLogger(__name__)

# oneapi/ccl/v2/types.h of 2022.2.0: what a library without headers is assumed to use.
ENUMS = {"onecclSum": 0, "onecclProd": 1, "onecclMax": 2, "onecclMin": 3, "onecclAvg": 4,
         "onecclInt8": 0, "onecclUint8": 1, "onecclInt32": 2, "onecclUint32": 3, "onecclInt64": 4, "onecclUint64": 5,
         "onecclFloat16": 6, "onecclFloat32": 7, "onecclFloat64": 8, "onecclBfloat16": 9}
UNIQUE_ID_BYTES = 4096
FIX = ("run 'hpcdl ccl install' (hpcdl's pinned runtime, from PyPI), 'module load ccl' or source oneAPI's "
       "setvars.sh (CCL_ROOT), or set HPCDL_CCL_LIB to a libccl.so.2 of oneCCL 2021.17 or later")


@dataclasses.dataclass(frozen=True, slots=True)
class Runtime:
    """Which libccl to load: its path, and the source it came from (for logs and errors)."""

    library: Path
    source: str
    header: Path | None


def find_runtime(user_path: str | None = None, environ: Mapping[str, str] = os.environ) -> Runtime:
    """The first of the three sources that is present; a ConfigError that names all three when none is."""
    named = user_path or environ.get("HPCDL_CCL_LIB")
    if named:
        path = Path(named)
        library = path / "libccl.so.2" if path.is_dir() else path
        if not library.exists():
            raise ConfigError(f"oneCCL: {library} (named by {'loop.ccl_lib' if user_path else 'HPCDL_CCL_LIB'}) does "
                              f"not exist; name a libccl.so.2 or the folder that holds it, or unset it to use CCL_ROOT "
                              f"or hpcdl's runtime")
        return Runtime(library, f"named by {'loop.ccl_lib' if user_path else 'HPCDL_CCL_LIB'}", _header(library))
    if environ.get("CCL_ROOT"):
        lib = Path(environ["CCL_ROOT"]) / "lib"
        if not (lib / "libccl.so.2").exists():
            old = " (it has libccl.so.1: a oneCCL without the C API, older than 2021.17)" \
                if (lib / "libccl.so.1").exists() else ""
            raise ConfigError(f"oneCCL: CCL_ROOT={environ['CCL_ROOT']} has no lib/libccl.so.2{old}; load a newer "
                              "oneCCL module, or unset CCL_ROOT to use hpcdl's runtime ('hpcdl ccl install')")
        return Runtime(lib / "libccl.so.2", f"CCL_ROOT={environ['CCL_ROOT']}", _header(lib / "libccl.so.2"))
    root = install.home(environ)
    if not (root / "lib" / "libccl.so.2").exists():
        raise ConfigError(f"oneCCL: no runtime found: HPCDL_CCL_LIB is not set, CCL_ROOT is not set, and hpcdl's "
                          f"runtime {root} is not installed. To fix: {FIX}")
    install.verify(root)
    return Runtime(root / "lib" / "libccl.so.2", f"hpcdl's runtime {root}", root / "include/oneapi/ccl/v2/types.h")


def _header(library: Path) -> Path | None:
    header = library.resolve().parent.parent / "include/oneapi/ccl/v2/types.h"
    return header if header.exists() else None


def enums(header: Path | None) -> dict[str, int]:
    """The data-type and reduce-op values from ``oneapi/ccl/v2/types.h``; :data:`ENUMS` without one."""
    if header is None:
        return dict(ENUMS)
    found = {m[1]: int(m[2]) for m in re.finditer(r"\b(onecclSum|onecclProd|onecclMax|onecclMin|onecclAvg|onecclU?[Ii]nt"
                                                  r"(?:8|32|64)|onecclFloat(?:16|32|64)|onecclBfloat16)\s*=\s*(\d+)",
                                                  header.read_text())}
    missing = set(ENUMS) - set(found)
    if missing:
        raise ConfigError(f"oneCCL: {header} does not define {', '.join(sorted(missing))}; is it oneCCL's C API header?")
    return found


class OneCCLError(RuntimeError):
    """A oneCCL call returned an error code; the message carries oneCCL's own text."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("data", ctypes.c_char * UNIQUE_ID_BYTES)]


_COLLECTIVES = {  # name: argument types after (send, recv, count, dtype)
    "onecclAllReduce": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],  # op, comm, stream
    "onecclReduce": [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],  # op, root, comm, stream
    "onecclBroadcast": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],  # root, comm, stream
    "onecclAllGather": [ctypes.c_void_p, ctypes.c_void_p],  # comm, stream
    "onecclReduceScatter": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],  # op, comm, stream
}


class OneCCL:
    """libccl's C API through ctypes (which releases the GIL during each call).

    ``runner``, when set (by :mod:`hpcdl.distributed.ccl.group`: c_comm_thread's C thread), makes every call below on its
    thread: ``runner.call(address, *integers)`` a collective's, ``runner.run(fn)`` the rare ones made through
    ctypes. oneCCL then sees one thread make a communicator's calls, from its creation to its destruction.
    """

    runner = None

    def __init__(self, runtime: Runtime, libfabric: str | None = None):
        self.runtime = runtime
        _load_libfabric(libfabric or os.environ.get("HPCDL_LIBFABRIC") or "libfabric.so.1")
        try:
            lib = ctypes.CDLL(str(runtime.library))
        except OSError as exc:
            raise ConfigError(f"oneCCL: {runtime.library} ({runtime.source}) does not load: {exc}. To fix: {FIX}") from None
        missing = [n for n in ("onecclGetVersion", "onecclCommInitRank", *_COLLECTIVES) if not hasattr(lib, n)]
        if missing:
            raise ConfigError(f"oneCCL: {runtime.library} ({runtime.source}) has no {', '.join(missing)}: a oneCCL "
                              f"without the C API (libccl.so.1, or a release before 2021.17). To fix: {FIX}")
        self.lib = lib
        self._fns, self._addresses = {}, {}
        for name, tail in _COLLECTIVES.items():
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, *tail]
            self._fns[name.removeprefix("oneccl")] = getattr(lib, name)
            self._addresses[name.removeprefix("oneccl")] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        lib.onecclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, _UniqueId, ctypes.c_int]
        lib.onecclGetErrorString.restype = ctypes.c_char_p
        lib.onecclGetLastError.restype = ctypes.c_char_p
        lib.onecclGetLastError.argtypes = [ctypes.c_void_p]
        lib.onecclCommDestroy.argtypes = [ctypes.c_void_p]
        self.enums = enums(runtime.header)
        version = ctypes.c_int()
        self._check(lib.onecclGetVersion(ctypes.byref(version)), None, "GetVersion")
        self.version = f"{version.value // 10000}.{version.value // 100 % 100}.{version.value % 100}"

    def _check(self, rc: int, comm, what: str) -> None:
        if rc:
            last = self.lib.onecclGetLastError(comm).decode(errors="replace").strip() if comm is not None else ""
            raise OneCCLError(f"onecclResult {rc} ({self.lib.onecclGetErrorString(rc).decode(errors='replace')})"
                              + (f": {last}" if last else "") + f" in oneccl{what}")

    def run(self, fn):
        """``fn()`` on the thread that makes oneCCL's calls (the runner's, else this one)."""
        return fn() if self.runner is None else self.runner.run(fn)

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self.run(lambda: self.lib.onecclGetUniqueId(ctypes.byref(uid))), None, "GetUniqueId")
        return bytes(uid.data)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        comm, key = ctypes.c_void_p(), _UniqueId()
        ctypes.memmove(ctypes.byref(key), uid, UNIQUE_ID_BYTES)
        self._check(self.run(lambda: self.lib.onecclCommInitRank(ctypes.byref(comm), nranks, key, rank)), None,
                    "CommInitRank")
        return comm

    def destroy(self, comm) -> None:
        self._check(self.run(lambda: self.lib.onecclCommDestroy(comm)), None, "CommDestroy")

    def call(self, name: str, comm, *args: int) -> None:
        """``oneccl<name>(*args, comm, NULL)``: blocking on host buffers; raises :class:`OneCCLError`."""
        if self.runner is None:
            rc = self._fns[name](*args, comm, None)
        else:
            rc = self.runner.call(self._addresses[name], *args, comm.value, 0)
        if rc:
            self._check(rc, comm, name)

    def call_here(self, name: str, comm, *args: int) -> None:
        """:meth:`call` on this thread, whatever the runner: for a caller already on the runner's thread."""
        rc = self._fns[name](*args, comm, None)
        if rc:
            self._check(rc, comm, name)


def _load_libfabric(name: str) -> None:
    """Load libfabric first (``RTLD_GLOBAL``), so that its absence is named and oneCCL uses this one."""
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ConfigError(f"oneCCL needs libfabric, its transport library: {name} does not load ({exc}). Install "
                          "Debian's libfabric1 (apt-get install libfabric1; make venv does it as root), 'module load "
                          "libfabric' on a cluster, or set HPCDL_LIBFABRIC to the site's libfabric.so.1") from None


_LOADED: OneCCL | None = None


def load(user_path: str | None = None) -> OneCCL:
    """The process's oneCCL, loaded once: a process cannot hold two libccl. Without ``user_path``, the one
    already loaded (a group created after ``init_distributed(ccl_lib=...)`` uses that library)."""
    global _LOADED
    if _LOADED is not None and user_path is None:
        return _LOADED
    runtime = find_runtime(user_path)
    if _LOADED is None:
        _LOADED = OneCCL(runtime)
        log.info("oneCCL %s from %s (%s)", _LOADED.version, _LOADED.runtime.library, _LOADED.runtime.source)
    elif _LOADED.runtime.library.resolve() != runtime.library.resolve():
        raise ConfigError(f"oneCCL: this process loaded {_LOADED.runtime.library} already; it cannot also load "
                          f"{runtime.library} ({runtime.source})")
    return _LOADED


def describe(user_path: str | None = None) -> str:
    """The oneCCL backend's check (:data:`hpcdl.distributed.backend.BACKENDS`): the library loaded and where it came
    from, for the log; a ConfigError saying how to fix it when it cannot load."""
    ccl = load(user_path)
    return f"oneCCL {ccl.version} from {ccl.runtime.library} ({ccl.runtime.source})"
