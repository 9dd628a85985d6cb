"""Small helpers shared across hpcdl: atomic writes, byte sizes, durations."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import re
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

from hpcdl.errors import ConfigError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def atomic_write_text(path: str, text: str, mode: int = 0o644) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def cache_dir(environ=os.environ) -> Path:
    """hpcdl's folder in the user's cache: ``$XDG_CACHE_HOME/hpcdl`` (``~/.cache/hpcdl``)."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"


def parse_bytes(text: str, what: str) -> int:
    """``4``, ``64K``, ``256MB``, ``1GiB`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; write e.g. 4, 64K, 256M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}B"
    return f"{n}B"


def parse_duration(text: str, what: str) -> timedelta:
    """Slurm's time forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; plus ``30s``."""
    text = str(text).strip()
    if m := re.fullmatch(r"(\d+)s", text):
        return timedelta(seconds=int(m.group(1)))
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        raise ConfigError(f"{what} {text!r} is not a time; write MM, HH:MM:SS, D-HH:MM:SS or 30s")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return timedelta(days=days, hours=a, minutes=b or 0, seconds=c or 0)
    if c is not None:
        return timedelta(hours=a, minutes=b, seconds=c)
    if b is not None:
        return timedelta(minutes=a, seconds=b)
    return timedelta(minutes=a)


def format_duration(td: timedelta) -> str:
    """-> Slurm's ``D-HH:MM:SS`` (``HH:MM:SS`` under a day)."""
    total = int(td.total_seconds())
    days, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the filesystem ``path`` is on (``lustre``, ``gpfs``, ``nfs4``, ``fuse``, ``ext4``...): the mount
    whose point is the longest prefix of its real path; ``?`` when none is found."""
    real, best, kind = os.path.realpath(path), "", "?"
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields, _, rest = line.partition(" - ")
        point = fields.split()[4].encode().decode("unicode_escape") if len(fields.split()) > 4 else ""
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and rest:
            best, kind = point, rest.split()[0]
    return kind


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, for benchmark reports; "unknown" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


SIMULATED_FLAGS_VAR = "HPCDL_SIMULATE_CPU_FLAGS"
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags(cpuinfo: str = "/proc/cpuinfo", environ: dict[str, str] | None = None) -> set[str]:
    """The CPU's feature flags (avx2, avx512_bf16, amx_bf16 ...) from /proc/cpuinfo; empty where there are none.

    ``HPCDL_SIMULATE_CPU_FLAGS="avx2 fma amx_bf16"`` (spaces or commas) replaces them: a simulation, for
    testing the rules that follow the flags on a CPU that lacks them. :func:`cpu_flags_simulated` says
    when it is in force, and every log line that reports a choice made from the flags says so.
    """
    environ = os.environ if environ is None else environ
    if environ.get(SIMULATED_FLAGS_VAR, "").strip():
        return set(environ[SIMULATED_FLAGS_VAR].replace(",", " ").split())
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_flags_simulated(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get(SIMULATED_FLAGS_VAR, "").strip())


_last_words: list = []


def before_leaving(fn) -> None:
    """Have :func:`leave_now` (and so :func:`leave_done`) call ``fn()`` first (to release what the exit handlers
    would have released)."""
    _last_words.append(fn)


def leave_now(status: int) -> None:
    """End the process at once with ``status``, skipping interpreter shutdown and library destructors (a
    broken process group or a library stuck in a call can hang them): run what :func:`before_leaving`
    registered, flush the logs, ``os._exit``."""
    for fn in _last_words:
        try:
            fn()
        except Exception as exc:  # leaving anyway
            logging.getLogger(__name__).warning("before leaving: %s", exc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def leave_done(status: int) -> None:
    """End a process whose work is done as Python's own exit does, less its last part: the threads that are not
    daemons are joined, the ``atexit`` callbacks run (the heartbeat's stop, the loggers' flush, the data
    workers' end), MPI is finalized where mpi4py started it, then :func:`leave_now`. What is skipped is the
    teardown of every module and object: with torch and ``torch._dynamo`` loaded it costs each process 0.6-0.9 s
    of CPU (a two-rank ``hpcdl train`` on the 2-core EPYC: 8.2 s of CPU to the end, 6.3 s with this), paid by
    every rank of every job, in turn where ranks share a node's cores. Files the program left open are not
    flushed: the trainer closes its own before it returns."""
    # The interpreter's own exit path, in its order, through the names it uses (there are no public ones):
    # threading's exit callbacks (a thread pool's end) and the join of each thread that is not a daemon; then
    # the atexit callbacks; then mpi4py's MPI_Finalize, registered with Py_AtExit (Open MPI's mpirun fails a
    # rank that leaves without it).
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    leave_now(status)  # what the libraries' destructors would have released (before_leaving), the streams


@contextlib.contextmanager
def exit_if_stuck(seconds: float | None):
    """End the process with status 1 if the block has run ``seconds`` (``None``: no bound), printing
    ``Timeout (H:MM:SS)!`` and every thread's Python stack first. faulthandler's thread does it, and needs no
    interpreter lock: it acts where no Python thread can, in a C call that waits holding the lock (MPI_Init
    above all). One bound at a time per process: faulthandler keeps one timer."""
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
