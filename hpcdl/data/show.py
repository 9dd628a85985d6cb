"""``hpcdl show DATASET``: look at a packed dataset before training on it.

It prints the class counts and the stored image sizes (warning when the classes are strongly
imbalanced), and writes a PNG contact sheet: for the first images of each shown class, the stored image,
then ``draws`` draws of the training augmentation at the run's crop, as the model will see them, with
the class name at the start of each row.
"""

from __future__ import annotations

import io
import os
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from hpcdl.data.format import MANIFEST, Manifest, open_h5
from hpcdl.data.stats import imbalance, measure
from hpcdl.data.transforms import Augment

IMBALANCE_WARN = 10.0  # the largest class over the smallest, from which show warns
LIST_UP_TO = 50  # classes listed one by one


@dataclass(frozen=True, slots=True)
class Sheet:
    path: str
    classes: list[str]  # the rows' classes, in order
    rows: int
    columns: int  # the stored image, then the draws
    cell: int  # pixels


def class_names(manifest: Manifest) -> list[str]:
    return [c["name"] or c["wnid"] for c in manifest.classes]


def summary(root: str, manifest: Manifest) -> tuple[list[str], list[str]]:
    """(lines to print, warnings): class counts and image sizes from the manifest's stats."""
    stats = manifest.stats or measure(root, manifest, sample=0)
    counts, names = stats["class_counts"], class_names(manifest)
    lines = [f"{root}: {manifest.num_images} images in {manifest.num_classes} classes, {len(manifest.shards)} shards"]
    size = stats.get("size") or {}
    if size.get("height"):
        lines.append("stored size: height {} / {} / {}, width {} / {} / {} (min / median / max)".format(
            *size["height"], *size["width"]))
    if stats.get("mean"):
        lines.append(f"channel mean {stats['mean']}, std {stats['std']} (0..1 units, {stats['sampled']} images)")
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    shown = order if len(counts) <= LIST_UP_TO else order[:5] + order[-5:]
    lines.append("class counts" + ("" if len(counts) <= LIST_UP_TO else " (the 5 smallest and the 5 largest)") + ":")
    lines += [f"  {names[i]:>20s} {counts[i]:8d}" for i in sorted(shown)]
    warnings = []
    ratio = imbalance(counts)
    if ratio >= IMBALANCE_WARN:
        small, large = order[0], order[-1]
        warnings.append(f"strong class imbalance: {names[large]} has {counts[large]} images, {names[small]} "
                        f"{counts[small]} ({ratio:.0f}x); accuracy will favour the large classes: look at the "
                        "per-class accuracy of each evaluation (RUN_DIR/eval), or rebalance the data")
    return lines, warnings


def _first_of_each(root: str, manifest: Manifest, classes: list[int], per_class: int) -> dict[int, list[bytes]]:
    want = {c: [] for c in classes}
    for s in manifest.shards:
        with open_h5(os.path.join(root, s.file)) as h5:
            labels, offsets, images = h5["labels"][:], h5["offsets"][:], h5["images"]
            for i, y in enumerate(labels.tolist()):
                if y in want and len(want[y]) < per_class:
                    want[y].append(images[offsets[i]:offsets[i + 1]].tobytes())
        if all(len(v) >= per_class for v in want.values()):
            break
    return want


def contact_sheet(root: str, out: str, augment, crop: int, *, per_class: int = 4, draws: int = 4,
                  max_classes: int = 20, seed: int = 0, decoder: str = "pillow", channels: int = 3) -> Sheet:
    """Write the PNG; returns what it holds."""
    manifest = Manifest.load(os.path.join(root, MANIFEST))
    names = class_names(manifest)
    shown = list(range(min(max_classes, len(names))))
    found = _first_of_each(root, manifest, shown, per_class)
    transform = Augment(augment, crop, decoder=decoder, channels=channels)
    cell = max(64, crop) if crop >= 64 else crop * max(1, 96 // crop)  # small crops are enlarged to see them
    font = ImageFont.load_default()
    label_w = max(font.getbbox(n)[2] for n in (names[c] for c in shown)) + 12
    rows = [(c, data) for c in shown for data in found[c]]
    columns = 1 + draws
    sheet = Image.new("RGB", (label_w + columns * (cell + 4), 20 + len(rows) * (cell + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((label_w, 4), "stored", fill="black", font=font)
    for d in range(draws):
        draw.text((label_w + (1 + d) * (cell + 4), 4), f"augmented {d + 1}", fill="black", font=font)
    for r, (c, data) in enumerate(rows):
        y = 20 + r * (cell + 4)
        draw.text((4, y + cell // 2 - 5), names[c], fill="black", font=font)
        stored = Image.open(io.BytesIO(data)).convert("RGB")
        stored.thumbnail((cell, cell), Image.Resampling.BILINEAR)
        if max(stored.size) < cell:  # a small image is enlarged pixel for pixel
            k = cell / max(stored.size)
            stored = stored.resize((max(1, round(stored.width * k)), max(1, round(stored.height * k))),
                                   Image.Resampling.NEAREST)
        sheet.paste(stored, (label_w, y))
        for d in range(draws):
            x = transform(data, random.Random(f"{seed}:{d}:{r}")).numpy()
            im = Image.fromarray(x[:, :, 0] if x.shape[2] == 1 else x).convert("RGB")
            sheet.paste(im.resize((cell, cell), Image.Resampling.NEAREST), (label_w + (1 + d) * (cell + 4), y))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    sheet.save(tmp, format="PNG")
    os.replace(tmp, out)
    return Sheet(out, [names[c] for c, _ in rows], len(rows), columns, cell)
