"""The data path of ``hpcdl plan``: what reading the training set costs at N nodes, three ways, and which to take.

The inputs: the dataset (``images`` of ``image_bytes`` on average, packed in shards of ``shard_bytes``: D bytes
in S shards), the run at N nodes (the plan's images/s, epoch and time to train, its ranks and each rank's loader
workers: W reading processes), and what serves the reads: the shared filesystem's aggregate read bandwidth B
and metadata rate M (opens per second for all clients), node-local disk L and a node's link: a profile's
figures, cited (:mod:`hpcdl.launch.profiles`), or flags. A figure neither gives is asked for, not assumed.

- **direct**: every rank reads its samples from the shards on the shared filesystem, one random read of an
  image each (a global shuffle): the machine makes images/s reads of ``image_bytes``, images/s x image_bytes
  bytes a second (per node: that over N). A loader worker opens each shard it reads from once per epoch (the
  workers of :mod:`hpcdl.data.loader` are not persistent: each epoch starts new ones); reading m = images / W
  samples spread over S shards it opens S (1 - (1 - 1/S)^m) of them, so an epoch opens W S (1 - (1 - 1/S)^m)
  files, and at the epoch's start, when no worker holds a shard yet, every read is an open: the peak opens/s
  is the reads/s.
- **stage**: every node copies the whole dataset to its disk before training (``hpcdl stage``): N D bytes over
  B, and no faster than one node's link or its own copy (its disk's writes, and the sha256 ``hpcdl stage`` takes on
  the way, on one core: ``--stage-node-gb-s`` where known): max(N D / B, D / min(link, copy)). It needs D <= L.
- **cache** (``data.cache=node``): each byte is read from the shared filesystem once per job. The first epoch
  reads D once over all nodes, at B or at the nodes' links together, whichever is less, while it trains:
  max(the epoch's compute, D / min(B, N link)); later epochs are served from the nodes' caches and their peers.
  A node keeps D / N in its memory, which needs D / N <= its cache (``data.cache_budget``: a share of the node's
  memory, ``--cache-gb``), and opens at most S shards.

The choice, in this order: stage when its copy takes at most ``stage_share`` of the time to train and the
dataset fits; direct when the reads need at most ``direct_share`` of B and their peak opens at most
``direct_share`` of M (the filesystem serves every other job too); cache otherwise.
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl.config import DataConfig, cache_budget_bytes
from hpcdl.data.options import PackConfig
from hpcdl.errors import ConfigError
from hpcdl.names import IMAGENET_TRAIN
from hpcdl.plan.published import PUBLISHED
from hpcdl.plan.validate import PROFILE_OF
from hpcdl.utils import parse_bytes

__all__ = ["DataPathInputs", "DataPathModel", "Figure", "format_data_path", "published_runs", "resolve_figure"]

# ImageNet-1K's original training JPEGs: 1,281,167 images in about 138 GB (datasets/imagenet1k/README.md), 110 KB
# on average; a set packed with --short-side 256 (that recipe's default) stores less, and its manifest says how much
IMAGENET_IMAGE_KB = 110.0
PACK_SHARD_SIZE = next(f.default for f in dataclasses.fields(PackConfig) if f.name == "shard_size")
DATA_WORKERS = next(f.default for f in dataclasses.fields(DataConfig) if f.name == "workers")
# the node cache's RAM, a share of the node's memory: data.cache_budget's default, read where it is set
CACHE_SHARE = cache_budget_bytes(DataConfig().cache_budget, memory=1 << 40) / (1 << 40)
_WHAT = {"--fs-gb-s": "aggregate read bandwidth", "--fs-opens-per-s": "metadata rate",
         "--local-disk-gb": "node-local disk", "--cache-gb": "memory per node"}  # what each flag gives, for messages


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """One figure of what serves the reads, in its flag's unit, and where it came from."""

    value: float | None  # None: neither the flag nor the profile gives it
    source: str  # the flag, or "profile NAME"; "" when not known
    flag: str  # the flag that gives it

    @property
    def known(self) -> bool:
        return self.value is not None

    def shown(self, unit: str, fmt: str = ",.0f") -> str:
        return f"{self.value:{fmt}} {unit} ({self.source})" if self.known else f"? {unit} (give {self.flag})"


def resolve_figure(given: float | None, profile, field: str, flag: str) -> Figure:
    """``given`` (a flag's value), else ``profile``'s ``field``, else not known."""
    if given is not None:
        if not given > 0:
            raise ConfigError(f"{flag} {given:g}: must be more than 0")
        return Figure(float(given), flag, flag)
    value = getattr(profile, field)
    return Figure(float(value), f"profile {profile.name}", flag) if value is not None else Figure(None, "", flag)


