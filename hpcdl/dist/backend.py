"""Choosing the communication backend, and the oneCCL variables that users trip on."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

from hpcdl.dist.affinity import CpuPlan
from hpcdl.dist.env import RankEnv
from hpcdl.errors import ConfigError

__all__ = ["BACKENDS", "BackendChoice", "ccl_environment", "ccl_status", "choose_backend"]

BACKENDS = ("auto", "gloo", "ccl", "mpi")
MPI_LAUNCHERS = ("openmpi", "mpi-hydra")


@dataclasses.dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str
    reason: str


def ccl_status() -> tuple[bool, str]:
    """Whether Intel's oneCCL bindings import and were built for this torch (major.minor)."""
    try:
        ccl = importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError as exc:
        return False, f"oneccl_bindings_for_pytorch is not importable ({exc})"
    import torch

    have = getattr(ccl, "__version__", "unknown")
    if have.split("+")[0].split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        return False, f"oneccl_bindings_for_pytorch {have} does not match torch {torch.__version__}"
    return True, f"oneccl_bindings_for_pytorch {have} matches torch {torch.__version__}"


def mpi_status() -> str:
    """Which MPI the mpi4py backend runs on; a ConfigError when mpi4py does not import."""
    from hpcdl.dist.mpi import _mpi

    MPI = _mpi()
    import mpi4py

    return f"mpi4py {mpi4py.__version__} on {MPI.Get_library_version().splitlines()[0].strip()}"


def choose_backend(requested: str) -> BackendChoice:
    if requested not in BACKENDS:
        raise ConfigError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested == "mpi":
        return BackendChoice("mpi4py", f"requested: {mpi_status()}")
    if requested == "gloo":
        return BackendChoice("gloo", "requested")
    ok, why = ccl_status()
    if requested == "ccl":
        if not ok:
            raise ConfigError(f"backend 'ccl' requested but {why}. Install the oneCCL bindings built for your torch "
                              "from Intel's wheel index (see README), or use --backend gloo")
        return BackendChoice("ccl", f"requested; {why}")
    return BackendChoice("ccl", f"auto: {why}") if ok else BackendChoice("gloo", f"auto: {why}")


def ccl_environment(env: RankEnv, plan: CpuPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """oneCCL settings for this rank; a value the user exported wins.

    Without an MPI launcher oneCCL must be told not to look for one (CCL_PROCESS_LAUNCHER=none)
    and given the local rank and size. Its worker threads are pinned to the CPUs the CPU plan kept
    for communication, so they do not steal cores from the OpenMP compute threads.
    """
    wanted: dict[str, str] = {"CCL_WORKER_COUNT": str(max(1, len(plan.comm_cpus)))}
    if plan.comm_cpus:
        wanted["CCL_WORKER_AFFINITY"] = ",".join(map(str, plan.comm_cpus))
    if env.launcher not in MPI_LAUNCHERS:
        wanted |= {"CCL_PROCESS_LAUNCHER": "none", "CCL_LOCAL_RANK": str(env.local_rank),
                   "CCL_LOCAL_SIZE": str(env.local_size)}
    return {k: v for k, v in wanted.items() if k not in environ}
