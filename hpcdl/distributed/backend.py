"""The communication backends, as one table: name, availability check, per-rank environment, factory.

A backend is a row of :data:`BACKENDS`. ``auto`` takes the first of :data:`AUTO_ORDER` whose check
passes. Adding a library is one file (a :class:`hpcdl.distributed.group.python_backend.ThreadedProcessGroup` subclass with
a ``register()``) and one row here.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.metadata
import os
import socket
import struct
from collections.abc import Callable, Mapping

from hpcdl import names
from hpcdl.deferred import deferred
from hpcdl.distributed.affinity import CpuPlan
from hpcdl.distributed.ranks.env import RankEnv
from hpcdl.errors import ConfigError
from hpcdl.names import registry

__all__ = ["AUTO_ORDER", "BACKENDS", "Backend", "BackendChoice", "ccl_environment", "choose_backend", "gloo_check",
           "interface_to"]


@dataclasses.dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # the torch.distributed backend name
    reason: str
    comm_threads: int = 0  # CPUs the CPU plan keeps for the library's own threads


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """One row of the table."""

    name: str  # what users write: --backend NAME, loop.backend
    torch_name: str  # what it registers as in torch.distributed
    # "module:function" called with the user's libccl (or None): what runs, for the log; a ConfigError saying how to
    # fix it when unavailable. Named, not imported: the libraries' modules import the group core, which reads this table
    check: str
    # "module:function" that registers the torch backend (the module imports torch); None: built into torch
    register: str | None = None
    environment: Callable[[RankEnv, CpuPlan, Mapping[str, str]], dict[str, str]] | None = None  # variables to set
    comm_threads: Callable[[Mapping[str, str]], int] = lambda environ: 0

    def __post_init__(self):
        for field, value in (("check", self.check), ("register", self.register)):
            if value is not None and (not isinstance(value, str) or ":" not in value):
                raise TypeError(f"backend {self.name}: its {field} is named as \"module:function\", not {value!r}")

    def available(self, lib: str | None = None) -> str:
        """What runs for this row (its ``check``); a ConfigError when it cannot run here, its check's module that does
        not import included (naming the row)."""
        try:
            check = deferred(self.check)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"backend {self.name}: its check {self.check} does not import: {exc}") from exc
        return check(lib)

    def prepare(self, env: RankEnv | None, cpu: CpuPlan | None, liveness=None) -> None:
        """Set this row's variables for the rank (those the user exported stay; ``env`` and ``cpu`` are needed
        only by a row with variables), then register it with torch, its groups' watchdogs asking ``liveness``
        (a :class:`hpcdl.distributed.group.python_backend.Liveness`) about a long collective: what a rank does before it
        joins."""
        if self.environment:
            os.environ.update(self.environment(env, cpu, os.environ))
        if self.register:
            deferred(self.register)(liveness)


def gloo_check(lib: str | None = None) -> str:
    return f"torch {importlib.metadata.version('torch')}'s gloo"


def ccl_environment(env: RankEnv, plan: CpuPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """oneCCL's variables for this rank; a value the user exported wins.

    - ``CCL_WORKER_OFFLOAD=0``: by default oneCCL starts a worker thread pinned to a core of its own
      choosing, whatever the process's CPU mask; where ranks share cores that made a 4-byte all-reduce
      take 11 ms instead of 0.11 ms (docs/communication.md). hpcdl's communication thread makes the
      calls instead. A user who turns offload on gets the workers pinned to the CPU plan's communication
      CPUs, inside the rank's mask.
    - No launcher of oneCCL's: communicators come from unique ids through hpcdl's rendezvous store
      (``CCL_PROCESS_LAUNCHER=none``, with the local rank and size from the launch).
    - The transport is libfabric's: ``shm`` when the job is on one node, ``tcp`` across nodes (with
      ``CCL_ATL_SHM=1`` for the ranks that share a node), or ``HPCDL_FI_PROVIDER`` across nodes (the
      cluster profile's, which hpcdl's sbatch scripts export: psm2 on Omni-Path, verbs on InfiniBand); a
      ``FI_PROVIDER`` the site's module exports wins. ``CCL_KVS_IFACE`` and ``FI_TCP_IFACE`` name the
      interface that reaches the rendezvous address.
    """
    wanted = {"CCL_WORKER_OFFLOAD": "0", "CCL_PROCESS_LAUNCHER": "none", "CCL_ATL_TRANSPORT": "ofi", "CCL_LOG_LEVEL": "error",
              "CCL_LOCAL_RANK": str(env.local_rank), "CCL_LOCAL_SIZE": str(env.local_size)}
    if environ.get("CCL_WORKER_OFFLOAD", "0") != "0":
        wanted["CCL_WORKER_COUNT"] = str(max(1, len(plan.comm_cpus)))
        if plan.comm_cpus:
            wanted["CCL_WORKER_AFFINITY"] = ",".join(map(str, plan.comm_cpus))
    if env.nodes == 1:
        wanted |= {"FI_PROVIDER": "shm", "CCL_ATL_SHM": "1"}
    else:
        wanted["FI_PROVIDER"] = environ.get("HPCDL_FI_PROVIDER") or "tcp"
        if env.local_size > 1:
            wanted["CCL_ATL_SHM"] = "1"
    iface = interface_to(env.master_addr)
    if iface:
        wanted["CCL_KVS_IFACE"] = iface
        if environ.get("FI_PROVIDER", wanted["FI_PROVIDER"]) == "tcp":
            wanted["FI_TCP_IFACE"] = iface
    return {k: v for k, v in wanted.items() if k not in environ}


def interface_to(address: str) -> str | None:
    """The name of the local interface whose address routes to ``address`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(address), 9))
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    found = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:  # no IPv4 address on it
                    continue
                if socket.inet_ntoa(found[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


BACKENDS: dict[str, Backend] = registry("backends", {b.name: b for b in (
    Backend("gloo", "gloo", "hpcdl.distributed.backend:gloo_check"),
    Backend("mpi", "mpi4py", "hpcdl.distributed.mpi.runtime:describe", "hpcdl.distributed.mpi.group:register"),
    Backend("ccl", "oneccl", "hpcdl.distributed.ccl.library:describe", "hpcdl.distributed.ccl.group:register",
            ccl_environment,
            lambda environ: 1 if environ.get("CCL_WORKER_OFFLOAD", "0") != "0" else 0),
)}, names.BACKENDS)
AUTO_ORDER = ("ccl", "gloo")


def choose_backend(requested: str, *, ccl_lib: str | None = None,
                   environ: Mapping[str, str] | None = None) -> tuple[Backend, BackendChoice]:
    """The table's row for ``requested`` (or ``auto``'s pick) and the choice to log; a ConfigError when the
    requested backend cannot run here, saying how to fix it."""
    environ = os.environ if environ is None else environ
    names.check("backend", requested, ("auto", *BACKENDS))
    if requested != "auto":
        row = BACKENDS[requested]
        return row, BackendChoice(row.torch_name, f"requested: {row.available(ccl_lib)}", row.comm_threads(environ))
    skipped = []
    for name in AUTO_ORDER:
        row = BACKENDS[name]
        try:
            what = row.available(ccl_lib)
        except ConfigError as exc:
            skipped.append(f"not {name}: {exc}")
            continue
        return row, BackendChoice(row.torch_name, "; ".join([f"auto: {what}", *skipped]), row.comm_threads(environ))
    raise ConfigError("auto: no backend runs here: " + "; ".join(skipped))
