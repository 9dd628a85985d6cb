"""Synthetic ImageNet-like JPEGs: real files, at ImageNet's sizes, with classes a small CNN learns fast.

Class ``c`` has its own hue and stripe angle and frequency; each image adds a random phase, a gradient,
a few blobs and noise, at a size drawn around 500x375 like ImageNet's. Layouts match ``hpcdl pack``:
``folder`` (``wnid/*.JPEG``), ``imagenet`` (``train/wnid/*.JPEG``, a flat ``val/`` with ILSVRC2012's
ground-truth file and synset list, and ``synset_words.txt``) and ``imagenet22k-tars`` (one tar per wnid). ``quirks`` adds the inputs that break naive packers.
"""

from __future__ import annotations

import colorsys
import io
import os
import tarfile
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from hpcdl.errors import ConfigError

TREES = ("folder", "imagenet", "imagenet22k-tars")


def wnid(c: int) -> str:
    return f"n{90000000 + c:08d}"


def synthetic_image(c: int, classes: int, rng: np.random.Generator, size: tuple[int, int] | None = None) -> np.ndarray:
    """An H,W,3 uint8 image of class ``c``."""
    w, h = size or (int(rng.integers(400, 601)), int(rng.integers(300, 451)))
    angle = np.pi * c / classes
    freq = 0.04 + 0.08 * ((c * 7) % classes) / classes
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    stripes = np.sin((x * np.cos(angle) + y * np.sin(angle)) * freq + rng.uniform(0, 2 * np.pi))
    base = np.array(colorsys.hsv_to_rgb(c / classes, 0.7, 0.8), dtype=np.float32) * 255
    img = base * (0.75 + 0.25 * stripes[..., None]) + (x / w * 40 - 20)[..., None]
    for _ in range(3):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(15, 60)
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 12, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, quality: int = 90, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, "JPEG", quality=quality)
    return out.getvalue()


@dataclass(slots=True)
class Generated:
    root: str
    count: int = 0
    quirks: dict = field(default_factory=dict)  # quirk -> file path (bytes for the non-UTF-8 name)
    extra: dict = field(default_factory=dict)  # imagenet: paths of val/, its label files, and truth


def generate(out: str, classes: int = 10, per_class: int = 20, tree: str = "folder", quirks: bool = False,
             seed: int = 0, size: tuple[int, int] | None = None, val_per_class: int = 5) -> Generated:
    """Write the tree; ``quirks`` go into the first class (the train tree's, for ``imagenet``)."""
    if tree not in TREES:
        raise ConfigError(f"tree {tree!r} is unknown; choose one of {', '.join(TREES)}")
    if classes < 2 or per_class < 1:
        raise ConfigError("need at least 2 classes and 1 image per class")
    if quirks and tree == "imagenet22k-tars":
        raise ConfigError("quirks go into a class folder; use tree folder or imagenet")
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    gen = Generated(root=out)
    train = os.path.join(out, "train") if tree == "imagenet" else out
    labels, images = _images(classes, per_class, rng, size)
    (_tars if tree == "imagenet22k-tars" else _folder)(train, labels, images)
    gen.count = len(images)
    if tree == "imagenet":
        gen.extra = _val(out, *_images(classes, val_per_class, rng, size), rng)
        _write(os.path.join(out, "synset_words.txt"), "".join(f"{wnid(c)} class {c}\n" for c in range(classes)).encode())
    if quirks:
        gen.quirks = write_quirks(os.path.join(train, wnid(0)), classes, rng)
    return gen


def _images(classes: int, per_class: int, rng, size) -> tuple[list[int], list[bytes]]:
    labels = [c for c in range(classes) for _ in range(per_class)]
    return labels, [jpeg(synthetic_image(c, classes, rng, size)) for c in labels]


def _folder(root: str, labels, images) -> None:
    for i, (c, data) in enumerate(zip(labels, images)):
        os.makedirs(os.path.join(root, wnid(c)), exist_ok=True)
        _write(os.path.join(root, wnid(c), f"{wnid(c)}_{i}.JPEG"), data)


def _val(out: str, labels, images, rng) -> dict:
    """ILSVRC2012's form: IDs number the synsets in an order that is not sorted by wnid."""
    classes = max(labels) + 1
    id_order = [int(c) for c in rng.permutation(classes)]  # ID k+1 is class id_order[k]
    id_of = {c: k + 1 for k, c in enumerate(id_order)}
    order = rng.permutation(len(images))  # files are not grouped by class
    val = os.path.join(out, "val")
    os.makedirs(val, exist_ok=True)
    truth, lines = {}, []
    for n, i in enumerate(order, start=1):
        name = f"ILSVRC2012_val_{n:08d}.JPEG"
        _write(os.path.join(val, name), images[i])
        truth[name] = wnid(labels[i])
        lines.append(f"{id_of[labels[i]]}\n")
    extra = {"dir": val, "val_labels": os.path.join(out, "ILSVRC2012_validation_ground_truth.txt"),
             "synsets": os.path.join(out, "map_clsloc.txt"), "truth": truth}
    _write(extra["val_labels"], "".join(lines).encode())
    _write(extra["synsets"], "".join(f"{wnid(c)} {k + 1} class_{c}\n" for k, c in enumerate(id_order)).encode())
    return extra


def _tars(root: str, labels, images) -> None:
    for c in sorted(set(labels)):
        with tarfile.open(os.path.join(root, f"{wnid(c)}.tar"), "w") as t:
            for i in (i for i, lab in enumerate(labels) if lab == c):
                info = tarfile.TarInfo(f"{wnid(c)}_{i}.JPEG")
                info.size = len(images[i])
                t.addfile(info, io.BytesIO(images[i]))


def write_quirks(folder: str, classes: int, rng: np.random.Generator) -> dict:
    """The inputs real ImageNet holds that break naive packers, as real files; -> quirk -> path."""
    os.makedirs(folder, exist_ok=True)
    pixels = synthetic_image(0, classes, rng)
    good = jpeg(pixels)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    files = {
        "png_named_jpeg": png.getvalue(),
        "cmyk": jpeg(pixels, mode="CMYK"),
        "grayscale": jpeg(pixels, mode="L"),
        "truncated": good[:len(good) // 2],
        "header_cut": good[:300],  # a partial download: cut inside the JPEG header (Pillow fails in open())
        "corrupt": good[:2] + bytes(rng.integers(0, 256, 4000, dtype=np.uint8)),
        "empty": b"",
        "not_image": b"this is a text file, not an image\n",
    }
    paths = {}
    for quirk, data in files.items():
        paths[quirk] = os.path.join(folder, f"quirk_{quirk}.JPEG")
        _write(paths[quirk], data)
    paths["unreadable"] = os.path.join(folder, "quirk_unreadable.JPEG")
    os.symlink(os.path.join(folder, "no-such-file"), paths["unreadable"])  # readable by no one, root included
    paths["bad_name"] = os.path.join(os.fsencode(folder), b"quirk_bad_name_\xff\xfe.JPEG")
    _write(paths["bad_name"], good)
    return paths


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
