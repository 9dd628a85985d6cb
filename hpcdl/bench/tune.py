"""``hpcdl tune --measure``: the node layout by short trials on the node at hand (an sbatch job's node, or this
machine).

Each trial is a round of :func:`hpcdl.bench.step.node_round`: the layout's ranks run at once as fresh
processes, started with its allocator, each on its slice of the node's cores (hpcdl's CPU plan), timing
training steps of the model in its precision and memory format. The node's images/s is their sum. The
search goes one choice at a time, each from the best so far:

1. ranks per node: 1, one per socket, one per NUMA domain, two per NUMA domain (those that divide the cores);
2. precision: fp32, and bf16 where the CPU has native bf16 (avx512_bf16 or AMX; emulated bf16 is skipped,
   with the reason);
3. memory format: channels_last, contiguous;
4. allocator: each that loads here (jemalloc, tcmalloc) and glibc with hpcdl's tunables;
5. batch per rank: half, the same, twice. The layout records the smallest batch within 5% of the best
   images/s (advice: the batch is the recipe's).

A layout the node cannot hold is refused before it runs, with the reason: more ranks than cores, or a
batch whose memory, extrapolated from the trials' peak resident sets, exceeds the node's. Then a
confirming run: the winner and the runner-up alternate for ``confirm_rounds`` rounds, and the faster of
the two in that run is the layout written.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import time

from hpcdl.bench.configs import TuneConfig
from hpcdl.bench.reports import NodeRound
from hpcdl.bench.rounds import alternate
from hpcdl.bench.step import node_round
from hpcdl.distributed.affinity import ALLOCATORS, allocator_env, find_library
from hpcdl.errors import ConfigError
from hpcdl.train.precision import NATIVE_BF16
from hpcdl.utils import cpu_flags

__all__ = ["Topology", "TuneConfig", "TuneResult", "measure", "node_topology"]

MEMORY_HEADROOM = 0.85  # of the node's memory a layout may use


@dataclasses.dataclass(frozen=True, slots=True)
class Trial:
    ranks: int
    precision: str = "fp32"
    channels_last: bool = True
    allocator: str = "auto"
    batch: int = 32

    def name(self) -> str:
        return (f"{self.ranks} x {self.threads_label}, {self.precision}, "
                f"{'channels_last' if self.channels_last else 'contiguous'}, {self.allocator}, batch {self.batch}")

    @property
    def threads_label(self) -> str:
        return f"{_cores() // self.ranks} cores"


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    cores: int
    sockets: int
    numa: int  # NUMA domains


@dataclasses.dataclass(frozen=True, slots=True)
class TrialResult:
    trial: Trial
    round: NodeRound


@dataclasses.dataclass(frozen=True, slots=True)
class Confirmation:
    """The confirming run: the trials' winner and runner-up alternated."""

    winner: str
    runner_up: str
    rounds: dict[str, list[float]]  # "winner", "runner-up": images/s per round
    medians: dict[str, float]
    swapped: bool  # the runner-up was faster in this run and wins


@dataclasses.dataclass(frozen=True, slots=True)
class TuneResult:
    topology: Topology
    memory_mb: float  # what this job may use on the node
    trials: tuple[TrialResult, ...]  # fastest first
    refused: dict[str, str]  # trial name -> why the node cannot hold it
    skipped: dict[str, str]  # choice -> why it was not tried
    confirm: Confirmation | None
    winner: Trial
    winner_images_per_s: float
    batch_per_rank: int  # the smallest batch within 5% of the winner's images/s


def node_topology(cpus: set[int] | None = None, sys_root: str = "/sys/devices/system") -> Topology:
    """Sockets and NUMA domains among ``cpus`` (default: this process's), from sysfs; 1 each where it says nothing."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    sockets = set()
    for cpu in cpus:
        try:
            with open(f"{sys_root}/cpu/cpu{cpu}/topology/physical_package_id") as f:
                sockets.add(f.read().strip())
        except OSError:
            pass
    numa = 0
    for path in glob.glob(f"{sys_root}/node/node[0-9]*/cpulist"):
        with open(path) as f:
            if _cpulist(f.read()) & cpus:
                numa += 1
    return Topology(cores=len(cpus), sockets=max(1, len(sockets)), numa=max(1, numa))


def _cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def node_memory_mb() -> float:
    """The memory this job may use on the node: Slurm's per-node allocation where it says, else MemAvailable."""
    if os.environ.get("SLURM_MEM_PER_NODE", "").isdigit():
        return float(os.environ["SLURM_MEM_PER_NODE"])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo")


def rank_counts(topology: Topology) -> list[int]:
    cores, wanted = topology.cores, {1, topology.sockets, topology.numa, 2 * topology.numa}
    return sorted(r for r in wanted if r <= cores and cores % r == 0)


def refusal(trial: Trial, topology: Topology, memory_mb: float,
            rss_per_image_mb: dict[int, tuple[float, float]]) -> str | None:
    """Why the node cannot hold ``trial``, or None."""
    if trial.ranks > topology.cores:
        return f"{trial.ranks} ranks on {topology.cores} cores"
    fit = rss_per_image_mb.get(trial.ranks)
    if fit:
        fixed, per_image = fit
        need = trial.ranks * (fixed + per_image * trial.batch)
        if need > MEMORY_HEADROOM * memory_mb:
            return (f"about {need / 1024:.1f} GB for {trial.ranks} ranks at batch {trial.batch} (from the trials' peak "
                    f"memory), over {MEMORY_HEADROOM:.0%} of the node's {memory_mb / 1024:.1f} GB")
    return None


