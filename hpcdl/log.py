"""Logging for hpcdl's entry points (library modules only call ``logging.getLogger``)."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, verbose: bool = False) -> None:
    """Rank 0 logs progress; every rank logs warnings and errors, prefixed with its rank."""
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
