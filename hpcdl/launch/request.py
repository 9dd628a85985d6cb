"""A job request: what ``hpcdl sbatch``, ``hpcdl submit`` and :func:`hpcdl.launch.submit` ask Slurm for.

It is checked against the cluster profile before anything is submitted, so an impossible request
fails on the login node with the fix in the message, not after hours in the queue.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from hpcdl.errors import ConfigError
from hpcdl.flags import meta
from hpcdl.launch.layout import load_layout
from hpcdl.launch.profiles import ClusterProfile, get_profile
from hpcdl.names import ALLOCATOR_CHOICES
from hpcdl.utils import format_duration, parse_duration

__all__ = ["JobRequest", "job_request"]


@dataclasses.dataclass(kw_only=True, slots=True)
class JobRequest:
    profile: str = "generic"  # the cluster profile (hpcdl profiles lists them)
    nodes: int = 1  # nodes to allocate
    tasks_per_node: int = 1  # ranks per node; one per socket is a good start
    cpus_per_task: int | None = None  # cores per rank (default: the profile's cores per node / tasks per node)
    time: str = "01:00:00"  # wall clock: MM, HH:MM:SS or D-HH:MM:SS
    job_name: str = "hpcdl"  # the name squeue shows
    output: str = "hpcdl-%j.out"  # Slurm's output path (%j: the job id)
    partition: str | None = None  # the Slurm partition (default: the profile's)
    account: str | None = None  # the allocation to charge
    qos: str | None = None  # the quality of service to run under (Slurm --qos)
    python: str | None = None  # the interpreter with hpcdl on the compute nodes (sbatch: python3 on PATH; submit: this one)
    # the memory allocator every rank preloads (auto: the first that loads, in the order listed after none)
    allocator: str = dataclasses.field(default="auto", metadata=meta(choices=ALLOCATOR_CHOICES))
    # a node layout from hpcdl tune --measure: its ranks per node, cores per rank and allocator replace the three
    # above, and a train command gets its precision and memory format
    layout: str | None = dataclasses.field(default=None, metadata=meta(metavar="LAYOUT.json"))
    # a train command: allocate this many nodes more, kept idle; when a node is lost the job goes on, on a spare
    # (hpcdl supervise, in the batch script: docs/reliability.md). hpcdl sbatch only
    spares: int = 0
    # a train command: restarts of the training step inside the allocation after a lost rank or node, each from
    # the survivors' just-in-time checkpoint (0 with no spares: one failed rank ends the job, as srun's
    # --kill-on-bad-exit does). hpcdl sbatch only
    max_restarts: int = 0

    def __post_init__(self):
        if self.layout:
            chosen = load_layout(self.layout)
            self.tasks_per_node, self.cpus_per_task = chosen.ranks_per_node, chosen.cpus_per_task
            self.allocator = chosen.allocator
        prof = get_profile(self.profile)
        for name in ("nodes", "tasks_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.spares < 0 or self.max_restarts < 0:
            raise ConfigError(f"spares={self.spares} and max_restarts={self.max_restarts} must be >= 0")
        if self.spares and not self.max_restarts:
            self.max_restarts = max(3, self.spares)  # a spare serves only a restart: --spares 4 needs 4
        if self.cpus_per_task is None and prof.cores_per_node:
            self.cpus_per_task = max(1, prof.cores_per_node // self.tasks_per_node)
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"cpus_per_task={self.cpus_per_task} must be >= 1")
        if self.allocator not in ALLOCATOR_CHOICES:
            raise ConfigError(f"allocator={self.allocator!r}; choose one of {', '.join(ALLOCATOR_CHOICES)}")
        for name in ("job_name", "output", "partition", "account", "qos", "python", "time"):
            value = getattr(self, name)
            if value is not None and any(c in value for c in "\n\r\0"):
                raise ConfigError(f"{name}={value!r} contains a newline or NUL, which no Slurm directive can carry")
        if "\\" in self.output:
            raise ConfigError(f"output={self.output!r} contains a backslash: Slurm drops it from output paths and then "
                              "leaves %j unexpanded, so the file would go elsewhere; choose a path without '\\'")
        _check_against(self, prof)

    @property
    def cluster_profile(self) -> ClusterProfile:
        return get_profile(self.profile)

    @property
    def walltime(self) -> timedelta:
        return parse_duration(self.time, "time")

    @property
    def partition_name(self) -> str | None:
        return self.partition or self.cluster_profile.partition

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def allocated_nodes(self) -> int:
        return self.nodes + self.spares

    @property
    def supervised(self) -> bool:
        """Whether the batch script runs hpcdl supervise, which restarts the step inside the allocation."""
        return bool(self.spares or self.max_restarts)


def _check_against(req: JobRequest, prof: ClusterProfile) -> None:
    used = req.tasks_per_node * (req.cpus_per_task or 1)
    if prof.cores_per_node and used > prof.cores_per_node:
        raise ConfigError(
            f"{req.tasks_per_node} tasks per node x {req.cpus_per_task or 1} CPUs per task = {used} CPUs, but a "
            f"{prof.name} node has {prof.cores_per_node} cores; choose tasks_per_node x cpus_per_task <= "
            f"{prof.cores_per_node} (e.g. {prof.cores_per_node // req.tasks_per_node or 1} CPUs per task)")
    if prof.max_nodes and req.allocated_nodes > prof.max_nodes and req.partition is None:
        asked = f"nodes={req.nodes}" + (f" + spares={req.spares}" if req.spares else "")
        raise ConfigError(f"{asked} exceeds the {prof.max_nodes} nodes that partition {prof.partition} of "
                          f"{prof.name} allows; ask for <= {prof.max_nodes} nodes or name a larger --partition. "
                          f"{prof.notes}".rstrip())
    wall = req.walltime
    if wall <= timedelta(0):
        raise ConfigError(f"time={req.time!r} must be positive")
    if prof.max_time and wall > prof.max_time:
        raise ConfigError(f"time={req.time} ({format_duration(wall)}) exceeds the {format_duration(prof.max_time)} "
                          f"limit of {prof.name} partition {req.partition_name}; ask for <= {format_duration(prof.max_time)} "
                          "and let the job checkpoint and requeue")


def job_request(**params) -> JobRequest:
    """Build a :class:`JobRequest`; an unknown parameter is an error that lists every valid one."""
    fields = {f.name: f for f in dataclasses.fields(JobRequest)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        valid = "\n".join(f"  {name} (default {f.default!r})" for name, f in fields.items())
        raise ConfigError(f"unknown job parameter(s) {', '.join(unknown)}; valid parameters:\n{valid}")
    return JobRequest(**params)