def measure(cfg: TuneConfig, log=print) -> TuneResult:
    """Every trial's images/s, the refused ones with their reasons, the confirming run, and the winner."""
    topology, memory_mb = node_topology(), node_memory_mb()
    results: dict[Trial, NodeRound] = {}
    refused: dict[str, str] = {}
    rss: dict[int, tuple[float, float]] = {}  # ranks -> (fixed MB, MB per image) per rank

    def run(trial: Trial) -> NodeRound:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF")}
        env.update(allocator_env(trial.allocator)[1])
        spec = {"tuned": True, "model": cfg.model, "batch": trial.batch, "crop": cfg.crop, "steps": cfg.steps,
                "precision": trial.precision, "channels_last": trial.channels_last}
        return node_round(spec, trial.ranks, env)

    def attempt(trial: Trial) -> None:
        if trial in results or trial.name() in refused:
            return
        why = refusal(trial, topology, memory_mb, rss)
        if why:
            refused[trial.name()] = why
            log(f"  refused  {trial.name()}: {why}")
            return
        t0 = time.perf_counter()
        results[trial] = run(trial)
        log(f"  {results[trial].images_per_s:8.2f} images/s  {trial.name()}  ({time.perf_counter() - t0:.0f} s)")

    def best() -> Trial:
        return max(results, key=lambda t: results[t].images_per_s)

    allocators = [a.name for a in ALLOCATORS if a.name == "glibc" or find_library(a)]
    start = Trial(ranks=1, allocator=allocators[0], batch=cfg.batch)
    for ranks in rank_counts(topology):
        attempt(dataclasses.replace(start, ranks=ranks))
    skipped = skipped_choices(cpu_flags())
    if "bf16" not in skipped:
        attempt(dataclasses.replace(best(), precision="bf16"))
    attempt(dataclasses.replace(best(), channels_last=False))
    for allocator in allocators:
        attempt(dataclasses.replace(best(), allocator=allocator))
    top = best()
    per_rank = results[top].peak_rss_mb / top.ranks
    rss[top.ranks] = (per_rank * 0.5, per_rank * 0.5 / top.batch)  # refined below once a second batch ran
    for batch in (max(1, top.batch // 2), top.batch * 2):
        attempt(dataclasses.replace(top, batch=batch))
        done = [t for t in results if dataclasses.replace(t, batch=top.batch) == top]
        if len(done) >= 2:
            rss[top.ranks] = _fit_rss(done, results)
    return _decide(cfg, results, refused, skipped, run, topology, memory_mb)


def skipped_choices(flags: set[str]) -> dict[str, str]:
    """The choices the trials leave out on a CPU with ``flags``, each with the reason the table prints."""
    if set(NATIVE_BF16) & flags:
        return {}
    return {"bf16": "the CPU has no avx512_bf16 or amx_bf16: bf16 is emulated, many times slower than fp32"}


def _fit_rss(trials: list[Trial], results: dict) -> tuple[float, float]:
    """Per rank: peak resident MB = fixed + per_image x batch, through the trials' points."""
    pts = sorted((t.batch, results[t].peak_rss_mb / t.ranks) for t in trials)
    (b1, m1), (b2, m2) = pts[0], pts[-1]
    per_image = max(0.0, (m2 - m1) / (b2 - b1)) if b2 != b1 else m1 / b1
    return m1 - per_image * b1, per_image


def _decide(cfg: TuneConfig, results: dict, refused: dict, skipped: dict, run, topology: Topology,
            memory_mb: float) -> TuneResult:
    ranked = sorted(results, key=lambda t: -results[t].images_per_s)
    # the batch is advice: the layout is judged at the trials' batch, then the smallest batch within 5% is named
    same_batch = [t for t in ranked if t.batch == cfg.batch] or ranked
    winner, runner_up = same_batch[0], (same_batch[1] if len(same_batch) > 1 else None)
    confirm = None
    if runner_up is not None and cfg.confirm_rounds:
        runs = alternate({"winner": lambda: run(winner).images_per_s, "runner-up": lambda: run(runner_up).images_per_s},
                         cfg.confirm_rounds, warmup=0)
        medians = {k: statistics.median(v) for k, v in runs.items()}
        swapped = medians["runner-up"] > medians["winner"]
        confirm = Confirmation(winner=winner.name(), runner_up=runner_up.name(), rounds=runs, medians=medians,
                               swapped=swapped)
        if swapped:
            winner, runner_up = runner_up, winner
    best_rate = max(results[t].images_per_s for t in results if dataclasses.replace(t, batch=winner.batch) == winner)
    batches = sorted(t.batch for t in results if dataclasses.replace(t, batch=winner.batch) == winner
                     and results[t].images_per_s >= 0.95 * best_rate)
    return TuneResult(topology=topology, memory_mb=memory_mb, trials=tuple(TrialResult(t, results[t]) for t in ranked),
                      refused=refused, skipped=skipped, confirm=confirm, winner=winner,
                      winner_images_per_s=results[winner].images_per_s,
                      batch_per_rank=batches[0] if batches else winner.batch)
