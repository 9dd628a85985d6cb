"""What ``hpcdl pack`` is asked to do: its config and the options of its parts, torch-, PIL- and numpy-free,
so that the command line (which derives ``hpcdl pack``'s flags from these) stays light."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.flags import meta
from hpcdl.utils import parse_bytes

__all__ = ["Encoding", "PackConfig", "SourceOptions"]


@dataclass(frozen=True, slots=True)
class Encoding:
    """How ``hpcdl pack`` stores images: ``--max-side`` or ``--short-side``, and ``--quality``."""

    max_side: int | None = None  # resize so the longer side is at most N
    short_side: int | None = None  # resize so the shorter side is at most N
    quality: int = 90  # JPEG quality when re-encoding

    def __post_init__(self):
        if self.max_side and self.short_side:
            raise ConfigError("give --max-side or --short-side, not both")
        for name in ("max_side", "short_side"):
            value = getattr(self, name)
            if value is not None and value < 16:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is too small; use at least 16 (e.g. 256)")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"--quality {self.quality} is outside 1..100")

    def target(self, width: int, height: int) -> tuple[int, int] | None:
        """The stored size, or None when the image is stored at its own size."""
        if self.max_side and max(width, height) > self.max_side:
            s = self.max_side / max(width, height)
        elif self.short_side and min(width, height) > self.short_side:
            s = self.short_side / min(width, height)
        else:
            return None
        return max(1, round(width * s)), max(1, round(height * s))


@dataclass(frozen=True, slots=True)
class SourceOptions:
    names: str | None = None  # a file of "wnid human name" lines (synset_words.txt, LOC_synset_mapping.txt)
    val_labels: str | None = None  # imagenet-val: ILSVRC2012_validation_ground_truth.txt, one ILSVRC2012_ID per line
    synsets: str | None = None  # imagenet-val: ILSVRC2012_ID -> wnid: "wnid" per line, or "wnid ID name" (map_clsloc.txt)


@dataclass(kw_only=True, slots=True)
class PackConfig:
    src: str  # the images (see --tree)
    out: str  # the dataset root to write
    # how SRC is organized (the old spelling --layout still works, with a warning, until the next release)
    tree: str = field(default="folder", metadata=meta(choices=names.TREES, old_flag="--layout"))
    shard_size: int | str = "512MB"  # bytes of images per shard
    encoding: Encoding = field(default_factory=Encoding)
    workers: int = 0  # encoding processes (0: one per CPU this process may use)
    resume: bool = False  # keep finished, verified shards and go on
    seed: int = 0  # the shuffle before sharding
    part: str | None = None  # i/n: pack part i of n (default: the Slurm array task or MPI rank, else the whole dataset)
    sources: SourceOptions = field(default_factory=SourceOptions)
    image_timeout: float = 60.0  # seconds: an input that takes longer to read and decode is rejected
    # a validation split where SRC has none (ImageNet-22K): this fraction of the images, chosen by a hash of
    # each image's name (the same whatever the parts or the seed), is held out; --split val packs those alone
    holdout: float = 0.0
    split: str = field(default="all", metadata=meta(choices=("all", "train", "val")))  # with --holdout: which to pack

    def __post_init__(self):
        if isinstance(self.shard_size, str):
            self.shard_size = parse_bytes(self.shard_size, "--shard-size")
        if self.shard_size < 1 << 16:
            raise ConfigError(f"--shard-size {self.shard_size} B is too small; use at least 64K (e.g. 512MB)")
        if self.workers < 0:
            raise ConfigError(f"--workers {self.workers} must be 0 (one per CPU) or more")
        self.workers = self.workers or len(os.sched_getaffinity(0))
        if not 0 <= self.holdout < 1 or (self.split == "all") != (self.holdout == 0):
            raise ConfigError(f"--holdout {self.holdout} --split {self.split}: give a fraction in (0, 1) with --split "
                              "train or val (e.g. --holdout 0.25 --split train, then the same with --split val)")
        if not self.image_timeout > 0:
            raise ConfigError(f"--image-timeout {self.image_timeout} must be more than 0 seconds (e.g. 60)")
