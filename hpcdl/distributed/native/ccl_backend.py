"""The C++ part of the oneCCL group (``ccl_backend.cpp``): its small all-reduce without a call into Python.

Built with torch's own tooling (``torch.utils.cpp_extension.load``, about 20 s on the first use of a torch
and source, then a cached library) into ``~/.cache/hpcdl/ccl_backend/``; ``hpcdl ccl install`` builds it too. It
needs a C++ compiler, ninja and torch's headers for c10d's Python trampoline (``c10d/py/PyBackend.hpp``, shipped
since torch 2.14). Where one is missing, the group stays all Python (with the C thread of
:mod:`hpcdl.distributed.native.c_comm_thread`) and says so once; ``HPCDL_FASTCOMM=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

from hpcdl.deferred import deferred
from hpcdl.distributed.native import c_comm_thread
from hpcdl.utils import cache_dir

__all__ = ["load"]

SOURCE = Path(__file__).with_name("ccl_backend.cpp")
log = logging.getLogger(__name__)
_LOADED = None
_TRIED = False


def build_folder(environ=os.environ) -> Path:
    """Named by the source, torch's version and Python's: a library built for one is never loaded by another."""
    key = hashlib.sha256(SOURCE.read_bytes() + c_comm_thread.SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir(environ) / "ccl_backend" / f"{key}-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"


def load(environ=os.environ):
    """The built extension module (its ``FastBackend``), or None (said once) where it cannot be built or loaded."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    fast = c_comm_thread.load(environ)
    if fast is None:
        return None
    try:
        ctypes.CDLL(str(fast.path), mode=ctypes.RTLD_GLOBAL)  # the extension's fc_* symbols: the running thread's
        _LOADED = _build(environ)
    except Exception as exc:  # a compiler's error, a missing header or ninja: the Python group serves
        log.warning("ccl_backend: the C++ part of the oneCCL group is not available (%s); small all-reduces go through "
                    "Python (about 14 us more each)", str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else exc)
    return _LOADED


def _build(environ):
    """The module: imported straight from its library when this source was built for this torch before (no
    compiler, no ninja and no lock on a job's start-up), else built first."""
    folder = build_folder(environ)
    name = f"hpcdl_fastccl_{folder.name[:12]}"
    built = folder / f"{name}.so"
    if not built.exists():
        _compile(folder, name)
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(folder: Path, name: str) -> None:
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)  # its "No CUDA runtime is found" on every CPU node
    try:
        folder.mkdir(parents=True, exist_ok=True)  # ranks that build at once wait on torch's lock in it
        cpp_extension = deferred("torch.utils.cpp_extension")  # only to build: its import warns and costs time
        cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(folder), extra_cflags=["-O2"],
                       with_cuda=False, verbose=False)
    finally:
        cpp_logger.setLevel(level)
