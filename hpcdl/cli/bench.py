"""``hpcdl bench NAME``: one subcommand per row of :data:`hpcdl.bench.BENCHMARKS`, its flags from the
benchmark's ``Config`` (and the runner's options for those that run on a job's ranks)."""

from __future__ import annotations

import logging

from hpcdl.bench import BENCHMARKS, Benchmark
from hpcdl.bench.runner import Output, RankOptions, run_benchmark
from hpcdl.cli.common import command

log = logging.getLogger("hpcdl")


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: each measures side by side in one run and prints ratios"
                           ).add_subparsers(dest="bench", required=True, metavar="BENCH")
    for row in BENCHMARKS.values():
        options = (RankOptions,) if row.on_ranks else ()
        skip = {RankOptions: ("backends",) * (not row.compares_backends), Output: ("plot_path",) * (not row.plots)}
        command(bench, row.name, _handler(row), row.config, *options, Output, skip=skip, help=row.help,
                description=row.help)


def _handler(row: Benchmark):
    def run(cfg, *options) -> int:
        ranks = options[0] if row.on_ranks else None
        report = run_benchmark(row, cfg, ranks, options[-1])
        problem = report is not None and getattr(row.load(), "check", lambda _: None)(report)
        if problem:
            log.error("%s", problem)
            return 1
        return 0

    return run
