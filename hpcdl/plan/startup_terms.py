"""The start-up and restart terms of ``hpcdl plan``: the time from the ranks' start to the first step, at N nodes.

Each term is a count that ``hpcdl bench startup`` measured against the number of ranks, over what the resource
that serves it delivers (docs/scaling.md, "Start-up and restart"):

- imports: each rank opens ``python_files`` files of the Python environment. On a parallel filesystem every
  open is a request to its metadata servers, which serve about ``fs_opens_per_s`` for the whole machine: the
  ranks' opens queue behind each other, ``ranks x files / opens_per_s``, on top of the imports' own time on
  one node (``local_import_s``: the interpreter's work when the files are at hand). With ``--stage-env``
  each node reads one archive of the environment (``env_bytes``) instead, at the filesystem's aggregate
  bandwidth, and unpacks it to local disk; the ranks then import from there.
- rendezvous: each rank sends ``a + b N`` requests to rank 0's store (gloo's full mesh: ``b`` about 4), which
  answers ``store_requests_per_s``; the ``N (a + b N)`` requests queue at rank 0.
- checkpoint (restart only): rank 0 reads it once at one reader's bandwidth and the job's group broadcasts
  it, a binomial tree of ``log2(N)`` steps of the whole checkpoint over the network.
- first step: the step model's step.
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl.errors import ConfigError
from hpcdl.plan.cost import Link

__all__ = ["StartupModel"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StartupModel:
    ranks_per_node: int
    python_files: float  # files of the environment each rank opens to its first step
    local_import_s: float  # the imports' time on one node with the files at hand (the smallest job measured)
    rendezvous_requests: tuple[float, float]  # (a, b): requests per rank to rank 0's store, a + b N
    store_requests_per_s: float  # what rank 0's store answers
    fs_opens_per_s: float  # the shared filesystem's metadata rate, opens per second for all clients together
    fs_read_bytes_s: float  # one reader's bandwidth from the shared filesystem (rank 0 reading the checkpoint)
    fs_bandwidth_bytes_s: float  # the shared filesystem's aggregate bandwidth (every node reading the archive)
    checkpoint_bytes: float
    env_bytes: float  # the environment's archive (--stage-env)
    network: Link
    staged: bool = False  # hpcdl sbatch --stage-env

    def __post_init__(self):
        for name in ("fs_opens_per_s", "fs_read_bytes_s", "fs_bandwidth_bytes_s", "store_requests_per_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be more than 0")

    def terms(self, nodes: int, step_s: float) -> dict[str, float]:
        ranks = nodes * self.ranks_per_node
        shared = ranks * self.python_files / self.fs_opens_per_s
        stage = nodes * self.env_bytes / self.fs_bandwidth_bytes_s if self.staged else 0.0
        imports = self.local_import_s + (stage if self.staged else shared)
        a, b = self.rendezvous_requests
        rendezvous = ranks * (a + b * ranks) / self.store_requests_per_s
        levels = math.ceil(math.log2(ranks)) if ranks > 1 else 0
        checkpoint = self.checkpoint_bytes / self.fs_read_bytes_s + levels * (
            self.network.latency_s + self.checkpoint_bytes / self.network.bandwidth_bytes_s)
        startup = imports + rendezvous + step_s
        return {"imports_s": imports, "imports_shared_fs_s": self.local_import_s + shared,
                "imports_staged_s": self.local_import_s + nodes * self.env_bytes / self.fs_bandwidth_bytes_s,
                "rendezvous_s": rendezvous, "checkpoint_s": checkpoint, "first_step_s": step_s,
                "startup_s": startup, "restart_s": startup + checkpoint}
