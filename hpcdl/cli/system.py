"""``hpcdl tune``, ``hpcdl env``, ``hpcdl exec`` and ``hpcdl ccl``: this rank, its CPUs and its communication
runtime."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hpcdl
from hpcdl.bench.configs import TuneConfig
from hpcdl.cli.common import command
from hpcdl.deferred import deferred
from hpcdl.distributed.affinity import allocator_exports, allocator_in_use, plan_cpus
from hpcdl.distributed.ccl import install, library
from hpcdl.distributed.mpi.runtime import mpi_environment
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import ConfigError
from hpcdl.flags import meta
from hpcdl.launch.layout import NodeLayout
from hpcdl.names import ALLOCATOR_CHOICES
from hpcdl.utils import atomic_write_text, cpu_flags, cpu_model


@dataclass(kw_only=True, slots=True)
class TuneCommand:
    exports: bool = False  # print shell export lines only
    # choose the node layout by short trials on this node (docs/launching.md): prints a table, writes --write
    measure: bool = False
    # the allocator the exports preload (auto: the first that loads, in the order listed after none)
    allocator: str = field(default="auto", metadata=meta(choices=ALLOCATOR_CHOICES))
    comm_threads: int = 0  # threads kept for communication
    data_cores: int = 0  # whole cores kept for the data loader (hpcdl train sizes them: data.reserve_cores)


@dataclass(kw_only=True, slots=True)
class EnvCommand:
    pass


@dataclass(kw_only=True, slots=True)
class CclInstall:
    prefix: str | None = None  # where (default: HPCDL_CCL_HOME, or ~/.cache/hpcdl/oneccl-VERSION)
    wheels: str | None = None  # a folder holding the wheels already (no download)
    force: bool = False  # assemble it again even if it is there


@dataclass(kw_only=True, slots=True)
class CclInfo:
    pass


def add_commands(sub) -> None:
    command(sub, "tune", tune, TuneCommand, TuneConfig,
            help="show this rank's CPU plan and allocator, print the exports for a job script, or --measure the node "
                 "layout")
    command(sub, "env", env, EnvCommand, help="print this process's rank discovery as JSON")
    run = sub.add_parser("exec", help="run COMMAND with torch's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, "
                         "MASTER_ADDR, MASTER_PORT...) set from this rank's launcher: srun or mpiexec, then a plain "
                         "torch script's init_process_group() joins")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...")
    run.set_defaults(fn=lambda args: exec_command(args.argv))
    ccl = sub.add_parser("ccl", help="the oneCCL runtime of backend ccl").add_subparsers(dest="action", required=True)
    command(ccl, "install", ccl_install, CclInstall, help="assemble hpcdl's pinned oneCCL runtime from PyPI's wheels "
            "(sha256-checked) and build the group's C thread and C++ all-reduce; run it on the login node")
    command(ccl, "info", ccl_info, CclInfo, help="which libccl backend ccl loads, from which source, and its version")


def tune(cmd: TuneCommand, trials) -> int:
    if cmd.exports:
        sys.stdout.write(allocator_exports(cmd.allocator))
        return 0
    if cmd.measure:
        return _measure(trials)
    rank = discover()
    plan = plan_cpus(local_rank=rank.local_rank, local_size=rank.local_size, comm_threads=cmd.comm_threads,
                     data_cores=cmd.data_cores)
    print(f"rank:      {rank.describe()}")
    print(f"cpu:       {plan.describe()}")
    print(f"allocator: this process runs with {allocator_in_use()}")
    print("exports for the job script (hpcdl tune --exports):")
    sys.stdout.write("".join("  " + line + "\n" for line in allocator_exports(cmd.allocator).splitlines()))
    return 0


def _measure(cfg) -> int:
    print(f"hpcdl tune --measure on {socket.gethostname()}: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; "
          f"{cfg.model} at {cfg.crop} px, {cfg.steps} steps a trial", flush=True)
    r = deferred("hpcdl.bench.tune:measure")(cfg, log=lambda line: print(line, flush=True))
    sys.stdout.write(format_layouts(r))
    w, topology = r.winner, r.topology
    layout = NodeLayout(ranks_per_node=w.ranks, cpus_per_task=topology.cores // w.ranks, precision=w.precision,
                        channels_last=w.channels_last, allocator=w.allocator, batch_per_rank=r.batch_per_rank,
                        images_per_s=r.winner_images_per_s, model=cfg.model,
                        node={"host": socket.gethostname(), "cpu": cpu_model(), "cores": topology.cores,
                              "sockets": topology.sockets, "numa": topology.numa,
                              "flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))})
    atomic_write_text(cfg.write, layout.to_json())
    print(f"wrote {cfg.write}: {layout.describe()}; use it with hpcdl sbatch --layout {cfg.write} ...")
    return 0


def format_layouts(r) -> str:
    """``hpcdl tune --measure``'s table of a :class:`hpcdl.bench.tune.TuneResult`."""
    t = r.topology
    lines = [f"node: {t.cores} cores, {t.sockets} sockets, {t.numa} NUMA domains, {r.memory_mb / 1024:.1f} GB for "
             "this job",
             f"  {'images/s':>9s}  {'peak GB':>7s}  layout (ranks x cores each, precision, memory format, allocator, batch per rank)"]
    lines += [f"  {x.round.images_per_s:9.2f}  {x.round.peak_rss_mb / 1024:7.2f}  {x.trial.name()}" for x in r.trials]
    lines += [f"  {'refused':>9s}  {'':7s}  {name}: {why}" for name, why in r.refused.items()]
    lines += [f"  skipped {what}: {why}" for what, why in r.skipped.items()]
    if c := r.confirm:
        m = c.medians
        lines.append(f"confirming run, {len(c.rounds['winner'])} alternating rounds: {c.winner} {m['winner']:.2f} "
                     f"images/s, {c.runner_up} {m['runner-up']:.2f}" + ("; the runner-up was faster here and wins"
                                                                      if c.swapped else ""))
    lines.append(f"winner: {r.winner.name()}; batch per rank within 5% of the best: {r.batch_per_rank}")
    return "\n".join(lines) + "\n"


