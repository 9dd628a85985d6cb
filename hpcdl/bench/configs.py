"""What each benchmark takes: its ``Config``, whose fields are the command's flags (:mod:`hpcdl.flags`; the
comment on a field's line is its help). These import no torch, so that ``hpcdl`` builds its parser, and a
login node checks a benchmark's flags, without it; each benchmark's ``run`` is in its own module, which
imports torch at the top and is named in :data:`hpcdl.bench.BENCHMARKS`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpcdl import names
from hpcdl.config import SyncConfig
from hpcdl.errors import ConfigError
from hpcdl.utils import parse_bytes

__all__ = ["AllreduceBench", "DataBench", "DataPathBench", "FeedBench", "LargeBatchBench", "OptimBench", "PluginBench",
           "ScalingBench", "StartupBench", "StepBench", "SyncBench", "TuneConfig", "bucket_spec"]


# hpcdl bench allreduce
ITEMSIZE = {"float32": 4, "float64": 8, "int64": 8}  # the dtypes it sweeps, by name


@dataclasses.dataclass(kw_only=True, slots=True)
class AllreduceBench:
    min_bytes: int | str | None = None  # smallest message, e.g. 4 or 64K (default: one element of dtype)
    max_bytes: int | str = "256M"  # largest message; sizes double from the smallest
    dtype: str = "float32"  # float32 | float64 | int64
    warmup: int = 2  # untimed all-reduces per size
    seconds_per_size: float = 0.5  # each size repeats until about this long, at least once
    max_iters: int = 1000  # at most this many timed all-reduces per size

    def __post_init__(self):
        if self.dtype not in ITEMSIZE:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(ITEMSIZE)}")
        itemsize = ITEMSIZE[self.dtype]
        if self.min_bytes is None:
            self.min_bytes = itemsize
        if isinstance(self.min_bytes, str):
            self.min_bytes = parse_bytes(self.min_bytes, "--min-bytes")
        if isinstance(self.max_bytes, str):
            self.max_bytes = parse_bytes(self.max_bytes, "--max-bytes")
        if self.min_bytes < itemsize or self.max_bytes < self.min_bytes:
            raise ConfigError(f"--min-bytes {self.min_bytes} and --max-bytes {self.max_bytes}: need "
                              f"{itemsize} <= min <= max (one {self.dtype} is {itemsize} bytes)")
        if self.warmup < 0 or self.max_iters < 1 or self.seconds_per_size <= 0:
            raise ConfigError("--warmup must be >= 0, --max-iters >= 1 and --seconds-per-size > 0")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= 2
        return out


# hpcdl bench plugin
LAUNCHERS = {"mpiexec": ["mpiexec", "-n"], "srun": ["srun", "--mpi=pmi2", "-n"]}


# hpcdl bench startup
@dataclasses.dataclass(kw_only=True, slots=True)
class StartupBench:
    ranks: str = "2,4,8,16,32"  # job sizes, comma-separated: each starts, checkpoints, and restarts
    launcher: str = "mpiexec"  # mpiexec | srun (inside an allocation of the largest size)
    backend: str = "gloo"  # the training's backend (a row of the backend table)
    store_clients: int = 3200  # connections held open while measuring what rank 0's store serves (0: skip)
    store_seconds: float = 3.0  # how long the store's capacity is measured
    heartbeat: float = 2.0  # the heartbeat interval the store's load at --store-clients ranks is given for

    def __post_init__(self):
        names.check("--launcher", self.launcher, tuple(LAUNCHERS))
        names.check("--backend", self.backend, names.BACKENDS)
        sizes = self.sizes()
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"--ranks {self.ranks!r}: give job sizes of 1 or more ranks, e.g. 2,4,8,16,32")
        if self.store_clients < 0 or self.store_seconds <= 0 or self.heartbeat <= 0:
            raise ConfigError(f"--store-clients {self.store_clients} must be >= 0, --store-seconds "
                              f"{self.store_seconds} and --heartbeat {self.heartbeat} more than 0")

    def sizes(self) -> list[int]:
        try:
            return sorted({int(n) for n in self.ranks.split(",") if n.strip()})
        except ValueError:
            raise ConfigError(f"--ranks {self.ranks!r}: give whole numbers separated by commas") from None


@dataclasses.dataclass(kw_only=True, slots=True)
class PluginBench:
    ranks: int = 2  # processes each path starts
    launcher: str = "mpiexec"  # mpiexec | srun (inside an allocation)
    backends: str = "gloo,mpi,ccl"  # rows of the backend table, comma-separated
    min_bytes: int | str = "4"  # smallest message of the sweep (as hpcdl bench allreduce's)
    max_bytes: int | str = "16M"  # largest message; sizes double from the smallest
    seconds_per_size: float = 0.3  # each size repeats until about this long, on each path
    rounds: int = 2  # launches of each path, alternated; each row keeps its best

    def __post_init__(self):
        names.check("--launcher", self.launcher, tuple(LAUNCHERS))
        for name in self.wanted():
            names.check("--backends", name, names.BACKENDS)
        if self.ranks < 2 or self.rounds < 1:
            raise ConfigError(f"--ranks {self.ranks} and --rounds {self.rounds}: need at least 2 ranks and 1 round")
        self.sweep()  # its own checks, with the flags named

    def wanted(self) -> list[str]:
        """The backends in the table's order (a process that loaded oneCCL could not load the mpich wheel's MPI)."""
        listed = [n.strip() for n in self.backends.split(",") if n.strip()]
        return [n for n in names.BACKENDS if n in listed] + [n for n in listed if n not in names.BACKENDS]

    def sweep(self) -> AllreduceBench:
        return AllreduceBench(min_bytes=self.min_bytes, max_bytes=self.max_bytes,
                                seconds_per_size=self.seconds_per_size)


# hpcdl bench feed
@dataclass(kw_only=True, slots=True)
class FeedBench:
    data: str | None = None  # a packed training set (default: synthetic JPEGs packed at short side 256)
    model: str = "resnet50"  # the model trained
    batch: int = 32  # images per rank per step
    crop: int = 224  # the training crop in px
    layouts: tuple[str, ...] = ("1x2", "2x1")  # RANKSxTHREADS per rank on this node
    precisions: tuple[str, ...] = ("fp32", "bf16")  # each layout is measured in each precision
    # DataLoader workers per rank in the jpeg cases, one case each: 0 reads in the rank's process, 4 is data.workers'
    # default; each case's figure against the step fed from memory is what that loader costs
    workers: tuple[int, ...] = (0, 1, 4)
    steps: int = 8  # timed steps per run, after the warm-up ones
    warmup: int = 2  # steps per run left out of the figure
    rounds: int = 2  # alternating rounds per layout and precision; the median counts

    def __post_init__(self):
        for layout in self.layouts:
            ranks, _, threads = layout.partition("x")
            if not (ranks.isdigit() and threads.isdigit() and int(ranks) and int(threads)):
                raise ConfigError(f"--layouts {layout!r}: give RANKSxTHREADS, e.g. 1x2 or 2x1")
        if not self.workers or min(self.workers) < 0 or len(set(self.workers)) < len(self.workers):
            raise ConfigError(f"--workers {','.join(map(str, self.workers))}: give distinct loader worker counts of 0 "
                              "or more, e.g. 0,1,4")


# hpcdl bench data
@dataclass(kw_only=True, slots=True)
class DataBench:
    src: str | None = None  # a class-folder tree of JPEGs (default: synthetic ImageNet-sized JPEGs)
    images: int = 3200  # synthetic images to generate
    classes: int = 16  # synthetic classes
    short_side: int = 256  # pack with this short side
    workers: int = 2  # DataLoader workers (processes) per reader
    batch_size: int = 32  # the DataLoader row's batch
    rounds: int = 3  # epochs per reader, alternating; the median counts
    crop: int = 224  # the recipes' crop
    recipes: str = "imagenet; light; none; imagenet, randaugment, erasing"  # data.augment specs, ';' between
    per_core_images: int = 400  # images each round of a decoder or a recipe decodes, on one core


# hpcdl bench data-path
DATA_PATHS = ("direct", "stage", "cache")  # read the shared filesystem; copy to node-local disk first; data.cache=node


@dataclass(kw_only=True, slots=True)
class DataPathBench:
    data: str = ""  # a packed dataset on the shared filesystem (its root): what every path reads
    paths: str = "direct,stage,cache"  # measured in this order, comma-separated: direct, stage, cache
    epochs: int = 3  # loader epochs per path (the cache's first reads the filesystem, the next ones its copies)
    workers: int = 4  # data.workers per rank (4: the trainer's default)
    batch: int = 32  # images per rank per batch
    crop: int = 128  # the training crop (the decode and augment cost per image)
    cache_budget: str = "25%"  # data.cache_budget for the cache path: a share of the node's memory or bytes (512M)
    stage_to: str = "/tmp/hpcdl-bench-stage-%N"  # node-local folder for the stage path (%N: the node; removed after)
    # a shell command that prints the bytes the filesystem has served so far (local cluster: 'bash
    # slurm/local/pfs.sh served'); rank 0 runs it between epochs. Without it, only the cache's agents count bytes
    fs_counter: str | None = None

    def __post_init__(self):
        if not self.data:
            raise ConfigError("--data: give the root of a packed dataset on the shared filesystem (hpcdl pack --out)")
        for path in self.path_list():
            names.check("--paths", path, DATA_PATHS)
        if self.epochs < 1 or self.workers < 0 or self.batch < 1 or self.crop < 1:
            raise ConfigError(f"--epochs {self.epochs}, --batch {self.batch} and --crop {self.crop} must be at least "
                              f"1, --workers {self.workers} at least 0")

    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]


# hpcdl bench optim
@dataclass(kw_only=True, slots=True)
class OptimBench:
    model: str = "resnet50"  # whose parameters the step updates
    steps: int = 10  # steps per round
    rounds: int = 5  # rounds per optimizer, alternating; the median counts
    threads: int = 0  # torch threads (0: torch's default)


# hpcdl bench optim-shard
@dataclass(kw_only=True, slots=True)
class OptimShardBench:
    model: str = "resnet50"  # whose parameters the step updates
    optimizers: str = "sgd,lars,lamb,adamw,muon"  # comma-separated rows of hpcdl.names.OPTIMIZER_TABLE
    steps: int = 3  # steps per round
    rounds: int = 5  # rounds per optimizer and layout, alternating; the median counts
    batch: int = 8  # the whole step's images per rank (0: the whole step not timed)
    crop: int = 128  # the whole step's image size

    def optimizer_list(self) -> list[str]:
        chosen = [o.strip() for o in self.optimizers.split(",") if o.strip()]
        for name in chosen:
            names.check("--optimizers", name, names.OPTIMIZER_TABLE)
            if names.OPTIMIZER_TABLE[name].schedule_free:
                raise ConfigError(f"--optimizers {name}: a Schedule-Free optimizer is not sharded (its modes move "
                                  "every weight with its state); leave it out")
        if not chosen or self.steps < 1 or self.rounds < 1 or self.batch < 0 or self.crop < 32:
            raise ConfigError("--optimizers names at least one optimizer; --steps and --rounds are at least 1, "
                              "--batch at least 0 (0: no whole step), --crop at least 32")
        return chosen


# hpcdl bench step
PARTS = ("precision", "overhead", "tuning", "curve")


@dataclass(kw_only=True, slots=True)
class StepBench:
    model: str = "resnet18"  # the precision and overhead comparisons' model
    batch: int = 32  # the precision and overhead comparisons' batch
    crop: int = 0  # the precision and overhead comparisons' image side in px (0: 128 for hpcdl's models, else the model's)
    steps: int = 3  # steps per round
    rounds: int = 7  # alternating rounds; the median counts
    precision_rounds: int = 3  # the precision comparison's alternating rounds (one where bf16 is emulated)
    compile: bool = True  # the precision comparison also runs torch.compile of auto's precision (compiles 30-60 s)
    tuning_model: str = "resnet50"  # the tuning comparison's model
    tuning_batch: int = 8  # images per rank
    tuning_crop: int = 224  # the tuning comparison's image side in px
    tuning_steps: int = 2  # steps per rank process, after one warm-up step
    tuning_rounds: int = 3  # the tuning comparison's alternating rounds
    ranks_per_node: int = 2  # ranks the tuning comparison runs at once
    threads: int = 0  # the overhead comparison's threads (0: torch's default)
    # also the tuned node's images/s at these per-rank batches (hpcdl plan --step-json reads it)
    curve_batches: tuple[int, ...] = ()
    # which comparisons: precision, overhead, tuning, curve (curve whenever curve_batches is given)
    only: tuple[str, ...] = ("precision", "overhead", "tuning")
    # instead: where a step of --model goes, by class of work (torch's profiler), fp32 and bf16
    profile: bool = False

    def __post_init__(self):
        self.only = tuple(self.only)
        if self.crop == 0 and self.model in names.MODELS:
            self.crop = 128  # docs/performance.md's figures; a named model's own is resolved where torch is
        if set(self.only) - set(PARTS) or ("curve" in self.only and not self.curve_batches):
            raise ConfigError(f"--only {','.join(self.only)}: choose from {', '.join(PARTS)}; curve needs "
                              f"--curve-batches, e.g. --curve-batches 8,16,32")


# hpcdl bench sync
def _training_default(name: str):
    """A field whose default is the training default ``sync.NAME``."""
    return dataclasses.field(default_factory=lambda: SyncConfig.__dataclass_fields__[name].default)


@dataclass(kw_only=True, slots=True)
class SyncBench:
    model: str = "resnet50"  # whose gradient set is synchronized
    bucket_cap_mb: float = _training_default("bucket_cap_mb")  # hpcdl's DDP: the bucket cap in MB
    first_bucket_mb: float | None = _training_default("first_bucket_mb")  # hpcdl's DDP: the first bucket's cap in MB
    rounds: int = 5  # alternating rounds; the median counts
    latency_iters: int = 2000  # one-float all-reduces per latency figure
    scaling_model: str = "alexnet_bn"  # weak scaling: this model, 1 rank vs all
    scaling_batch: int = 32  # weak scaling: images per rank
    scaling_steps: int = 3  # weak scaling: steps per measurement, after one warm-up step (0: skip)
    hooks: tuple[str, ...] = names.HOOKS  # the comm hooks to time through DDP
    # bucket sweep of the scaling model's DDP step: FIRST:CAP or CAP in MB, e.g. 25,1:25,5,100 (default: skip)
    buckets: tuple[str, ...] = ()
    sweep_rounds: int = 3  # the bucket sweep's alternating rounds

    def __post_init__(self):
        for hook in self.hooks:
            names.check("--hooks", hook, names.HOOKS)
        for spec in self.buckets:  # before any rank starts
            bucket_spec(spec)


def bucket_spec(spec: str) -> tuple[float | None, float]:
    """``CAP`` or ``FIRST:CAP`` (MB) -> (first, cap)."""
    first, _, cap = spec.rpartition(":")
    try:
        sizes = (float(first) if first else None, float(cap))
    except ValueError:
        sizes = None
    if sizes is None or sizes[1] <= 0 or (sizes[0] is not None and sizes[0] <= 0):
        raise ConfigError(f"--buckets item {spec!r}: give CAP or FIRST:CAP in MB, both > 0 (e.g. 25 or 1:25)")
    return sizes


# hpcdl bench scaling
MODES = ("weak", "strong")


@dataclasses.dataclass(kw_only=True, slots=True)
class ScalingBench:
    model: str = "resnet50"  # the model trained at every point
    batch: int = 8  # weak scaling: images per rank
    global_batch: int | None = None  # strong scaling: images per step (default: batch x the largest rank count)
    crop: int | None = None  # image side in px (default: the model's training crop)
    steps: int = 5  # timed steps per point and round
    warmup: int = 1  # untimed steps first, each round (DDP rebuilds its buckets after the first)
    rounds: int = 2  # alternating rounds over the points
    ranks: tuple[int, ...] = ()  # rank counts, e.g. 1,2,4 (default: 1, 2, 4 ... and the job's size)
    modes: tuple[str, ...] = MODES  # weak, strong or both
    # compute threads per rank (default 0: hpcdl's CPU plan; give 1 when simulated nodes share cores)
    threads: int = 0
    # the comm hook (sync.hook) of every multi-rank point; hierarchical is bench sync's (a point's first k ranks
    # do not split by node)
    hook: str = "none"

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"--modes {','.join(self.modes)}: choose from {', '.join(MODES)}")
        if min(self.batch, self.steps, self.rounds) < 1 or self.warmup < 0 or self.threads < 0:
            raise ConfigError("--batch, --steps and --rounds must be >= 1, --warmup and --threads >= 0")
        names.check("--hook", self.hook, tuple(h for h in names.HOOKS if h != "hierarchical"))
        if any(k < 1 for k in self.ranks):
            raise ConfigError(f"--ranks {','.join(map(str, self.ranks))}: rank counts are >= 1")

    def counts(self, world: int) -> list[int]:
        if self.ranks:
            too_many = [k for k in self.ranks if k > world]
            if too_many:
                raise ConfigError(f"--ranks asks for {too_many} ranks but the job has {world}; "
                                  f"start more tasks or drop those counts")
            return sorted(set(self.ranks))
        counts, k = [], 1
        while k < world:
            counts.append(k)
            k *= 2
        return counts + [world]

    def points(self, world: int) -> list[tuple[str, int, int]]:
        """(mode, ranks, images per rank) for every measurement."""
        counts = self.counts(world)
        total = self.global_batch or self.batch * counts[-1]
        out = []
        for mode in self.modes:
            for k in counts:
                if mode == "strong" and total % k:
                    raise ConfigError(f"strong scaling: a global batch of {total} does not split over {k} ranks; "
                                      f"give --global-batch a multiple of every rank count")
                out.append((mode, k, self.batch if mode == "weak" else total // k))
        return out


# hpcdl bench largebatch
@dataclass(kw_only=True, slots=True)
class LargeBatchBench:
    # scikit-learn's digits (1,797 8x8 scans), or a packed dataset: a folder with train/ and val/ (hpcdl pack's)
    data: str = "digits"
    model: str = "tiny_cnn"  # any model= name (hpcdl models lists them)
    crop: int = 32  # a packed dataset's images, resized to crop x crop (the digits stay 8x8)
    optimizers: str = "sgd,nesterov,lars,lamb,adamw,schedulefree,muon"  # comma-separated (optimizer.name's)
    batches: str = "8,32,128,512"  # global batches, comma-separated; every cell trains the same epochs
    epochs: float = 15.0  # the epoch budget of every cell
    lr_factors: str = "0.25,1,4"  # the sweep: each optimizer's reference lr at the cell's batch times these
    seeds: int = 3  # seeds per lr: a cell reports its best lr's mean and spread over them
    warmup_epochs: float = 2.0  # every optimizer's linear warmup (at most a quarter of the epochs)
    weight_decay: float = 5e-4  # every optimizer's (mlperf semantics: not on BN and bias tensors)
    lars_eta: float = 0.03  # LARS's trust coefficient
    threads: int = 1  # torch threads per rank


# hpcdl tune
@dataclasses.dataclass(kw_only=True, slots=True)
class TuneConfig:
    model: str = "resnet50"  # the model the trials train
    batch: int = 32  # images per rank of the trials (the batch step tries half and twice it too)
    crop: int = 224  # the trials' image side in px
    steps: int = 2  # timed steps per trial, after one warm-up step
    confirm_rounds: int = 2  # the winner against the runner-up, alternating
    write: str = "hpcdl-layout.json"  # where the winner goes (hpcdl sbatch --layout reads it)

