"""What ``hpcdl pack`` measures of a packed dataset for the manifest's ``stats``: each channel's mean and
standard deviation (from a seeded sample of the images, decoded at their packed size), the class counts
and the stored image sizes. Training normalizes with the channel statistics (``data.normalize=dataset``);
``hpcdl show`` prints the rest."""

from __future__ import annotations

import io
import os
import random

import numpy as np
from PIL import Image

from hpcdl.data.format import Manifest, open_h5

SAMPLE = 2000  # images decoded for the channel statistics
SEED = 0


def measure(root: str, manifest: Manifest, sample: int = SAMPLE, seed: int = SEED) -> dict:
    """The ``stats`` entry of ``root``'s manifest (JSON-ready; channel values in 0..1 units)."""
    n = manifest.num_images
    picks = sorted(random.Random(seed).sample(range(n), min(sample, n)))
    starts = np.cumsum([0] + [s.count for s in manifest.shards])
    labels, sizes = [np.zeros(0, np.int64)], [np.zeros((0, 2), np.int32)]
    sums = np.zeros((2, 3))  # RGB: sum, sum of squares
    gray = np.zeros(2)
    pixels = 0
    for shard, entry in enumerate(manifest.shards):  # one pass: each shard opened once
        with open_h5(os.path.join(root, entry.file)) as h5:
            labels.append(h5["labels"][:])
            if "sizes" in h5:
                sizes.append(h5["sizes"][:])
            offsets, images = h5["offsets"][:], h5["images"]
            for i in (i - starts[shard] for i in picks if starts[shard] <= i < starts[shard + 1]):
                im = Image.open(io.BytesIO(images[offsets[i]:offsets[i + 1]].tobytes()))
                rgb = np.asarray(im.convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255
                g = np.asarray(im.convert("L"), dtype=np.float64).ravel() / 255
                sums += (rgb.sum(0), (rgb * rgb).sum(0))
                gray += (g.sum(), (g * g).sum())
                pixels += len(g)
    labels, sizes = np.concatenate(labels), np.concatenate(sizes)
    mean, gmean = sums[0] / max(pixels, 1), gray[0] / max(pixels, 1)
    std = np.sqrt(np.maximum(sums[1] / max(pixels, 1) - mean ** 2, 0))
    gstd = float(np.sqrt(max(gray[1] / max(pixels, 1) - gmean ** 2, 0)))
    size = {axis: [int(v) for v in np.percentile(sizes[:, k], (0, 50, 100), method="nearest")] if len(sizes) else []
            for k, axis in enumerate(("height", "width"))}
    measured = bool(pixels)
    return {"sampled": len(picks), "seed": seed, "mean": [round(float(v), 6) for v in mean] if measured else [],
            "std": [round(float(v), 6) for v in std] if measured else [],
            "mean_gray": round(float(gmean), 6) if measured else None,
            "std_gray": round(gstd, 6) if measured else None,
            "class_counts": np.bincount(labels, minlength=manifest.num_classes).tolist(),
            "size": size}


def imbalance(counts: list[int]) -> float:
    """The largest class over the smallest (inf when a class is empty)."""
    return max(counts) / min(counts) if counts and min(counts) else float("inf")
