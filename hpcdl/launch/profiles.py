"""Cluster profiles: the facts about a machine that a job request is checked against.

Each profile names its source (``source``) and what could not be confirmed there (``unconfirmed``);
a site that differs gets its own profile, or ``generic`` with explicit flags. Stampede2 is retired
(replaced by Stampede3 in 2024): its profiles stay, marked so, for reproducing the published runs.

Per-core FLOPs per cycle are the vendors' arithmetic: AVX-512 with two FMA units gives 64 fp32 FLOPs a
cycle; AMX gives 1,024 bf16 FLOPs a cycle (a TMUL op, 16 x 32 x 16 bf16 multiply-adds, every 16 cycles,
as Intel's optimization manual gives it). ``bf16_flops_per_cycle`` is None where bf16 is emulated (no
avx512_bf16 or AMX): ``hpcdl plan --precision bf16`` refuses such a node.

The storage figures (``hpcdl plan``'s data path, :mod:`hpcdl.plan.data_path`) cite ``storage_source``; a figure
the source does not state stays None, and the plan asks for its flag (``--fs-gb-s``, ``--fs-opens-per-s``,
``--local-disk-gb``) rather than assume one.
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
    numa_per_node: int | None = None  # NUMA domains a node shows (sockets x sub-NUMA clusters)
    hbm_gb_per_node: int | None = None  # on-package HBM
    cpu_flags: str = ""  # the ISA features that matter here (hpcdl.train.precision reads the same names)
    bf16_flops_per_cycle: int | None = None  # per core; None: bf16 is emulated on this node
    # bf16 autocast's step against fp32's on this node type, measured (hpcdl bench step's precision table)
    bf16_step_speedup: float | None = None
    retired: bool = False  # the machine is gone; kept to reproduce published runs
    storage: str = ""  # the scratch filesystem a job reads its data from, as storage_source describes it
    fs_gb_s: float | None = None  # its aggregate read bandwidth, GB/s; None: the source states none
    fs_opens_per_s: float | None = None  # its metadata rate, opens/s for all clients together; None: not stated
    local_disk_gb: float | None = None  # node-local disk a job may stage to (/tmp, $TMPDIR), GB
    storage_source: str = ""  # where storage, fs_gb_s, fs_opens_per_s and local_disk_gb come from
    source: str = ""  # where the numbers come from
    unconfirmed: str = ""  # what the source did not confirm
    notes: str = ""

    @property
    def peak_fp32_tflops(self) -> float | None:
        """The node's nominal fp32 peak: cores x clock x FLOPs per cycle (vendors' own arithmetic)."""
        if not (self.cores_per_node and self.clock_ghz and self.fp32_flops_per_cycle):
            return None
        return self.cores_per_node * self.clock_ghz * self.fp32_flops_per_cycle / 1e3

    @property
    def peak_bf16_tflops(self) -> float | None:
        if not (self.cores_per_node and self.clock_ghz and self.bf16_flops_per_cycle):
            return None
        return self.cores_per_node * self.clock_ghz * self.bf16_flops_per_cycle / 1e3



STAMPEDE2_GUIDE = "TACC Stampede2 user guide (final version, 2023); the machine was retired in 2024"
FRONTERA_GUIDE = "TACC Frontera user guide (2023)"
STAMPEDE3_SOURCES = ("Cornell Virtual Workshop, 'RAM arrangement in HPC clusters' (Stampede3: 1,864 nodes; SKX 1,060 x "
                     "2x 8160, 48 cores, 192 GB DDR4; ICX 224 x 2x 8380); The Next Platform, 2023-07-24, and TACC's "
                     "2023 announcement (SPR: 560 nodes, Xeon CPU Max, 56 cores and 64 GB HBM2e a socket, HBM-only)")
TACC_DOCS = "TACC-Docs (TACC's user guides, github.com/TACC/TACC-Docs; read in the fork kbeavers/TACC-Docs at 2b0cfc7)"
STAMPEDE2_STORAGE = (f"Stampede2 user guide, final version, in {TACC_DOCS}, docs/archives/hpc/stampede2: $SCRATCH "
                     "Lustre, ~30 PB, 4 MDSs, 66 OSTs, 1 stripe of 1 MB by default, no bandwidth stated; /tmp: SKX "
                     "144 GB on a 200 GB SSD (as of 2017-11-14), KNL 107 GB on a 200 GB SSD but 32 GB on the 504 "
                     "former Stampede1 KNL nodes (queues development, long, flat-quadrant; as of 2018-04-24)")
STAMPEDE2_SCRATCH = "Lustre $SCRATCH (~30 PB, 4 MDSs, 66 OSTs)"
STAMPEDE3_STORAGE = (f"Stampede3 user guide in {TACC_DOCS}, docs/hpc/stampede3 (system.md, files.md): $SCRATCH on a "
                     "shared VAST filesystem (not Lustre: no stripe settings), ~10 PB, no bandwidth stated; /tmp: SKX "
                     "90 GB, ICX 200 GB, SPR 150 GB")
STAMPEDE3_SCRATCH = "VAST $SCRATCH (~10 PB; not Lustre)"
STAMPEDE3_UNCONFIRMED = ("TACC's Stampede3 user guide was not among the stored copies searched (2026-11-24): the "
                         "queue names and limits (skx 256, icx 32, spr 180 nodes; 48 h), ICX's 256 GB and the "
                         "fabric's libfabric provider are from memory of it: check 'qlimits', 'sinfo' and 'fi_info' "
                         "on a login node")

PROFILES: dict[str, ClusterProfile] = {p.name: p for p in (
    ClusterProfile(
        name="stampede2-skx", description="TACC Stampede2 (retired), Skylake nodes: 2x Xeon Platinum 8160",
        retired=True, numa_per_node=2, cpu_flags="avx512f", source=STAMPEDE2_GUIDE,
        partition="skx-normal", cores_per_node=48, mem_gb_per_node=192, max_time=timedelta(hours=48),
        max_nodes=128, network="Intel Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=2, clock_ghz=2.1, fp32_flops_per_cycle=64,  # AVX-512, 2 FMA units: 6.45 TFLOPS a node
        fi_provider="psm2",  # Omni-Path's native provider
        storage=STAMPEDE2_SCRATCH, local_disk_gb=144, storage_source=STAMPEDE2_STORAGE,
        notes="Use skx-large for 129-868 nodes. 2 sockets x 24 cores: 2 or 4 ranks per node usually beat 1."),
    ClusterProfile(
        name="stampede2-knl", description="TACC Stampede2 (retired), Knights Landing nodes: Xeon Phi 7250",
        retired=True, numa_per_node=1, hbm_gb_per_node=16, cpu_flags="avx512f", source=STAMPEDE2_GUIDE,
        partition="normal", cores_per_node=68, mem_gb_per_node=96, max_time=timedelta(hours=48),
        max_nodes=256, network="Intel Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=1, clock_ghz=1.4, fp32_flops_per_cycle=64,  # AVX-512, 2 VPUs: 6.09 TFLOPS a node
        fi_provider="psm2", storage=STAMPEDE2_SCRATCH, local_disk_gb=107, storage_source=STAMPEDE2_STORAGE,
        notes=("16 GB MCDRAM per node. In cache-quadrant mode (partition normal) it acts as a cache and needs "
               "nothing. In flat mode (partitions *-flat-quadrant) it is NUMA node 1: wrap the command in "
               "'numactl --preferred=1' so tensors land in MCDRAM. Use 'large' for 257-2048 nodes. /tmp holds 107 GB "
               "(32 GB on the development, long and flat-quadrant nodes: ImageNet-1K does not fit there).")),
    ClusterProfile(
        name="frontera-clx", description="TACC Frontera, Cascade Lake nodes: 2x Xeon Platinum 8280",
        numa_per_node=2, cpu_flags="avx512f avx512_vnni", source=FRONTERA_GUIDE,
        unconfirmed="the queue limits (normal: 512 nodes, 48 h) are the 2023 guide's; check 'qlimits' on Frontera",
        partition="normal", cores_per_node=56, mem_gb_per_node=192, max_time=timedelta(hours=48),
        max_nodes=512, network="Mellanox InfiniBand HDR-100 (fat tree)", network_latency_us=1.0, network_gb_s=12.5,
        sockets=2, clock_ghz=2.7, fp32_flops_per_cycle=64,  # AVX-512, 2 FMA units: 9.68 TFLOPS a node
        fi_provider="verbs;ofi_rxm",  # InfiniBand: verbs with the reliable-messaging utility provider
        storage="Lustre /scratch1, the default $SCRATCH (10.6 PB, 16 OSTs; /scratch3: 32 OSTs, 120 GB/s)", fs_gb_s=60,
        local_disk_gb=144, storage_source=(f"Frontera user guide in {TACC_DOCS}, docs/hpc/frontera: files.md Table 2a "
                                           "(/scratch1 60 GB/s, /scratch3 120 GB/s), system.md (144 GB /tmp on a "
                                           "240 GB SSD)"),
        notes="Use 'large' for 513-2048 nodes. Set GLOO_SOCKET_IFNAME=ib0 so gloo uses the fabric."),
    ClusterProfile(
        name="stampede3-skx", description="TACC Stampede3, Skylake nodes: 2x Xeon Platinum 8160 (the published runs' nodes)",
        partition="skx", cores_per_node=48, mem_gb_per_node=192, max_time=timedelta(hours=48), max_nodes=256,
        network="Cornelis Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5, sockets=2,
        numa_per_node=2, clock_ghz=2.1, fp32_flops_per_cycle=64, cpu_flags="avx512f", fi_provider="psm2",
        storage=STAMPEDE3_SCRATCH, local_disk_gb=90, storage_source=STAMPEDE3_STORAGE,
        source=STAMPEDE3_SOURCES, unconfirmed=STAMPEDE3_UNCONFIRMED,
        notes="1,060 nodes. bf16 is emulated on Skylake: train fp32 (loop.precision=auto does). skx-dev for tests."),
    ClusterProfile(
        name="stampede3-icx", description="TACC Stampede3, Ice Lake nodes: 2x Xeon Platinum 8380",
        partition="icx", cores_per_node=80, mem_gb_per_node=256, max_time=timedelta(hours=48), max_nodes=32,
        network="Cornelis Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5, sockets=2,
        numa_per_node=2, clock_ghz=2.3, fp32_flops_per_cycle=64, cpu_flags="avx512f avx512_vnni", fi_provider="psm2",
        storage=STAMPEDE3_SCRATCH, local_disk_gb=200, storage_source=STAMPEDE3_STORAGE,
        source=STAMPEDE3_SOURCES, unconfirmed=STAMPEDE3_UNCONFIRMED,
        notes="224 nodes. No avx512_bf16 or AMX on Ice Lake: bf16 is emulated, train fp32."),
    ClusterProfile(
        name="stampede3-spr", description="TACC Stampede3, Sapphire Rapids HBM nodes: 2x Xeon CPU Max 9480",
        partition="spr", cores_per_node=112, mem_gb_per_node=128, max_time=timedelta(hours=48), max_nodes=180,
        network="Cornelis Omni-Path 100 Gb/s (fat tree)", network_latency_us=1.0, network_gb_s=12.5, sockets=2,
        numa_per_node=8, hbm_gb_per_node=128, clock_ghz=1.9, fp32_flops_per_cycle=64, bf16_flops_per_cycle=1024,
        cpu_flags="avx512f avx512_bf16 amx_bf16 amx_tile", bf16_step_speedup=2.1, fi_provider="psm2",
        storage=STAMPEDE3_SCRATCH, local_disk_gb=150, storage_source=STAMPEDE3_STORAGE,
        source=STAMPEDE3_SOURCES + "; bf16_step_speedup: ResNet-50, batch 32, bf16 autocast against fp32 on a Xeon "
               "with AMX, 2 cores (13.5 against 6.4 images/s, issue 22)",
        unconfirmed=STAMPEDE3_UNCONFIRMED + "; the 8 NUMA domains (2 sockets x SNC4) are Intel's default for the "
                    "Xeon CPU Max in HBM-only mode, not TACC's word: 'numactl -H' on a node tells",
        notes=("560 nodes. All 128 GB are HBM2e (no DDR): memory per node is tight for large per-rank batches. "
               "AMX bf16: loop.precision=auto trains bf16. One rank per socket (or per NUMA domain: hpcdl tune "
               "--measure chooses) with oneDNN's AMX kernels, as Intel's MLPerf v3.0 ResNet-50 on Xeon 8480+ did.")),
    ClusterProfile(
        name="generic", description="Any Slurm cluster: nothing assumed, the scheduler checks the request",
        partition=None, cores_per_node=None, mem_gb_per_node=None, max_time=None, max_nodes=None),
    ClusterProfile(
        name="local", description="This machine's Slurm (slurm/local/up.sh starts one: nodes n1 and n2; "
                                  "--partition wide: 16 nodes sharing this host's cores)",
        partition="debug", cores_per_node=max(2, os.cpu_count() or 1), mem_gb_per_node=None, max_time=None,
        max_nodes=16),
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