def env(_: EnvCommand) -> int:
    # One write: under mpiexec the ranks share stdout, and print's separate newline can land after
    # another rank's line when Python runs unbuffered.
    found = {**dataclasses.asdict(discover()), "python": sys.executable, "prefix": sys.prefix,
             "hpcdl": os.path.dirname(hpcdl.__file__)}  # where it was imported from: the node's copy under --stage-env
    sys.stdout.write(json.dumps(found) + "\n")
    sys.stdout.flush()
    return 0


def exec_command(argv: list[str]) -> int:
    """Replace this process by ``argv`` with torch's env:// variables set from rank discovery; variables the
    launcher set already (torchrun's) stay."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise ConfigError("hpcdl exec: name the command to run, e.g. 'srun hpcdl exec python train.py'")
    os.environ.update({k: v for k, v in discover().torch_variables().items() if k not in os.environ})
    os.environ.update(mpi_environment(os.environ))
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise ConfigError(f"hpcdl exec: cannot run {argv[0]!r}: {exc}") from None


def ccl_install(cmd: CclInstall) -> int:
    root = install.install(Path(cmd.prefix) if cmd.prefix else None,
                           wheels=Path(cmd.wheels) if cmd.wheels else None, force=cmd.force)
    print(f"oneCCL {install.VERSION} runtime in {root} (every file matches its pinned sha256)")
    # The group's C thread and C++ all-reduce, for compute nodes without a compiler that share this cache: built (a
    # failure recorded before is tried again), nothing started; without them oneCCL works through Python.
    deferred("hpcdl.distributed.native.build:main")()
    if cmd.prefix and Path(cmd.prefix) != install.home():
        print(f"use it with: export HPCDL_CCL_HOME={root}")
    return 0


def ccl_info(_: CclInfo) -> int:
    ccl = library.load()
    print(f"oneCCL {ccl.version} from {ccl.runtime.library} ({ccl.runtime.source})")
    return 0
