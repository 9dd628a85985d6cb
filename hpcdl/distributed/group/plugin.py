"""hpcdl's process groups as torch.distributed plugins: ``dist.init_process_group("oneccl")`` (or
``"mpi4py"``, or ``"cpu:oneccl"``) in a script that never imports hpcdl.

torch 2.14 looks up a backend name it does not know among the entry points of the group
``torch.distributed.backends`` and calls the function that entry point names
(``Backend._ensure_backend_registered`` in ``torch/distributed/distributed_c10d.py``). That happens when the
group is created, after the rendezvous. ``pip install hpcdl`` declares :func:`oneccl` and :func:`mpi4py`
there (setup.py).

Each registrar does for a plain script what :func:`hpcdl.distributed.group.lifecycle.init_distributed` does
for hpcdl's trainer, less the CPU pinning, which stays the script's. It sets the library's per-rank
variables from the backend table (worker offload, transport, interfaces: the user's exports win), finds
the runtime where hpcdl's trainer finds it, and registers the group. A runtime that cannot run here is a
:class:`~hpcdl.errors.ConfigError` that says how to install it. torch would otherwise report "Invalid
backend".
"""

from __future__ import annotations

import logging
import os

from hpcdl.distributed.affinity import plan_cpus
from hpcdl.distributed.backend import BACKENDS
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import ConfigError

__all__ = ["mpi4py", "oneccl", "register"]

log = logging.getLogger(__name__)


def register(name: str) -> str:
    """Register the backend table's row ``name`` with torch, its environment set for this rank; what runs."""
    row = BACKENDS[name]
    try:
        what = row.available(None)
    except ConfigError as exc:
        raise ConfigError(f"torch.distributed backend {row.torch_name!r} (hpcdl's plugin) cannot run here: {exc}") \
            from None
    env = plan = None
    if row.environment:  # oneCCL reads its variables when its first communicator starts, after this
        env = discover()
        plan = plan_cpus(local_rank=env.local_rank, local_size=env.local_size,
                         comm_threads=row.comm_threads(os.environ))
    row.prepare(env, plan)  # what init_distributed does: the variables, then torch's registration
    log.info("torch.distributed backend %s registered by hpcdl's plugin: %s", row.torch_name, what)
    return what


def oneccl() -> None:
    """The entry point ``oneccl``: hpcdl's oneCCL group."""
    register("ccl")


def mpi4py() -> None:
    """The entry point ``mpi4py``: hpcdl's MPI group (through mpi4py; torch's own ``mpi`` needs a torch built
    with MPI)."""
    register("mpi")
