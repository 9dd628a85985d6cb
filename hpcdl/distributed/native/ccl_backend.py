"""The C++ part of the oneCCL group (``ccl_backend.cpp``): its small all-reduce without a call into Python.

Built by :mod:`hpcdl.distributed.native.build` with torch's own tooling (``torch.utils.cpp_extension``, in a child
process; 25 s to 2 min, once per key: the sources, torch's version, build and C++ ABI, the C library, Python and the
machine) into ``~/.cache/hpcdl/native/KEY/ccl_backend/``; ``hpcdl ccl install`` builds it (and, of one that does
not import here, names the folder to remove), and so does the first rank that finds neither it nor a recorded failure
(within 15 min, or "not built this time"). It needs a C++ compiler, ninja and torch's headers for c10d's Python
trampoline (``c10d/py/PyBackend.hpp``, shipped since torch 2.14). It is linked against the C thread's library
(``c_comm_thread.c``), whose calls it makes. Where it is not there, the group stays all Python (with the C thread of
:mod:`hpcdl.distributed.native.c_comm_thread`) and says so once; ``HPCDL_FASTCOMM=0`` turns both off.

The contract between the two languages: the extension gives ``FastBackend(rank, size)``, a c10d Backend that the
Python group's class derives from (:func:`hpcdl.distributed.ccl.group.group_class`), and its
``_configure_fast(allreduce, comm, dtypes, ops, max_bytes)``, which the group calls once its communicator exists. The
C++ side calls back into the group by the names :class:`BackendCallbacks` lists, and by no other:
:func:`check_callbacks` compares them with the names ``ccl_backend.cpp`` calls, read from its source, and with the
group's methods.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Protocol

import torch
from torch.futures import Future

from hpcdl.distributed.native import build, c_comm_thread

__all__ = ["BackendCallbacks", "callbacks_called", "check_callbacks", "load"]

SOURCE = build.SOURCES["ccl_backend"]
log = logging.getLogger(__name__)
_LOADED = None
_TRIED = False


class BackendCallbacks(Protocol):
    """What ``ccl_backend.cpp`` calls on the Python group it is a base of, with the interpreter lock taken, and only
    off the fast path: a wait that has run 200 ms, a failed call, a caller that asks for a future. ``ticket`` is the
    C thread's ticket of the all-reduce; ``what`` the collective's tensors (from C++; the Python group's own wait
    passes its description)."""

    def ticket_overdue(self, ticket: int, waited_s: float, what) -> str | None:
        """Asked every 200 ms of a wait: the error that ends it (past the group's timeout, or a peer whose heartbeat
        stopped), after marking ``ticket`` given up; None to go on waiting. Must not block."""

    def ticket_error(self, ticket: int, rc: float, what) -> str:
        """The error message of a call that returned the nonzero ``rc``: oneCCL's own words, or the abort inside it."""

    def ticket_future(self, ticket: int, tensors: list[torch.Tensor]) -> Future:
        """A future of the all-reduce ``ticket``, completed with ``tensors`` (or its error) once it has finished."""


def callback_names() -> set[str]:
    """The methods :class:`BackendCallbacks` lists."""
    return {name for name, value in vars(BackendCallbacks).items() if callable(value) and not name.startswith("_")}


def callbacks_called(source: str | None = None) -> set[str]:
    """The Python methods ``ccl_backend.cpp`` calls: the names it passes to ``ask("...")`` or ``attr("...")``."""
    text = re.sub(r"//[^\n]*", "", SOURCE.read_text() if source is None else source)  # not its comments
    return set(re.findall(r'\b(?:ask|attr)\(\s*"(\w+)"', text))


def check_callbacks(cls: type, source: str | None = None) -> None:
    """Raise TypeError unless ``ccl_backend.cpp`` calls exactly :class:`BackendCallbacks`' methods and ``cls`` has
    each, with the Protocol's parameters: a rename on one side only fails here, not inside a collective."""
    called, listed = callbacks_called(source), callback_names()
    wrong = [f"ccl_backend.cpp calls {n}, which BackendCallbacks lacks" for n in sorted(called - listed)]
    wrong += [f"BackendCallbacks lists {n}, which ccl_backend.cpp does not call" for n in sorted(listed - called)]
    for name in sorted(listed):
        want = list(inspect.signature(getattr(BackendCallbacks, name)).parameters)
        method = getattr(cls, name, None)
        if not callable(method):
            wrong.append(f"{cls.__name__} has no method {name}")
        elif list(inspect.signature(method).parameters) != want:
            wrong.append(f"{cls.__name__}.{name} takes {list(inspect.signature(method).parameters)}, not {want}")
    if wrong:
        raise TypeError("the contract between ccl_backend.cpp and the Python group is broken: " + "; ".join(wrong))


def load(environ=os.environ):
    """The built extension module (its ``FastBackend``), or None (said once) where it is not there or the C thread
    it queues on is not used."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    if c_comm_thread.load(environ) is None:  # its all-reduce runs on the C thread: without it, nothing to do
        if environ.get("HPCDL_FASTCOMM", "1") != "0":
            log.warning("ccl_backend: not used: its all-reduce queues on c_comm_thread's thread, which is not used "
                        "here (above); small all-reduces go through Python")
        return None
    built = build.ensure("ccl_backend", environ)
    why, remedy = built.describe(), built.retry()
    if built.path is not None:
        try:
            _LOADED = _import(built.path)
            return _LOADED
        except ImportError as exc:  # built for another libstdc++ or torch C++ ABI
            why, remedy = f"{built.path} does not import: {exc}", build.rebuild_advice(environ)
    log.warning("ccl_backend: not used (%s); small all-reduces go through Python (about 14 us more each); %s", why,
                remedy)
    return None


def _import(path: Path):
    """The module in ``path``, named as it was built (its file's stem); no compiler, ninja or lock involved."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
