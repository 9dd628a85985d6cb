"""``hpcdl tune``, ``hpcdl env`` and ``hpcdl ccl``: this rank, its CPUs and its communication runtime."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpcdl.flags import meta
from hpcdl.names import ALLOCATOR_CHOICES



@dataclass(kw_only=True, slots=True)
class TuneCommand:
    exports: bool = False  # print shell export lines only
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
    from hpcdl.cli import command

    command(sub, "tune", tune, TuneCommand,
            help="show this rank's CPU plan and allocator, or print the exports for a job script")
    command(sub, "env", env, EnvCommand, help="print this process's rank discovery as JSON")
    ccl = sub.add_parser("ccl", help="the oneCCL runtime of backend ccl").add_subparsers(dest="action", required=True)
    command(ccl, "install", ccl_install, CclInstall, help="assemble hpcdl's pinned oneCCL runtime from PyPI's wheels "
            "(sha256-checked); run it on the login node")
    command(ccl, "info", ccl_info, CclInfo, help="which libccl backend ccl loads, from which source, and its version")


def tune(cmd: TuneCommand) -> int:
    from hpcdl.distributed.affinity import allocator_exports, allocator_in_use, plan_cpus
    from hpcdl.distributed.env import discover

    if cmd.exports:
        sys.stdout.write(allocator_exports(cmd.allocator))
        return 0
    rank = discover()
    plan = plan_cpus(local_rank=rank.local_rank, local_size=rank.local_size, comm_threads=cmd.comm_threads,
                     data_cores=cmd.data_cores)
    print(f"rank:      {rank.describe()}")
    print(f"cpu:       {plan.describe()}")
    print(f"allocator: this process runs with {allocator_in_use()}")
    print("exports for the job script (hpcdl tune --exports):")
    sys.stdout.write("".join("  " + line + "\n" for line in allocator_exports(cmd.allocator).splitlines()))
    return 0


def env(_: EnvCommand) -> int:
    from hpcdl.distributed.env import discover

    # One write: under mpiexec the ranks share stdout, and print's separate newline can land after
    # another rank's line when Python runs unbuffered.
    sys.stdout.write(json.dumps(dataclasses.asdict(discover())) + "\n")
    sys.stdout.flush()
    return 0


def ccl_install(cmd: CclInstall) -> int:
    from hpcdl.distributed import ccl_runtime

    root = ccl_runtime.install(Path(cmd.prefix) if cmd.prefix else None,
                               wheels=Path(cmd.wheels) if cmd.wheels else None, force=cmd.force)
    print(f"oneCCL {ccl_runtime.VERSION} runtime in {root} (every file matches its pinned sha256)")
    if cmd.prefix and Path(cmd.prefix) != ccl_runtime.home():
        print(f"use it with: export HPCDL_CCL_HOME={root}")
    return 0


def ccl_info(_: CclInfo) -> int:
    from hpcdl.distributed import ccl_runtime

    ccl = ccl_runtime.load()
    print(f"oneCCL {ccl.version} from {ccl.runtime.library} ({ccl.runtime.source})")
    return 0
