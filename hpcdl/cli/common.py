"""What every command group shares: the exit statuses and :func:`command`, which makes a subcommand of
config dataclasses and a handler."""

from __future__ import annotations

import argparse
import enum

from hpcdl.deferred import deferred
from hpcdl.flags import add_flags, config_from_args
from hpcdl.runs.outcome import EXIT_BAD_INPUT, EXIT_PEER_LOST, Outcome

__all__ = ["Exit", "command", "exit_code"]


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1  # a check failed (wrong values, damaged shards), or a rank was lost
    BAD_INPUT = EXIT_BAD_INPUT  # a config, flag or file was refused; the message says what to fix
    STOPPED = 3  # training stopped before its end and will not go on by itself (SIGTERM, no requeue left)
    PEER_LOST = EXIT_PEER_LOST  # a rank was lost; this one saved what it could (hpcdl.train.rescue)


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
    (when the handler needs it only in some cases). ``handler`` is a function, or ``"module:function"`` for
    one in a module that imports torch: imported when the command runs (:mod:`hpcdl.deferred`)."""
    parser = sub.add_parser(name, **parser_kw)
    for cls in configs:
        add_flags(parser, cls, skip=(skip or {}).get(cls, ()))

    def build(cls, args):
        return (lambda: config_from_args(cls, args)) if cls in defer else config_from_args(cls, args)

    def run(args):
        fn = deferred(handler) if isinstance(handler, str) else handler
        return fn(*(build(cls, args) for cls in configs))

    parser.set_defaults(fn=run)
    return parser
