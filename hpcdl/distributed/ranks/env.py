"""Rank discovery: who am I in this job, and where do the ranks meet?

The launchers' variables are data. Each row of :data:`LAUNCHERS` names the variable that tells its
launcher is in charge and the variables it sets; the first row whose marker is present wins. The
order matters: under ``mpiexec`` inside an sbatch allocation every rank inherits ``SLURM_PROCID=0``,
so the MPI rows come before Slurm's, and the Slurm row needs a job *step* (``srun``): in the batch
script itself ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N`` describe the allocation, not this process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping

from hpcdl.distributed.ranks.hostlist import expand_hostlist
from hpcdl.errors import ConfigError

__all__ = ["LAUNCHERS", "Launcher", "RankEnv", "discover", "launcher_ends_survivors", "rank_and_world",
           "rendezvous_port", "resolve_node_address"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Launcher:
    """Where one launcher puts each fact; ``None`` means it does not say and hpcdl derives it."""

    name: str
    marker: str
    rank: str
    world_size: str
    local_rank: str | None
    local_size: str | None
    node_rank: str | None
    nodes: str | None


LAUNCHERS: tuple[Launcher, ...] = (
    # torchrun, or the variables set by hand (torch's env:// convention).
    Launcher(name="torchrun", marker="RANK", rank="RANK", world_size="WORLD_SIZE",
             local_rank="LOCAL_RANK", local_size="LOCAL_WORLD_SIZE",
             node_rank="GROUP_RANK", nodes="GROUP_WORLD_SIZE"),
    Launcher(name="openmpi", marker="OMPI_COMM_WORLD_RANK", rank="OMPI_COMM_WORLD_RANK",
             world_size="OMPI_COMM_WORLD_SIZE", local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
             local_size="OMPI_COMM_WORLD_LOCAL_SIZE", node_rank=None, nodes=None),
    # MPICH and Intel MPI hydra. `srun --mpi=pmi2` sets PMI_RANK too, but not MPI_LOCALRANKID:
    # that case falls through to the Slurm row, which is right for it.
    Launcher(name="mpi-hydra", marker="MPI_LOCALRANKID", rank="PMI_RANK", world_size="PMI_SIZE",
             local_rank="MPI_LOCALRANKID", local_size="MPI_LOCALNRANKS", node_rank=None, nodes=None),
    Launcher(name="slurm", marker="SLURM_STEP_NUM_TASKS", rank="SLURM_PROCID",
             world_size="SLURM_STEP_NUM_TASKS", local_rank="SLURM_LOCALID", local_size=None,
             node_rank="SLURM_NODEID", nodes="SLURM_STEP_NUM_NODES"),
    Launcher(name="submitit-local", marker="SUBMITIT_LOCAL_GLOBALID", rank="SUBMITIT_LOCAL_GLOBALID",
             world_size="SUBMITIT_LOCAL_NTASKS", local_rank="SUBMITIT_LOCAL_LOCALID",
             local_size="SUBMITIT_LOCAL_NTASKS", node_rank="SUBMITIT_LOCAL_NODEID",
             nodes="SUBMITIT_LOCAL_JOB_NUM_NODES"),
)

# Slurm's node list for the step first: a step may run on fewer nodes than the job holds.
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
PORT_BASE, PORT_SPAN = 15000, 15000  # below Linux's ephemeral range (32768-60999)
DEFAULT_PORT = 29500  # ranks outside a job that agree on nothing else (plain mpiexec): set MASTER_PORT


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankEnv:
    """This process's place in the job, and the rendezvous point of all ranks."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    hostname: str
    job_id: str | None
    restart_count: int

    def torch_variables(self) -> dict[str, str]:
        """torch's ``env://`` variables for this rank (what torchrun sets), so that a plain script's
        ``init_process_group()`` joins under any launcher (``hpcdl exec``)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_size), "GROUP_RANK": str(self.node_rank),
                "GROUP_WORLD_SIZE": str(self.nodes), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_size}, "
                f"node {self.node_rank}/{self.nodes}, host {self.hostname}) via {self.launcher}; "
                f"rendezvous {self.master_addr}:{self.master_port}")


def discover(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read this process's rank from the first launcher whose marker variable is set."""
    environ = os.environ if environ is None else environ
    launcher = next((row for row in LAUNCHERS if row.marker in environ), None)
    if launcher is None:
        _warn_if_batch_step(environ)
        return _single_process(environ)
    rank, world_size = _rank_and_world(environ, launcher)
    local_rank, local_size, node_rank, nodes = _placement(environ, launcher, rank, world_size)
    master_addr, master_port = _rendezvous(environ, nodes)
    return RankEnv(launcher=launcher.name, rank=rank, world_size=world_size, local_rank=local_rank,
                   local_size=local_size, node_rank=node_rank, nodes=nodes, master_addr=master_addr,
                   master_port=master_port, hostname=socket.gethostname(), job_id=_job_id(environ),
                   restart_count=_restart_count(environ))


