"""``hpcdl``: the one command. Each command group is a module of this package, its parsers beside its
handlers; every flag comes from a config dataclass (:mod:`hpcdl.flags`). Commands import their heavy
dependencies (torch) only when they run."""

from __future__ import annotations

import argparse
import enum
import importlib
import logging
import os
import sys

from hpcdl import __version__
from hpcdl.errors import HpcdlError, RankLostError
from hpcdl.flags import add_flags, config_from_args
from hpcdl.train.outcome import Outcome
from hpcdl.utils import leave_now

__all__ = ["Exit", "build_parser", "command", "exit_code", "main"]

log = logging.getLogger("hpcdl")

GROUPS = ("train", "jobs", "bench", "plan", "data", "system")  # hpcdl.cli.GROUP: each adds its commands


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1  # a check failed (wrong values, damaged shards), or a rank was lost
    BAD_INPUT = 2  # a config, flag or file was refused; the message says what to fix
    STOPPED = 3  # training stopped before its end and will not go on by itself (SIGTERM, no requeue left)


_OUTCOME_EXIT = {Outcome.FINISHED: Exit.OK, Outcome.REQUEUED: Exit.OK, Outcome.STOPPED: Exit.STOPPED,
                 Outcome.TERMINATED: Exit.STOPPED}


def exit_code(outcome: str) -> Exit:
    """A training run's exit status: a requeued run goes on in its next allocation, so this one succeeded."""
    return _OUTCOME_EXIT[Outcome(outcome)]


def command(sub, name: str, handler, *configs: type, skip: dict | None = None, defer: tuple[type, ...] = (),
            **parser_kw) -> argparse.ArgumentParser:
    """Add ``hpcdl ... NAME``: its flags are the fields of ``configs`` (less those ``skip[cls]`` names: they
    keep their defaults, or take an earlier config's argument of the same name), and ``handler`` gets one
    instance of each, built from the parsed flags; for a class in ``defer``, a function that builds it
    (when the handler needs it only in some cases)."""
    parser = sub.add_parser(name, **parser_kw)
    for cls in configs:
        add_flags(parser, cls, skip=(skip or {}).get(cls, ()))

    def build(cls, args):
        return (lambda: config_from_args(cls, args)) if cls in defer else config_from_args(cls, args)

    parser.set_defaults(fn=lambda args: handler(*(build(cls, args) for cls in configs)))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcdl", description="Data-parallel training of image classifiers on CPU "
                                     "clusters run by Slurm: pack, train, launch, measure, plan.")
    parser.add_argument("--version", action="version", version=f"hpcdl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for group in GROUPS:
        importlib.import_module(f"hpcdl.cli.{group}").add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hpcdl.log import setup_logging

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


def _one_rank_of_many() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _rank_for_logging() -> int:
    from hpcdl.distributed.env import LAUNCHERS

    row = next((r for r in LAUNCHERS if r.marker in os.environ), None)
    value = os.environ.get(row.rank, "0") if row else "0"
    return int(value) if value.isdigit() else 0  # a bad value is reported by discovery itself
