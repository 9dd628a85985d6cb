"""``hpcdl verify``: the manifest against the shards. Every problem names its file."""

from __future__ import annotations

import glob
import io
import os

from PIL import Image

from hpcdl.data.format import MANIFEST, TMP_SUFFIX, Manifest, check_shard, open_h5


def load_manifest(root: str) -> Manifest:
    return Manifest.load(os.path.join(root, MANIFEST))


def check_dataset(root: str, manifest: Manifest, full: bool = False, rank: int = 0, world: int = 1,
                  split: bool = False) -> list[str]:
    """Problems with the shards; ``full`` hashes them, split over ``world`` callers by ``rank``. ``split``: check
    only this caller's shards (``i % world == rank``) at all, for callers that pool what they found."""
    problems = []
    for i, entry in enumerate(manifest.shards):
        if not split or i % world == rank:
            problems += check_shard(root, entry, manifest.num_classes, full=full and i % world == rank)
    return problems


def verify(root: str, full: bool = False, sample: int = 4) -> list[str]:
    """All problems found: shards (counts, sizes, sha256 with ``full``), a sample decode, stray files."""
    manifest = load_manifest(root)
    problems = []
    for entry in manifest.shards:
        found = check_shard(root, entry, manifest.num_classes, full=full)
        problems += found or _sample_decode(os.path.join(root, entry.file), sample)
    listed = {s.file for s in manifest.shards}
    for f in sorted(glob.glob(os.path.join(glob.escape(root), "*.h5"))):
        if os.path.basename(f) not in listed:
            problems.append(f"{f}: a shard the manifest does not list (left by another pack?)")
    for f in sorted(glob.glob(os.path.join(glob.escape(root), f"*{TMP_SUFFIX}"))):
        problems.append(f"{f}: a temporary file of an unfinished pack; rerun 'hpcdl pack --resume'")
    return problems


def _sample_decode(path: str, sample: int) -> list[str]:
    with open_h5(path) as f:
        offsets, images, n = f["offsets"][:], f["images"], len(f["labels"])
        sizes = f["sizes"][:] if "sizes" in f else None
        picks = sorted({round(k * (n - 1) / max(sample - 1, 1)) for k in range(min(sample, n))})
        problems = []
        for i in picks:
            try:
                im = Image.open(io.BytesIO(images[offsets[i]:offsets[i + 1]].tobytes()))
                im.load()
            except (OSError, SyntaxError, ValueError) as exc:
                problems.append(f"{path}: image {i} does not decode ({exc})")
                continue
            if sizes is not None and tuple(sizes[i]) != (im.height, im.width):
                problems.append(f"{path}: image {i} is {im.height}x{im.width}, the shard says {tuple(sizes[i])}")
    return problems
