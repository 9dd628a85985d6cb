"""CPU tuning for one rank: which CPUs compute, how many OpenMP threads, and which allocator.

Two halves, because of when they must act:

* :func:`allocator_exports` produces shell ``export`` lines. An allocator is chosen by LD_PRELOAD or
  GLIBC_TUNABLES, which only act if set before Python starts, so the generated sbatch scripts and the
  submitit setup lines ``eval`` the output of ``hpcdl tune --exports`` on the compute node.
* :func:`plan_cpus` (and :func:`hpcdl.distributed.group.lifecycle.apply_cpu_plan`, which needs torch) run inside
  each rank at start-up: they read the CPUs
  the task may use (``os.sched_getaffinity``), keep some for communication and for the data loader,
  and set the thread count from the rest. The loader's cores are sized from measured rates
  (:mod:`hpcdl.train.loader_sizing`), not one per worker.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shlex

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.names import registry

__all__ = ["ALLOCATORS", "CpuPlan", "allocator_exports", "allocator_in_use", "plan_cpus"]

LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
# mmap_max=0 keeps large tensors in the heap instead of mmap/munmap on every step; the big
# trim_threshold stops glibc from handing freed memory back to the OS after each iteration.
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Allocator:
    name: str
    libraries: tuple[str, ...]  # file names searched in LIB_DIRS; empty for glibc


ALLOCATORS: tuple[Allocator, ...] = (
    Allocator(name="jemalloc", libraries=("libjemalloc.so.2", "libjemalloc.so")),
    Allocator(name="tcmalloc", libraries=("libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libtcmalloc.so")),
    Allocator(name="glibc", libraries=()),
)
registry("allocators", {a.name: a for a in ALLOCATORS}, names.ALLOCATORS)
ALLOCATOR_CHOICES = names.ALLOCATOR_CHOICES


def find_library(allocator: Allocator, lib_dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
    for directory in lib_dirs:
        for name in allocator.libraries:
            hits = sorted(glob.glob(os.path.join(directory, name)))
            if hits:
                return hits[0]
    return None


def allocator_env(choice: str = "auto", lib_dirs: tuple[str, ...] = LIB_DIRS) -> tuple[str, dict[str, str]]:
    """The allocator to use on this node and the variables that select it."""
    names.check("allocator", choice, ALLOCATOR_CHOICES)
    if choice == "none":
        return "none", {}
    for alloc in ALLOCATORS:
        if choice not in ("auto", alloc.name):
            continue
        if alloc.name == "glibc":
            return "glibc", {"GLIBC_TUNABLES": GLIBC_TUNABLES}
        path = find_library(alloc, lib_dirs)
        if path:
            extra = {"MALLOC_CONF": JEMALLOC_CONF} if alloc.name == "jemalloc" else {}
            return alloc.name, {"LD_PRELOAD": path, **extra}
        if choice == alloc.name:
            raise ConfigError(f"allocator {choice} requested but none of {', '.join(alloc.libraries)} is in "
                              f"{', '.join(lib_dirs)}; install it (Debian: libjemalloc2 / libtcmalloc-minimal4) "
                              "or use --allocator glibc")
    raise AssertionError("unreachable: glibc always matches")


def allocator_exports(choice: str = "auto", lib_dirs: tuple[str, ...] = LIB_DIRS) -> str:
    """Shell lines that select the allocator; LD_PRELOAD keeps what the user already preloads."""
    name, env = allocator_env(choice, lib_dirs)
    lines = [f"# hpcdl allocator: {name}"]
    for key, value in env.items():
        if key == "LD_PRELOAD":
            lines.append(f"export LD_PRELOAD={shlex.quote(value)}${{LD_PRELOAD:+:$LD_PRELOAD}}")
        else:
            lines.append(f"export {key}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def allocator_in_use(environ: dict[str, str] | None = None) -> str:
    """What this process runs with, as it was started (the allocator cannot change after start-up)."""
    environ = os.environ if environ is None else environ
    preload = environ.get("LD_PRELOAD", "")
    for alloc in ALLOCATORS:
        if any(lib.split(".so")[0] in preload for lib in alloc.libraries):
            return f"{alloc.name} (LD_PRELOAD)"
    if "mmap_max=0" in environ.get("GLIBC_TUNABLES", ""):
        return "glibc with tuned malloc (GLIBC_TUNABLES)"
    return "glibc defaults: slower; start through 'eval \"$(hpcdl tune --exports)\"' or a generated sbatch script"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CpuPlan:
    """How one rank uses the CPUs it may run on."""

    task_cpus: tuple[int, ...]
    compute_cpus: tuple[int, ...]
    comm_cpus: tuple[int, ...]
    data_cpus: tuple[int, ...]
    threads: int
    source: str

    def describe(self) -> str:
        return (f"{self.threads} OpenMP threads on CPUs {_ranges(self.compute_cpus)} ({self.source}); "
                f"communication CPUs {_ranges(self.comm_cpus) or '-'}, loader CPUs kept {_ranges(self.data_cpus) or '-'}")


def plan_cpus(*, local_rank: int, local_size: int, comm_threads: int = 0, data_cores: int = 0,
              task_cpus: set[int] | None = None, online_cpus: int | None = None) -> CpuPlan:
    """Split this task's CPUs between compute, communication and the data loader (``data_cores`` whole
    cores; its workers may also use the compute cores, at a lower priority).

    When the task may run on every CPU of the node although several ranks share it (no CPU binding
    by the launcher, as under ``srun`` with ``TaskPlugin=task/none`` or a plain ``mpiexec``), each
    local rank takes its own contiguous slice instead of all ranks fighting over every core.
    """
    cpus = sorted(os.sched_getaffinity(0) if task_cpus is None else task_cpus)
    online = os.cpu_count() if online_cpus is None else online_cpus
    source = "task CPU set"
    if local_size > 1 and len(cpus) == online and len(cpus) >= local_size:
        per = len(cpus) // local_size
        cpus = cpus[local_rank * per:(local_rank + 1) * per]
        source = f"the node's {online} CPUs split among {local_size} local ranks"
    reserved = comm_threads + data_cores
    if reserved >= len(cpus):
        # Too few CPUs to reserve any: everything shares, and compute keeps at least one thread.
        return CpuPlan(task_cpus=tuple(cpus), compute_cpus=tuple(cpus), comm_cpus=(), data_cpus=(),
                       threads=len(cpus), source=source + f"; too few CPUs to reserve {reserved}")
    compute = cpus[:len(cpus) - reserved]
    data = cpus[len(compute):len(compute) + data_cores]
    comm = cpus[len(compute) + data_cores:]
    return CpuPlan(task_cpus=tuple(cpus), compute_cpus=tuple(compute), comm_cpus=tuple(comm),
                   data_cpus=tuple(data), threads=len(compute), source=source)


def _ranges(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``0-2,5``."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
