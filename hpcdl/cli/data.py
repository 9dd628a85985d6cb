"""``hpcdl pack``, ``hpcdl verify`` and ``hpcdl stage``: datasets in HDF5 shards."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from hpcdl.cli.common import command
from hpcdl.config import DataConfig
from hpcdl.data import recipe
from hpcdl.data.format import summarize
from hpcdl.data.options import PackConfig
from hpcdl.data.pack import merge, restat
from hpcdl.data.pack import pack as packed
from hpcdl.data.stage import stage as staged, verdict
from hpcdl.data.verify import load_manifest
from hpcdl.data.verify import verify as problems_of
from hpcdl.deferred import deferred
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import HpcdlError
from hpcdl.flags import meta
from hpcdl.presets import resolve


@dataclass(kw_only=True, slots=True)
class PackCommand:
    src: str | None = field(default=None, metadata=meta(positional=True))  # the images (see --tree)
    out: str = field(metadata=meta(positional=True))  # the dataset root to write
    merge: bool = False  # only merge finished parts into manifest.json
    stats: bool = False  # only (re)measure OUT's channel statistics, class counts and sizes into its manifest


@dataclass(kw_only=True, slots=True)
class VerifyCommand:
    dir: str = field(metadata=meta(positional=True))  # the dataset root (where manifest.json is)
    full: bool = False  # also compare every shard's sha256
    sample: int = 4  # images to decode per shard


@dataclass(kw_only=True, slots=True)
class StageCommand:
    root: str = field(metadata=meta(positional=True))  # the packed dataset (where manifest.json is)
    dest: str = field(metadata=meta(positional=True))  # node-local directory, e.g. $TMPDIR
    timeout: float = 3600.0  # seconds the node's other local ranks wait
    epochs: int = 0  # the run's epochs, to weigh staging against direct reads (the first node says, on stderr)


@dataclass(kw_only=True, slots=True)
class ShowCommand:
    dataset: str = field(metadata=meta(positional=True))  # a packed dataset root (where manifest.json is)
    config: str = ""  # a preset or YAML config: its data.augment, crop and data.decoder (default: a plain config's)
    augment: str = ""  # a recipe or steps instead of the config's, e.g. "pad_crop, rot90"
    crop: int = 0  # instead of the config's crop
    out: str = ""  # the PNG (default: NAME-sheet.png here, NAME the dataset folder's name)
    per_class: int = 4  # images of each class
    draws: int = 4  # augmented draws of each image
    max_classes: int = 20  # the first classes shown
    seed: int = 0  # the draws' seed


def add_commands(sub) -> None:
    command(sub, "pack", pack, PackCommand, PackConfig, skip={PackConfig: ("src", "out")}, defer=(PackConfig,),
            help="pack images into HDF5 shards with a manifest",
            description="Pack SRC into shards in OUT. Inside a Slurm array or an MPI/srun job, each task packs its "
                        "part and the last one merges the manifest.")
    command(sub, "show", show, ShowCommand, help="class counts, image sizes and a contact sheet of the augmentation",
            description="Print DATASET's class counts and stored sizes (warning on strong imbalance) and write a PNG: "
                        "for the first images of each class, the stored image and draws of the training augmentation.")
    command(sub, "verify", verify, VerifyCommand, help="check a packed dataset's shards against its manifest")
    command(sub, "stage", stage, StageCommand, help="copy a packed dataset to node-local disk once per node; "
            "prints its path", description="Local rank 0 copies and verifies; the node's other local ranks wait.")


def pack(cmd: PackCommand, config) -> int:
    if cmd.stats:
        manifest = restat(cmd.out)
    elif cmd.merge:
        manifest = merge(cmd.out)
    elif not cmd.src:
        raise HpcdlError("hpcdl pack needs SRC and OUT (or --merge OUT, or --stats OUT)")
    else:
        manifest = packed(config())  # built here: --merge needs no SRC
    s = summarize(manifest)
    where = "dataset" if manifest.parts == 1 else f"part {manifest.part}/{manifest.parts}"
    print(f"{cmd.out}: {where} holds {s['images']} images in {s['shards']} shards; {s['rejected']} inputs "
          f"rejected {s['rejected_by_reason'] or ''} (reasons per file in the manifest)", file=sys.stderr)
    if manifest.stats:
        st = manifest.stats
        print(f"{cmd.out}: channel mean {st['mean']}, std {st['std']} (0..1, from {st['sampled']} images); "
              f"classes {min(st['class_counts'])}-{max(st['class_counts'])} images each", file=sys.stderr)
    return 0


def verify(cmd: VerifyCommand) -> int:
    problems = problems_of(cmd.dir, full=cmd.full, sample=cmd.sample)
    for p in problems:
        print(p)
    print(f"{cmd.dir}: {'OK' if not problems else f'{len(problems)} problems'}"
          f"{' (sha256 of every shard checked)' if cmd.full else ''}", file=sys.stderr)
    return 1 if problems else 0


def stage(cmd: StageCommand) -> int:
    if cmd.epochs < 0:
        raise HpcdlError(f"--epochs {cmd.epochs}: give the run's epochs (0: weigh staging against the cache alone)")
    env = discover()
    if env.node_rank == 0 and env.local_rank == 0:  # on standard error: standard output is the staged root alone
        print(verdict(sum(s.bytes for s in load_manifest(cmd.root).shards), env.nodes, cmd.epochs), file=sys.stderr,
              flush=True)
    print(staged(cmd.root, cmd.dest, env.local_rank, timeout_s=cmd.timeout))
    return 0


def show(cmd: ShowCommand) -> int:
    for key, least in (("per_class", 1), ("draws", 0), ("max_classes", 1)):
        if getattr(cmd, key) < least:
            raise HpcdlError(f"--{key.replace('_', '-')} {getattr(cmd, key)} must be at least {least}")
    manifest = load_manifest(cmd.dataset)
    shown = deferred("hpcdl.data.show")  # torch: the draws of the augmentation
    lines, warnings = shown.summary(cmd.dataset, manifest)
    print("\n".join(lines))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    cfg = deferred("hpcdl.models").with_model_defaults(resolve(cmd.config))[0] if cmd.config else None
    data: DataConfig = cfg.data if cfg else DataConfig()
    crop = cmd.crop or (cfg.crop if cfg else 224)
    steps = recipe.parse(cmd.augment or data.augment, "--augment" if cmd.augment else "data.augment")
    out = cmd.out or f"{os.path.basename(os.path.normpath(cmd.dataset))}-sheet.png"
    sheet = shown.contact_sheet(cmd.dataset, out, steps, crop, per_class=cmd.per_class, draws=cmd.draws,
                          max_classes=cmd.max_classes, seed=cmd.seed, decoder=data.decoder, channels=data.channels)
    print(f"contact sheet: {sheet.path}: {sheet.rows} images of {len(set(sheet.classes))} classes, the stored image "
          f"and {cmd.draws} draws of {', '.join(map(str, steps))} at crop {crop}")
    return 0
