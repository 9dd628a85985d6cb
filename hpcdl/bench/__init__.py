"""``hpcdl bench``: the measuring benchmarks, one module each, and their registry.

A benchmark is a config in :mod:`hpcdl.bench.configs` (a dataclass: its fields are the command's flags, see
:mod:`hpcdl.flags`; torch-free, so that listing or parsing a benchmark on a login node costs nothing) and a
module that imports torch at the top and holds ``run(cfg, job)`` (the figures on rank 0, None on the other
ranks), ``format_report(report)`` (the table printed) and ``plot(report, path)`` where it draws one. The row
names that module as a string: it is imported when the benchmark runs (:mod:`hpcdl.deferred`).
:mod:`hpcdl.bench.runner` starts and stops the process group for those that run on a job's ranks,
prints the table and writes every JSON report the same way.

Adding a benchmark is a module and a row of :data:`BENCHMARKS`; docs/contributing.md shows one.
"""

from __future__ import annotations

import dataclasses

from hpcdl import names
from hpcdl.bench import configs
from hpcdl.bench.runner import Output, RankOptions, run_benchmark
from hpcdl.deferred import deferred
from hpcdl.errors import ConfigError

__all__ = ["BENCHMARKS", "Benchmark", "get_benchmark", "run"]


@dataclasses.dataclass(frozen=True, slots=True)
class Benchmark:
    name: str  # hpcdl bench NAME
    config: type  # its flags (hpcdl.bench.configs)
    module: str  # the module that imports torch and holds run, format_report (and plot)
    help: str
    on_ranks: bool = False  # runs on a job's ranks: the runner joins the process group first
    compares_backends: bool = False  # takes --backends: a group per backend, measured side by side
    plots: bool = False  # its module has plot(report, path): --plot PATH draws one

    def load(self):
        return deferred(self.module)

    @property
    def run(self):
        return self.load().run

    @property
    def format(self):
        return self.load().format_report


BENCHMARKS = {b.name: b for b in (
    Benchmark("allreduce", configs.AllreduceBench, "hpcdl.bench.allreduce",
              "allreduce latency and bandwidth over message sizes, checked",
              on_ranks=True, compares_backends=True),
    Benchmark("plugin", configs.PluginBench, "hpcdl.bench.plugin",
              "allreduce through torch's entry points (a torch-only script) vs hpcdl's own "
              "start-up, launches alternated (run it outside a launcher)"),
    Benchmark("startup", configs.StartupBench, "hpcdl.bench.startup",
              "hpcdl train's start-up and restart at N ranks: each phase's time, and the counts that grow with N "
              "(files, store connections and requests); rank 0's store capacity (run it outside a launcher)"),
    Benchmark("feed", configs.FeedBench, "hpcdl.bench.feed",
              "hpcdl train on packed JPEGs vs the same step fed from memory, per layout and "
              "precision: what the loader costs"),
    Benchmark("data", configs.DataBench, "hpcdl.bench.data",
              "shard reader vs ImageFolder vs a bare decode loop; decoders and recipes per core"),
    Benchmark("data-path", configs.DataPathBench, "hpcdl.bench.datapath",
              "a dataset on the shared filesystem: direct reads, staging to node-local disk, the node cache; per "
              "epoch the filesystem's bytes, opens per node, images/s per node (run it on a job's ranks)",
              on_ranks=True),
    Benchmark("optim", configs.OptimBench, "hpcdl.bench.optim",
              "one optimizer step: each of hpcdl's optimizers against torch SGD(foreach)"),
    Benchmark("optim-shard", configs.OptimShardBench, "hpcdl.bench.optim_shard",
              "the optimizer step replicated on every rank vs sharded over the ranks (optimizer.shard): time and "
              "state bytes per rank (run it on a job's ranks)", on_ranks=True),
    Benchmark("step", configs.StepBench, "hpcdl.bench.step",
              "a training step through hpcdl vs a bare loop; ResNet-50 tuned vs untuned"),
    Benchmark("sync", configs.SyncBench, "hpcdl.bench.sync",
              "a model's gradient set: per-tensor, fused, flat, each comm hook; latency, weak "
              "scaling, bucket sweep (run on a job's ranks)", on_ranks=True, compares_backends=True),
    Benchmark("scaling", configs.ScalingBench, "hpcdl.bench.scaling",
              "training throughput at 1, 2, 4 ... N ranks, weak and strong: table, JSON, PNG "
              "(run on a job's ranks)", on_ranks=True, plots=True),
    Benchmark("large-batch", configs.LargeBatchBench, "hpcdl.bench.largebatch",
              "each optimizer at several global batches, same epochs, an lr sweep and seeds per cell, on digits or "
              "a packed dataset: table, JSON, PNG (runs are dealt over a job's ranks)", on_ranks=True, plots=True),
)}


def get_benchmark(name: str) -> Benchmark:
    names.check("benchmark", name, tuple(BENCHMARKS), "hpcdl bench --help lists them")
    return BENCHMARKS[name]


def run(name: str, **fields):
    """Run benchmark ``name`` as ``hpcdl bench NAME`` would, its flags given as keyword arguments (field names:
    ``max_bytes="64M"``, ``backend="gloo"``, ``json_path=...``). Rank 0 returns the report, the others None;
    this is what a submitit job calls (``submit(hpcdl.bench.run, args=("allreduce",), ...)``)."""
    row = get_benchmark(name)
    parts = {cls: {k: fields.pop(k) for k in list(fields) if k in {f.name for f in dataclasses.fields(cls)}}
             for cls in (row.config, RankOptions, Output)}
    if fields:
        valid = sorted(f.name for cls in parts for f in dataclasses.fields(cls))
        raise ConfigError(f"bench {name}: unknown fields {sorted(fields)}; valid: {', '.join(valid)}")
    return run_benchmark(row, row.config(**parts[row.config]), RankOptions(**parts[RankOptions]),
                         Output(**parts[Output]))