@dataclasses.dataclass(kw_only=True, slots=True)
class DataPathInputs:
    """The data path's own questions (docs/scaling.md, "The data path"); the filesystem's bandwidth and metadata
    rate are ``--fs-gb-s`` and ``--fs-opens-per-s``, which the start-up model shares."""

    # a stored training image's mean size, KB (default: ImageNet-1K's original JPEGs, 110, when --train-images is
    # ImageNet-1K's; a dataset packed with --short-side 256 stores less: its manifest.json lists each shard's bytes)
    image_kb: float | None = None
    shard_size: str = PACK_SHARD_SIZE  # the shards' size, as hpcdl pack --shard-size gave it
    data_workers: int | None = None  # DataLoader workers per rank (data.workers; default: the preset's, else 4)
    local_disk_gb: float | None = None  # node-local disk a node may stage to, GB (default: the profile's /tmp)
    # one node's copy to its disk, GB/s: its disk's writes and hpcdl stage's sha256 on one core (default: not
    # counted, only the link bounds it)
    stage_node_gb_s: float | None = None
    stage_share: float = 0.05  # stage when copying the dataset to every node takes at most this share of the run
    # read directly when the reads need at most this share of the filesystem's bandwidth and of its metadata rate
    direct_share: float = 0.2
    # a node's cache for the samples it keeps, GB (data.cache_budget; default: 25% of the profile's memory per node,
    # data.cache_budget's default share)
    cache_gb: float | None = None

    def __post_init__(self):
        if self.stage_node_gb_s is not None and not self.stage_node_gb_s > 0:
            raise ConfigError(f"--stage-node-gb-s {self.stage_node_gb_s:g}: must be more than 0")
        if self.image_kb is not None and not self.image_kb > 0:
            raise ConfigError(f"--image-kb {self.image_kb:g}: must be more than 0 (ImageNet-1K's JPEGs: 110)")
        if self.data_workers is not None and self.data_workers < 0:
            raise ConfigError(f"--data-workers {self.data_workers}: must be 0 (the rank loads) or more")
        if self.cache_gb is not None and not self.cache_gb > 0:
            raise ConfigError(f"--cache-gb {self.cache_gb:g}: must be more than 0")
        for name in ("stage_share", "direct_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name):g}: give a share in (0, 1]")
        parse_bytes(self.shard_size, "--shard-size")

    def _cache(self, profile) -> Figure:
        if self.cache_gb is not None:
            return Figure(self.cache_gb, "--cache-gb", "--cache-gb")
        if profile.mem_gb_per_node is None:
            return Figure(None, "", "--cache-gb")
        return Figure(CACHE_SHARE * profile.mem_gb_per_node, f"{CACHE_SHARE:.0%} of profile {profile.name}'s "
                      f"{profile.mem_gb_per_node} GB", "--cache-gb")

    def model(self, profile, fs_gb_s: float | None, fs_opens_per_s: float | None, link_bytes_s: float,
              images: int, workers: int | None = None) -> tuple[DataPathModel | None, str]:
        """The model for ``images`` of this dataset read on ``profile``'s machine, ``workers`` (a preset's
        data.workers) unless --data-workers; None and the reason when the images' size is not known."""
        if self.image_kb is None and images != IMAGENET_TRAIN:
            return None, (f"# data path: not priced: give --image-kb, the mean size of the {images:,} stored "
                          f"training images (the default, {IMAGENET_IMAGE_KB:g}, is ImageNet-1K's)")
        workers = self.data_workers if self.data_workers is not None else workers
        return DataPathModel(
            images=images, image_bytes=(self.image_kb or IMAGENET_IMAGE_KB) * 1e3,
            shard_bytes=parse_bytes(self.shard_size, "--shard-size"),
            workers=DATA_WORKERS if workers is None else workers, profile=profile.name,
            bandwidth=resolve_figure(fs_gb_s, profile, "fs_gb_s", "--fs-gb-s"),
            opens=resolve_figure(fs_opens_per_s, profile, "fs_opens_per_s", "--fs-opens-per-s"),
            local_disk=resolve_figure(self.local_disk_gb, profile, "local_disk_gb", "--local-disk-gb"),
            cache=self._cache(profile),
            link_bytes_s=link_bytes_s, stage_share=self.stage_share, direct_share=self.direct_share,
            node_copy_bytes_s=self.stage_node_gb_s * 1e9 if self.stage_node_gb_s else None), ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DataPathModel:
    images: int
    image_bytes: float  # a stored image's mean size
    shard_bytes: float
    workers: int  # loader workers per rank (0: the rank reads itself, one reading process)
    profile: str
    bandwidth: Figure  # the filesystem's aggregate read bandwidth, GB/s
    opens: Figure  # its metadata rate, opens/s for all clients
    local_disk: Figure  # node-local disk, GB
    cache: Figure  # a node's memory for the cache, GB
    link_bytes_s: float  # one node's link
    node_copy_bytes_s: float | None = None  # one node's copy to its disk; None: not counted
    stage_share: float
    direct_share: float

    @property
    def dataset_bytes(self) -> float:
        return self.images * self.image_bytes

    @property
    def shards(self) -> int:
        return max(1, math.ceil(self.dataset_bytes / self.shard_bytes))

    def terms(self, nodes: int, ranks: int, images_s: float, epoch_s: float, time_to_train_s: float) -> dict:
        """Each path's terms at ``nodes`` for a run that trains ``images_s`` (the plan's row, or a published run),
        and the path chosen, with why. A term whose input is not known is None."""
        d, s = self.dataset_bytes, self.shards
        readers = ranks * max(1, self.workers)
        per_reader = self.images / readers
        epoch_opens = readers * s * (1 - (1 - 1 / s) ** per_reader)
        bandwidth = self.bandwidth.value * 1e9 if self.bandwidth.known else None
        disk = self.local_disk.value * 1e9 if self.local_disk.known else None
        t = {"nodes": nodes, "ranks": ranks, "readers": readers, "images_s": images_s, "epoch_s": epoch_s,
             "time_to_train_s": time_to_train_s, "dataset_bytes": d, "shards": s,
             "node_bytes_s": images_s * self.image_bytes / nodes, "machine_bytes_s": images_s * self.image_bytes,
             "reads_s": images_s, "peak_opens_s": images_s, "node_peak_opens_s": images_s / nodes,
             "epoch_opens": epoch_opens, "mean_opens_s": epoch_opens / epoch_s,
             "bandwidth_share": images_s * self.image_bytes / bandwidth if bandwidth else None,
             "opens_share": images_s / self.opens.value if self.opens.known else None,
             "stage_s": max(nodes * d / bandwidth, d / min(self.link_bytes_s, self.node_copy_bytes_s or math.inf))
             if bandwidth else None,
             "fits": d <= disk if disk else None, "cache_node_bytes": d / nodes,
             "cache_fits": d / nodes <= self.cache.value * 1e9 if self.cache.known else None,
             "cache_first_epoch_s": max(epoch_s, d / min(bandwidth, nodes * self.link_bytes_s)) if bandwidth else None}
        t["stage_of_run"] = t["stage_s"] / time_to_train_s if t["stage_s"] is not None else None
        t["path"], t["reason"] = self.choose(t)
        return t

    def choose(self, t: dict) -> tuple[str, str]:
        """(path, why): stage, direct or cache, by the rule in the module's docstring; "?" naming the flags it lacks."""
        missing = [f.flag for f in (self.bandwidth, self.opens, self.local_disk) if not f.known]
        if not (self.bandwidth.known and self.local_disk.known):
            return "?", self._give(missing)
        gb, disk_gb = self.dataset_bytes / 1e9, self.local_disk.value
        stage = (f"copying {gb:.1f} GB to each node takes {t['stage_s'] / 60:.1f} min, {t['stage_of_run']:.0%} of the "
                 f"run" if t["fits"] else f"{gb:.1f} GB does not fit the node's {disk_gb:g} GB")
        if t["fits"] and t["stage_of_run"] <= self.stage_share:
            return "stage", f"{stage}, and fits its {disk_gb:g} GB"
        if missing:  # the metadata rate: direct reads against the cache
            return "?", f"{stage}; {self._give(missing)} to weigh direct reads against the cache"
        direct = (f"direct reads need {t['bandwidth_share']:.0%} of the filesystem's {self.bandwidth.value:g} GB/s and "
                  f"their opens peak at {t['peak_opens_s']:,.0f}/s, {t['opens_share']:.0%} of its "
                  f"{self.opens.value:,.0f}")
        if t["bandwidth_share"] <= self.direct_share and t["opens_share"] <= self.direct_share:
            return "direct", f"{stage}; {direct}"
        if not self.cache.known:
            return "?", f"{stage}; {direct}; {self._give(['--cache-gb'])} to weigh the cache"
        if not t["cache_fits"]:
            return "direct", (f"{stage}; a node's share of the cache, {t['cache_node_bytes'] / 1e9:.1f} GB, does not "
                              f"fit its {self.cache.value:g} GB either; {direct}: expect throttled reads")
        first = t["cache_first_epoch_s"]
        cost = ("no more than its compute" if first <= t["epoch_s"] * 1.001 else
                f"{first - t['epoch_s']:.1f} s more than its compute")
        return "cache", (f"{stage}; {direct}; the cache reads the {gb:.1f} GB once: its first epoch takes "
                         f"{first:.1f} s, {cost}")

    def _give(self, flags: list[str]) -> str:
        return f"profile {self.profile} states no {' or '.join(_WHAT[f] for f in flags)}: give {', '.join(flags)}"

    def header(self) -> str:
        return (f"# data path (hpcdl/plan/data_path.py): {self.images:,} images x {self.image_bytes / 1e3:g} KB = "
                f"{self.dataset_bytes / 1e9:.1f} GB in {self.shards} shards of {self.shard_bytes / 2 ** 20:g} MiB, "
                f"{self.workers} loader workers a rank; the filesystem {self.bandwidth.shown('GB/s', 'g')}, "
                f"{self.opens.shown('opens/s')}; node-local disk {self.local_disk.shown('GB', 'g')}, a node's cache "
                f"{self.cache.shown('GB', 'g')}, a node's own "
                f"copy {_copy(self.node_copy_bytes_s)}; stage when its copy is at most {self.stage_share:.0%} of the "
                f"run, read directly at most {self.direct_share:.0%} of the filesystem's bandwidth and opens, else cache"
                "\n# images/s: the run's reads, one an image; peak opens/s: at an epoch's start, when no loader worker "
                "holds a shard yet, every read opens one; epoch opens/s: an epoch's opens over its time; staging: every "
                "node copies the dataset; cache 1st: the cache's first epoch, which reads the dataset once")


