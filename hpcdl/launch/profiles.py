"""Cluster profiles: the facts about a machine that a job request is checked against.

Numbers come from the centres' user guides (TACC Stampede2 and Frontera) as of their last
published versions; a site that differs gets its own profile, or ``generic`` with explicit flags.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from datetime import timedelta

from hpcdl.errors import ConfigError

__all__ = ["PROFILES", "ClusterProfile", "get_profile"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClusterProfile:
    name: str
    description: str
    partition: str | None          # None: the cluster's default partition
    cores_per_node: int | None     # None: not known, not checked
    mem_gb_per_node: int | None
    max_time: timedelta | None
    max_nodes: int | None
    mpi: str = "pmi2"              # srun --mpi plugin for MPI jobs
    network: str = ""
    network_latency_us: float | None = None  # the fabric's alpha-beta link (hpcdl plan); None: not known
    network_gb_s: float | None = None  # GB/s per direction
    sockets: int = 1  # processors per node: hpcdl plan's default ranks per node
    clock_ghz: float | None = None  # nominal base clock (hpcdl plan's peak FLOPs); None: not known
    fp32_flops_per_cycle: int | None = None  # per core: vector lanes x 2 (FMA) x FMA units
    fi_provider: str = ""  # libfabric provider for backend ccl across nodes (HPCDL_FI_PROVIDER); "": tcp
    notes: str = ""

    @property
    def peak_fp32_tflops(self) -> float | None:
        """The node's nominal fp32 peak: cores x clock x FLOPs per cycle (vendors' own arithmetic)."""
        if not (self.cores_per_node and self.clock_ghz and self.fp32_flops_per_cycle):
            return None
        return self.cores_per_node * self.clock_ghz * self.fp32_flops_per_cycle / 1e3

    def network_link(self):
        """The fabric as an alpha-beta :class:`hpcdl.plan.model.Link`."""
        from hpcdl.plan.model import Link

        if self.network_latency_us is None or self.network_gb_s is None:
            raise ConfigError(f"profile {self.name} has no network latency and bandwidth; measure them with hpcdl "
                              f"bench allreduce (hpcdl plan --allreduce-json) or choose a profile that has them")
        return Link(latency_s=self.network_latency_us * 1e-6, bandwidth_bytes_s=self.network_gb_s * 1e9)


PROFILES: dict[str, ClusterProfile] = {p.name: p for p in (
    ClusterProfile(
        name="stampede2-skx", description="TACC Stampede2, Skylake nodes: 2x Xeon Platinum 8160",
        partition="skx-normal", cores_per_node=48, mem_gb_per_node=192, max_time=timedelta(hours=48),
        max_nodes=128, network="Intel Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=2, clock_ghz=2.1, fp32_flops_per_cycle=64,  # AVX-512, 2 FMA units: 6.45 TFLOPS a node
        fi_provider="psm2",  # Omni-Path's native provider
        notes="Use skx-large for 129-868 nodes. 2 sockets x 24 cores: 2 or 4 ranks per node usually beat 1."),
    ClusterProfile(
        name="stampede2-knl", description="TACC Stampede2, Knights Landing nodes: Xeon Phi 7250",
        partition="normal", cores_per_node=68, mem_gb_per_node=96, max_time=timedelta(hours=48),
        max_nodes=256, network="Intel Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=1, clock_ghz=1.4, fp32_flops_per_cycle=64,  # AVX-512, 2 VPUs: 6.09 TFLOPS a node
        fi_provider="psm2",
        notes=("16 GB MCDRAM per node. In cache-quadrant mode (partition normal) it acts as a cache and needs "
               "nothing. In flat mode (partitions *-flat-quadrant) it is NUMA node 1: wrap the command in "
               "'numactl --preferred=1' so tensors land in MCDRAM. Use 'large' for 257-2048 nodes.")),
    ClusterProfile(
        name="frontera-clx", description="TACC Frontera, Cascade Lake nodes: 2x Xeon Platinum 8280",
        partition="normal", cores_per_node=56, mem_gb_per_node=192, max_time=timedelta(hours=48),
        max_nodes=512, network="Mellanox InfiniBand HDR-100 (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=2, clock_ghz=2.7, fp32_flops_per_cycle=64,  # AVX-512, 2 FMA units: 9.68 TFLOPS a node
        fi_provider="verbs;ofi_rxm",  # InfiniBand: verbs with the reliable-messaging utility provider
        notes="Use 'large' for 513-2048 nodes. Set GLOO_SOCKET_IFNAME=ib0 so gloo uses the fabric."),
    ClusterProfile(
        name="generic", description="Any Slurm cluster: nothing assumed, the scheduler checks the request",
        partition=None, cores_per_node=None, mem_gb_per_node=None, max_time=None, max_nodes=None),
    ClusterProfile(
        name="local", description="This machine's Slurm (slurm/local/up.sh starts one: nodes n1 and n2)",
        partition="debug", cores_per_node=os.cpu_count(), mem_gb_per_node=None, max_time=None, max_nodes=2),
)}


def get_profile(name: str) -> ClusterProfile:
    try:
        return PROFILES[name]
    except KeyError:
        choices = "\n".join(f"  {p.name:14s} {p.description}" for p in PROFILES.values())
        raise ConfigError(f"unknown cluster profile {name!r}; valid profiles:\n{choices}") from None


def slurm_answers() -> bool:
    """True when a Slurm controller answers on this machine (sinfo succeeds)."""
    try:
        subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True