def rank_and_world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) alone, for work that needs no rendezvous (e.g. packing a dataset's parts)."""
    environ = os.environ if environ is None else environ
    launcher = next((row for row in LAUNCHERS if row.marker in environ), None)
    return _rank_and_world(environ, launcher) if launcher else (0, 1)


def _rank_and_world(environ: Mapping[str, str], launcher: Launcher) -> tuple[int, int]:
    rank = _int(environ, launcher.rank, launcher)
    world_size = _int(environ, launcher.world_size, launcher)
    if not 0 <= rank < world_size:
        raise ConfigError(f"{launcher.rank}={rank} is outside 0..{world_size - 1} "
                          f"({launcher.world_size}={world_size}); the {launcher.name} environment is inconsistent")
    return rank, world_size


def _single_process(environ: Mapping[str, str]) -> RankEnv:
    port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else _own_port()
    return RankEnv(launcher="single", rank=0, world_size=1, local_rank=0, local_size=1, node_rank=0,
                   nodes=1, master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                   hostname=socket.gethostname(), job_id=_job_id(environ), restart_count=_restart_count(environ))


@functools.cache
def _own_port() -> int:
    """A free port for a process that is the whole job: no other rank has to agree on it, and two such runs
    on one node (a login node, a notebook beside a job) do not meet on one fixed port. One per process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How each launcher takes a rank that dies: whether the others live on to save a just-in-time checkpoint
# (docs/launching.md, "A lost rank under each launcher").
_MPICH_KEEP_GOING = ("-disable-auto-cleanup", "--disable-auto-cleanup", "-disable_auto_cleanup")


def launcher_ends_survivors(env: RankEnv, pid: int | None = None) -> str | None:
    """Why this rank's launcher would end every rank at once when one dies, with the flag that stops it; None
    when it would not, or when hpcdl cannot tell. MPICH's hydra ``mpiexec`` ends the job at a rank's death unless
    started with ``-disable-auto-cleanup``, a flag it passes to no rank: it is read from the command line of the
    ``mpiexec`` above this process (visible on mpiexec's own node). Open MPI's ``mpirun`` ends the job too."""
    if env.launcher == "openmpi":
        return ("Open MPI's mpirun ends every rank when one dies: no survivor saves a just-in-time checkpoint "
                "(Open MPI 5's mpirun --enable-recovery keeps them running; not tested by hpcdl)")
    if env.launcher != "mpi-hydra":
        return None
    args = _launcher_args(pid or os.getpid())
    if args is None or any(a in _MPICH_KEEP_GOING for a in args):
        return None
    return ("mpiexec (MPICH's hydra) ends every rank at once when one dies, before any survivor saves a "
            "just-in-time checkpoint: start it with 'mpiexec -disable-auto-cleanup ...'")


def _launcher_args(pid: int, depth: int = 4) -> list[str] | None:
    """The arguments of the nearest mpiexec or mpirun above ``pid`` (its proxy's parent on mpiexec's node);
    None where none is seen (a remote node, whose proxy ssh or srun started)."""
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except (OSError, ValueError, IndexError):
            return None
        if args and os.path.basename(args[0]).startswith(("mpiexec", "mpirun")):
            return args[1:]
    return None


def _warn_if_batch_step(environ: Mapping[str, str]) -> None:
    ntasks = environ.get("SLURM_NTASKS")
    if ntasks and ntasks != "1":
        log.warning("running in the batch script of a %s-task Slurm job without srun: this is one "
                    "process, not %s ranks. Start it with 'srun' to use every task.", ntasks, ntasks)


def _int(environ: Mapping[str, str], var: str, launcher: Launcher) -> int:
    value = environ.get(var)
    if value is None:
        raise ConfigError(f"{launcher.marker} is set, so the {launcher.name} launcher is in charge, "
                          f"but {var} is missing; set {var} or unset {launcher.marker}")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not an integer ({launcher.name} launcher)") from None


def _placement(environ: Mapping[str, str], launcher: Launcher, rank: int, world_size: int) -> tuple[int, int, int, int]:
    """Local rank, local size, node rank and node count; derived where the launcher is silent."""
    local_rank = _int(environ, launcher.local_rank, launcher) if launcher.local_rank in environ else 0
    if launcher.local_size and launcher.local_size in environ:
        local_size = _int(environ, launcher.local_size, launcher)
    elif launcher.name == "slurm":
        local_size = _slurm_local_size(environ)
    else:
        local_size = 1
    if launcher.node_rank and launcher.node_rank in environ:
        node_rank = _int(environ, launcher.node_rank, launcher)
    else:  # MPI launchers do not say; block placement (the default of mpiexec and srun) is assumed.
        node_rank = rank // local_size
    if launcher.nodes and launcher.nodes in environ:
        nodes = _int(environ, launcher.nodes, launcher)
    else:
        nodes = -(-world_size // local_size)
    return local_rank, local_size, node_rank, nodes


def _slurm_local_size(environ: Mapping[str, str]) -> int:
    """Tasks on this node, from SLURM_STEP_TASKS_PER_NODE such as ``2(x3),1``."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "1"
    per_node: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ConfigError(f"cannot parse SLURM_STEP_TASKS_PER_NODE={spec!r}")
        per_node.extend([int(m.group(1))] * int(m.group(2) or 1))
    node = int(environ.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else per_node[-1]


def _restart_count(environ: Mapping[str, str]) -> int:
    return int(environ.get("SLURM_RESTART_COUNT") or 0)


def _job_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_ID") or environ.get("SUBMITIT_LOCAL_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")


def _rendezvous(environ: Mapping[str, str], nodes: int) -> tuple[str, int]:
    port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else rendezvous_port(environ)
    if "MASTER_ADDR" in environ:
        return environ["MASTER_ADDR"], port
    nodelist = next((environ[v] for v in SLURM_NODELIST_VARS if environ.get(v)), None)
    if nodelist and "SUBMITIT_LOCAL_GLOBALID" not in environ:
        return resolve_node_address(expand_hostlist(nodelist)[0]), port
    if nodes == 1:
        return "127.0.0.1", port
    raise ConfigError(f"{nodes} nodes and no way to find the rendezvous host: not inside a Slurm "
                      "allocation and MASTER_ADDR is unset. Export MASTER_ADDR (rank 0's host) and "
                      "MASTER_PORT to every rank, e.g. 'mpiexec -genv MASTER_ADDR host0 ...'")


def rendezvous_port(environ: Mapping[str, str]) -> int:
    """A port all ranks of one job step agree on without talking.

    Seeded by the job id, the step id and ``SLURM_RESTART_COUNT``: a requeued job gets a new port,
    so it does not meet the sockets of its previous run still in TIME_WAIT.
    """
    job = _job_id(environ)
    if job is None:
        return DEFAULT_PORT
    seed = f"{job}.{environ.get('SLURM_STEP_ID', '')}.{environ.get('SLURM_RESTART_COUNT', '0')}"
    digest = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big")
    return PORT_BASE + digest % PORT_SPAN


def resolve_node_address(node: str) -> str:
    """An address for a Slurm node name: the name itself when it resolves, else the address Slurm
    knows for the node (its NodeAddr), which is what clusters with private node names need."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except socket.gaierror:
        pass
    for cmd in (["scontrol", "show", "node", node, "--oneliner"], ["sinfo", "-h", "-N", "-n", node, "-o", "%o"]):
        addr = _node_addr_from(cmd)
        if addr and addr != node:
            log.info("node name %s does not resolve; using Slurm's NodeAddr %s", node, addr)
            return addr
    raise ConfigError(f"Slurm node {node!r} does not resolve and Slurm knows no other address for it; "
                      "set MASTER_ADDR to an address of that node")


def _node_addr_from(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else (out.strip() or None)