def published_runs(model: DataPathModel) -> list[dict]:
    """The published time-to-train runs on the model's node type, each at its own images/s (all ImageNet-1K, one
    rank per processor); none when the model's dataset is not ImageNet-1K's."""
    if model.images != IMAGENET_TRAIN:
        return []
    out = []
    for row in PUBLISHED:
        if row.minutes and PROFILE_OF.get(row.processor) == model.profile:
            images_s = row.epochs * IMAGENET_TRAIN / (row.minutes * 60)
            out.append({"label": row.name, **model.terms(row.nodes, row.processors, images_s,
                                                         IMAGENET_TRAIN / images_s, row.minutes * 60)})
    return out


def format_data_path(model: DataPathModel, rows: list[dict], published: list[dict] = ()) -> str:
    """The table after the plan's: one line per node count, then why each path was chosen."""
    lines = [model.header(),
             f"{'nodes':>6} {'images/s':>9} {'per node':>9} {'machine':>8} {'of fs':>6} {'peak':>9} {'of fs':>6} "
             f"{'epoch':>9} {'staging':>8} {'of':>6} {'fits':>5} {'cache':>8} {'compute':>8}  path",
             f"{'':>6} {'':>9} {'MB/s':>9} {'GB/s':>8} {'bw':>6} {'opens/s':>9} {'opens':>6} {'opens/s':>9} "
             f"{'min':>8} {'run':>6} {'':>5} {'1st s':>8} {'epoch s':>8}"]
    lines += [_line(t) for t in rows]
    if published:
        lines.append(f"# the published runs on {model.profile} nodes, each at its own images/s (the rows of "
                     f"hpcdl/plan/published.py), read as hpcdl would")
        lines += [_line(t) + f"  {t['label']}" for t in published]
    why: dict[tuple[str, str], list[str]] = {}  # rows chosen for the same reason share a line
    for t in [*rows, *published]:
        why.setdefault((t["path"], t["reason"]), []).append(str(t.get("label", t["nodes"])))
    lines += [f"# {', '.join(labels)}: {path}: {reason}" for (path, reason), labels in why.items()]
    return "\n".join(lines)


def _line(t: dict) -> str:
    fits = "?" if t["fits"] is None else ("yes" if t["fits"] else "no")
    return (f"{t['nodes']:>6} {t['reads_s']:>9,.0f} {t['node_bytes_s'] / 1e6:>9.1f} {t['machine_bytes_s'] / 1e9:>8.2f} "
            f"{_share(t['bandwidth_share'])} {t['peak_opens_s']:>9,.0f} {_share(t['opens_share'])} "
            f"{t['mean_opens_s']:>9,.0f} {_opt(t['stage_s'], 60, '.1f', 8)} {_share(t['stage_of_run'])} {fits:>5} "
            f"{_opt(t['cache_first_epoch_s'], 1, '.1f', 8)} {t['epoch_s']:>8.1f}  {t['path']}")


def _copy(v: float | None) -> str:
    return f"{v / 1e9:g} GB/s (--stage-node-gb-s)" if v else "not counted (--stage-node-gb-s)"


def _share(v: float | None) -> str:
    return f"{'?':>6}" if v is None else f"{v:>6.0%}"


def _opt(v: float | None, per: float, fmt: str, width: int) -> str:
    return f"{'?':>{width}}" if v is None else f"{v / per:>{width}{fmt}}"
