"""``hpcdl pack``, ``hpcdl verify`` and ``hpcdl stage``: datasets in HDF5 shards."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from hpcdl.data.options import PackConfig
from hpcdl.errors import HpcdlError
from hpcdl.flags import meta


@dataclass(kw_only=True, slots=True)
class PackCommand:
    src: str | None = field(default=None, metadata=meta(positional=True))  # the images (see --layout)
    out: str = field(metadata=meta(positional=True))  # the dataset root to write
    merge: bool = False  # only merge finished parts into manifest.json


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


def add_commands(sub) -> None:
    from hpcdl.cli import command

    command(sub, "pack", pack, PackCommand, PackConfig, skip={PackConfig: ("src", "out")}, defer=(PackConfig,),
            help="pack images into HDF5 shards with a manifest",
            description="Pack SRC into shards in OUT. Inside a Slurm array or an MPI/srun job, each task packs its "
                        "part and the last one merges the manifest.")
    command(sub, "verify", verify, VerifyCommand, help="check a packed dataset's shards against its manifest")
    command(sub, "stage", stage, StageCommand, help="copy a packed dataset to node-local disk once per node; "
            "prints its path", description="Local rank 0 copies and verifies; the node's other local ranks wait.")


def pack(cmd: PackCommand, config) -> int:
    from hpcdl.data.format import summarize
    from hpcdl.data.pack import merge, pack as packed

    if cmd.merge:
        manifest = merge(cmd.out)
    elif not cmd.src:
        raise HpcdlError("hpcdl pack needs SRC and OUT (or --merge OUT)")
    else:
        manifest = packed(config())  # built here: --merge needs no SRC
    s = summarize(manifest)
    where = "dataset" if manifest.parts == 1 else f"part {manifest.part}/{manifest.parts}"
    print(f"{cmd.out}: {where} holds {s['images']} images in {s['shards']} shards; {s['rejected']} inputs "
          f"rejected {s['rejected_by_reason'] or ''} (reasons per file in the manifest)", file=sys.stderr)
    return 0


def verify(cmd: VerifyCommand) -> int:
    from hpcdl.data.verify import verify as problems_of

    problems = problems_of(cmd.dir, full=cmd.full, sample=cmd.sample)
    for p in problems:
        print(p)
    print(f"{cmd.dir}: {'OK' if not problems else f'{len(problems)} problems'}"
          f"{' (sha256 of every shard checked)' if cmd.full else ''}", file=sys.stderr)
    return 1 if problems else 0


def stage(cmd: StageCommand) -> int:
    from hpcdl.data.stage import stage as staged
    from hpcdl.distributed.env import discover

    print(staged(cmd.root, cmd.dest, discover().local_rank, timeout_s=cmd.timeout))
    return 0
