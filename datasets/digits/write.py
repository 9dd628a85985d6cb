"""Write scikit-learn's handwritten digits (1,797 real 8x8 scans) as a class-folder tree of 32x32 JPEGs.

    python datasets/digits/write.py OUT [--size 32] [--val 0.2] [--seed 0] [--digits 0-9] [--train-per-class N]

OUT/train/<digit>/*.jpg and OUT/val/<digit>/*.jpg, split per class with a fixed seed; ``hpcdl pack
OUT/train ... --tree folder`` packs them. The guide in docs/data.md walks the rest. ``--digits 0-5`` and
``--digits 6-9`` write two datasets with no class and no image in common (docs/models.md fine-tunes from one
to the other); ``--train-per-class`` keeps that many training images of each digit (a small dataset).
"""

import argparse
import os

import numpy as np
from PIL import Image


def write(out: str, size: int = 32, val: float = 0.2, seed: int = 0, digits: range = range(10),
          train_per_class: int = 0) -> dict[str, int]:
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(seed).permutation(len(d.target))
    counts = {"train": 0, "val": 0}
    seen: dict[int, int] = {}
    per_class = np.bincount(d.target)
    for i in order:
        label = int(d.target[i])
        if label not in digits:
            continue
        k = seen[label] = seen.get(label, 0) + 1
        split = "val" if k <= round(val * per_class[label]) else "train"
        if split == "train" and train_per_class and k > round(val * per_class[label]) + train_per_class:
            continue
        folder = os.path.join(out, split, str(label))
        os.makedirs(folder, exist_ok=True)
        pixels = (d.images[i] * (255 / 16)).astype(np.uint8)  # 0..16 ink levels
        Image.fromarray(pixels, "L").resize((size, size), Image.Resampling.BICUBIC).save(
            os.path.join(folder, f"{i:04d}.jpg"), quality=95)
        counts[split] += 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--val", type=float, default=0.2, help="the fraction of each class kept for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", default="0-9", help="the digits to write, FIRST-LAST (e.g. 6-9)")
    p.add_argument("--train-per-class", type=int, default=0, help="keep this many training images a digit (0: all)")
    a = p.parse_args()
    first, _, last = a.digits.partition("-")
    if not (first.isdigit() and (last or first).isdigit() and int(first) <= int(last or first) <= 9):
        p.error(f"--digits {a.digits}: give FIRST-LAST within 0-9, e.g. 6-9")
    digits = range(int(first), int(last or first) + 1)
    counts = write(a.out, a.size, a.val, a.seed, digits, a.train_per_class)
    print(f"wrote {counts['train']} train and {counts['val']} val images of {len(digits)} digits to {a.out}")


if __name__ == "__main__":
    main()
