"""One way to run every benchmark: join the job's ranks when it needs them, run it, print its table on
rank 0, and write its JSON report with where and how it was measured."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from hpcdl import __version__, names
from hpcdl.bench.reports import Machine, Provenance
from hpcdl.deferred import deferred
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import ConfigError
from hpcdl.flags import meta
from hpcdl.schema import to_dict
from hpcdl.utils import atomic_write_text, cpu_flags, cpu_model

__all__ = ["Job", "Output", "RankOptions", "provenance", "run_benchmark", "write_report"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class RankOptions:
    """How a benchmark that runs on a job's ranks joins them."""

    # the process group's backend (auto: ccl when a oneCCL runtime loads, else gloo)
    backend: str = dataclasses.field(default="auto", metadata=meta(choices=("auto", *names.BACKENDS)))
    # compare several backends side by side in one run, comma-separated (mpi needs mpiexec or srun --mpi)
    backends: str | None = None
    timeout: float = 1800.0  # collective timeout in s once all ranks joined
    startup_timeout: float = 600.0  # timeout in s for all ranks to join
    heartbeat: float = 2.0  # heartbeat interval in s (names lost ranks)

    def __post_init__(self):
        names.check("--backend", self.backend, ("auto", *names.BACKENDS))
        if min(self.timeout, self.startup_timeout, self.heartbeat) <= 0:
            raise ConfigError(f"--timeout {self.timeout}, --startup-timeout {self.startup_timeout} and --heartbeat "
                              f"{self.heartbeat} must be more than 0 seconds")


@dataclasses.dataclass(kw_only=True, slots=True)
class Output:
    """Where the report goes besides the table on standard output."""

    # also write the report here as JSON (%j: the job id, %N: the node's name)
    json_path: str | None = dataclasses.field(default=None, metadata=meta(flag="--json", metavar="FILE"))
    # write a PNG here (%j, %N as for --json; needs matplotlib: hpcdl[plot])
    plot_path: str | None = dataclasses.field(default=None, metadata=meta(flag="--plot", metavar="PNG"))


@dataclasses.dataclass(slots=True)
class Job:
    """What a benchmark's ``run`` gets: this rank, and on a job's ranks its process group."""

    env: object  # hpcdl.distributed.ranks.env.RankEnv
    ctx: object = None  # hpcdl.distributed.group.lifecycle.DistContext, for benchmarks that run on ranks
    groups: dict = dataclasses.field(default_factory=dict)  # backend name -> group (--backends), else the default's
    timeout: timedelta = timedelta(minutes=30)

    @property
    def rank(self) -> int:
        return self.env.rank

    def expand(self, path: str) -> str:
        """``%j`` -> the job id (``local`` outside a job) and ``%N`` -> the node's name (Slurm's, else the short
        host name), as in Slurm's ``--output``: ``srun -N4 hpcdl bench step --json step-%N.json`` keeps each
        node's report."""
        node = os.environ.get("SLURMD_NODENAME") or self.env.hostname.split(".")[0]
        return path.replace("%j", self.env.job_id or "local").replace("%N", node)


def run_benchmark(row, cfg, ranks: RankOptions | None = None, output: Output | None = None,
                  argv: list[str] | None = None):
    """Run ``row`` (a :class:`hpcdl.bench.Benchmark`) with ``cfg``; rank 0 prints and writes the report and
    returns it (its dataclass of :mod:`hpcdl.bench.reports`, with ``config`` and ``provenance`` filled), the
    other ranks return None."""
    ranks, output = ranks or RankOptions(), output or Output()
    if ranks.backends and not row.compares_backends:
        raise ConfigError(f"bench {row.name} measures one backend at a time; give --backend, not --backends")
    if output.plot_path and not row.plots:
        raise ConfigError(f"bench {row.name} draws no plot; drop --plot")
    job = _join(ranks) if row.on_ranks else Job(env=discover())
    try:
        figures = row.run(cfg, job)
    finally:
        if job.ctx is not None:  # not reached after a RankLostError: a broken group cannot be torn down cleanly
            deferred("hpcdl.distributed.group.lifecycle:shutdown")(job.ctx)
    if figures is None:
        return None
    # the config as run: a benchmark may resolve what the flags left open (bench step's crop 0, a model's own)
    report = dataclasses.replace(figures, config=getattr(figures, "config", None) or cfg, provenance=provenance(job, argv))
    print(row.format(report), flush=True)
    if output.json_path:
        write_report(job.expand(output.json_path), {"benchmark": row.name, **to_dict(report)})
    if output.plot_path:
        row.load().plot(report, job.expand(output.plot_path))
    return report


def _join(ranks: RankOptions) -> Job:
    pg = deferred("hpcdl.distributed.group.lifecycle")  # torch: only a benchmark that runs on ranks needs it
    liveness = deferred("hpcdl.distributed.group.liveness")
    ctx = pg.init_distributed("gloo" if ranks.backends else ranks.backend,
                           timeout=timedelta(seconds=ranks.startup_timeout), heartbeat_s=ranks.heartbeat)
    timeout = timedelta(seconds=ranks.timeout)
    pg.set_timeout(ctx, timeout)
    with liveness.fail_fast(ctx.heartbeat):
        groups = pg.backend_groups(ctx, ranks.backends, timeout) if ranks.backends else {ctx.backend.name: ctx.group}
    return Job(env=ctx.env, ctx=ctx, groups=groups, timeout=timeout)


def write_report(path: str, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", path)


def provenance(job: Job | None = None, argv: list[str] | None = None) -> Provenance:
    """Where and how a report was measured: the machine, the command line, hpcdl's version and commit."""
    flags = cpu_flags()
    machine = Machine(cpu=cpu_model(), cores=len(os.sched_getaffinity(0)), logical_cpus=os.cpu_count() or 1,
                      flags=tuple(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))))
    return Provenance(command=tuple(sys.argv if argv is None else argv), hpcdl=__version__, commit=_commit(),
                      machine=machine, host=os.uname().nodename, job_id=job.env.job_id if job else None,
                      time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def machine_line(report) -> str:
    """The report's machine as a table's first line: the CPU, its logical CPUs and the ISA flags that matter."""
    m = report.provenance.machine
    return f"CPU: {m.cpu}, {m.logical_cpus} logical CPUs, flags {' '.join(m.flags)}"


def _commit() -> str | None:
    """hpcdl's git commit (with ``-dirty`` when its tree has changes), or None outside a checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("-dirty" if dirty else "")) or None
