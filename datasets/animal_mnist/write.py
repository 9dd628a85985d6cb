"""Write Animal-MNIST (the animal-mnist package's 10,000 28x28 grayscale animal silhouettes, 10 classes of
1,000) as a class-folder tree of PNGs, split per class with a fixed seed.

    python datasets/animal_mnist/write.py OUT [--val 0.2] [--seed 0] [--per-class N]

OUT/train/<label>/*.png and OUT/val/<label>/*.png; ``hpcdl pack OUT/train OUT-packed/train --tree folder``
packs them (README.md beside this file). The package (MIT, pip install --no-deps animal-mnist==0.4: its
loader module imports TensorFlow, which this script never imports) ships the images as pickled numpy arrays;
they are read with an unpickler that rebuilds numpy arrays and nothing else. The package names its ten animals
(bear, bird, cat, cow, dog, elephant, giraffe, horse, sheep, zebra) but not which label is which, so the
folders are the labels 0-9.
"""

import argparse
import gzip
import importlib.util
import os
import pickle

import numpy as np
from PIL import Image

_ARRAY_PARTS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ARRAY_PARTS:
            raise pickle.UnpicklingError(f"{module}.{name}: the animal-mnist data should hold numpy arrays only")
        return super().find_class(module, name)


def load() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [10000, 28, 28], labels int [10000]) from the installed animal-mnist package."""
    spec = importlib.util.find_spec("animal_mnist")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("animal-mnist is not installed: pip install --no-deps animal-mnist==0.4 (make venv does)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data", "Animal_MNIST")
    arrays = []
    for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
        with gzip.open(os.path.join(folder, name), "rb") as f:
            arrays.append(_ArraysOnly(f).load())
    images, labels = arrays
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise SystemExit(f"{folder}: images {images.shape} and labels {labels.shape} are not 28x28 images with a "
                         "label each; animal-mnist 0.4 is the version this script reads")
    return images, labels


def write(out: str, val: float = 0.2, seed: int = 0, per_class: int = 0) -> dict[str, int]:
    images, labels = load()
    order = np.random.default_rng(seed).permutation(len(labels))
    counts, seen = {"train": 0, "val": 0}, {}
    total = per_class or int(np.bincount(labels).max())
    for i in order:
        label = int(labels[i])
        k = seen[label] = seen.get(label, 0) + 1
        if k > total:
            continue
        split = "val" if k <= round(val * total) else "train"
        folder = os.path.join(out, split, str(label))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(images[i], "L").save(os.path.join(folder, f"{i:05d}.png"))
        counts[split] += 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--val", type=float, default=0.2, help="the fraction of each class kept for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-class", type=int, default=0, help="write this many images of each class (0: all 1,000)")
    a = p.parse_args()
    counts = write(a.out, a.val, a.seed, a.per_class)
    print(f"wrote {counts['train']} train and {counts['val']} val images of 10 animals to {a.out}")


if __name__ == "__main__":
    main()
