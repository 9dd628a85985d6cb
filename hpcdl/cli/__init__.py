"""``hpcdl``: the one command. Each command group is a module of this package, its parsers beside its
handlers; every flag comes from a config dataclass (:mod:`hpcdl.flags`). Nothing here imports torch: a
handler that needs it names the code by string (:mod:`hpcdl.deferred`), imported when the command runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hpcdl import __version__
from hpcdl.cli import bench, data, jobs, plan, system, train
from hpcdl.cli.common import Exit, command, exit_code
from hpcdl.distributed.ranks.env import LAUNCHERS
from hpcdl.errors import HpcdlError, RankLostError
from hpcdl.log import setup_logging
from hpcdl.utils import leave_done, leave_now

__all__ = ["Exit", "build_parser", "command", "console", "exit_code", "main"]

log = logging.getLogger("hpcdl")

GROUPS = (train, jobs, bench, plan, data, system)  # each adds its commands, in this order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcdl", description="Data-parallel training of image classifiers on CPU "
                                     "clusters run by Slurm: pack, train, launch, measure, plan.")
    parser.add_argument("--version", action="version", version=f"hpcdl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    setup_logging(_rank_for_logging(), args.verbose)
    try:
        return int(args.fn(args))
    except RankLostError as exc:
        log.error("%s", exc)
        leave_now(Exit.FAILED)  # a broken process group can hang interpreter shutdown
    except HpcdlError as exc:
        log.error("%s", exc)
        if _one_rank_of_many():  # the others notice its heartbeat stop; finalizing could wait on them
            leave_now(Exit.BAD_INPUT)
        return Exit.BAD_INPUT


def console(argv: list[str] | None = None) -> None:
    """The ``hpcdl`` command and ``python -m hpcdl``: :func:`main`, then the process ends; where the command
    loaded torch, by :func:`hpcdl.utils.leave_done`, without the interpreter's teardown of torch's modules."""
    status = main(argv)
    if "torch" in sys.modules:
        leave_done(status)
    sys.exit(status)


def _one_rank_of_many() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _rank_for_logging() -> int:
    row = next((r for r in LAUNCHERS if r.marker in os.environ), None)
    value = os.environ.get(row.rank, "0") if row else "0"
    return int(value) if value.isdigit() else 0  # a bad value is reported by discovery itself
