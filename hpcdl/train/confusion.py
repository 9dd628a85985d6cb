"""Per-class accuracy and the confusion matrix of an evaluation, as a run folder's files and TensorBoard's.

At each evaluation rank 0 writes ``eval/step-NNNNNNNNN.json`` (each class's images and accuracy, the
matrix, the worst-confused pairs) and ``eval/confusion-step-NNNNNNNNN.png``: one cell per (true class,
predicted class), shaded by the fraction of the true class's images, with the class names along the
edges when they fit. The log names the worst-confused pairs.
"""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from hpcdl.utils import atomic_write_text

LABELS_UP_TO = 60  # classes: names along the edges
COUNTS_UP_TO = 20  # classes: the count written in each cell


def report(confusion: np.ndarray, classes: list[str], top: int = 5) -> dict:
    """Per-class accuracy and the ``top`` off-diagonal cells, largest first."""
    confusion = np.asarray(confusion, dtype=np.int64)
    per_class = confusion.sum(1)
    hits = np.diag(confusion)
    off = confusion.copy()
    np.fill_diagonal(off, 0)
    order = np.argsort(off, axis=None)[::-1][:top]
    pairs = [{"true": classes[i], "predicted": classes[j], "count": int(off[i, j]), "of": int(per_class[i])}
             for i, j in zip(*np.unravel_index(order, off.shape)) if off[i, j] > 0]
    return {"classes": classes, "images": per_class.tolist(),
            "accuracy": [round(100 * h / c, 3) if c else None for h, c in zip(hits.tolist(), per_class.tolist())],
            "worst_pairs": pairs, "confusion": confusion.tolist()}


def geometry(classes: list[str]) -> dict:
    """Where the cells are: cell (i, j) spans ``origin + (j, i) * cell``, ``cell`` pixels a side."""
    n = len(classes)
    font = ImageFont.load_default()
    margin = (max(font.getbbox(c)[2] for c in classes) + 8) if n <= LABELS_UP_TO else 4
    return {"origin": [margin, margin], "cell": max(1, min(40, 2000 // max(n, 1)))}  # at most ~2,000 pixels


def render(confusion: np.ndarray, classes: list[str]) -> Image.Image:
    """The matrix as an RGB image: rows are the true classes, columns the predictions, each cell shaded by
    its share of the row (white: none); the diagonal in blue, errors in red."""
    confusion = np.asarray(confusion, dtype=np.int64)
    n = len(classes)
    g = geometry(classes)
    cell, margin = g["cell"], g["origin"][0]
    font = ImageFont.load_default()
    labels = n <= LABELS_UP_TO
    share = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)
    v = np.where(confusion > 0, np.maximum(share, 0.08), 0.0)  # a single error stays visible
    right = np.eye(n, dtype=bool)[:, :, None]
    colors = np.where(right, np.stack([1 - v, 1 - 0.8 * v, np.ones_like(v)], -1),
                      np.stack([np.ones_like(v), 1 - v, 1 - v], -1))
    cells = np.repeat(np.repeat((255 * colors).astype(np.uint8), cell, 0), cell, 1)
    if cell >= 8:  # grid lines
        cells[cell - 1::cell, :] = 200
        cells[:, cell - 1::cell] = 200
    size = margin + n * cell + 4
    im = Image.new("RGB", (size, size), "white")
    im.paste(Image.fromarray(cells), (margin, margin))
    draw = ImageDraw.Draw(im)
    if n <= COUNTS_UP_TO:
        for i, j in zip(*np.nonzero(confusion)):
            draw.text((margin + j * cell + 2, margin + i * cell + 2), str(int(confusion[i, j])),
                      fill="black" if v[i, j] < 0.6 else "white", font=font)
    if labels:
        for k, name in enumerate(classes):
            draw.text((2, margin + k * cell + max(0, cell // 2 - 5)), name, fill="black", font=font)
            draw.text((margin + k * cell + 2, 2), name[:max(1, cell // 6)], fill="black", font=font)
    return im


def write(run_dir: str, step: int, confusion, classes: list[str], tb=None) -> dict:
    """The JSON and the PNG of one evaluation, and TensorBoard's image and per-class scalars."""
    folder = os.path.join(run_dir, "eval")
    os.makedirs(folder, exist_ok=True)
    body = report(confusion, classes)
    body["image"] = {"file": f"confusion-step-{step:09d}.png", **geometry(classes)}
    atomic_write_text(os.path.join(folder, f"step-{step:09d}.json"), json.dumps({"step": step, **body}) + "\n")
    image = render(confusion, classes)
    tmp = os.path.join(folder, f".confusion-step-{step:09d}.png.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, os.path.join(folder, body["image"]["file"]))
    if tb is not None:
        tb.add_image("eval/confusion", np.asarray(image).transpose(2, 0, 1), step)
        if len(classes) <= 100:
            for name, acc in zip(classes, body["accuracy"]):
                if acc is not None:
                    tb.add_scalar(f"eval_class/{name}", acc, step)
    return body


def describe(body: dict) -> str:
    pairs = body["worst_pairs"]
    if not pairs:
        return "no class confused with another"
    acc = [(a, c) for a, c in zip(body["accuracy"], body["classes"]) if a is not None]
    worst = min(acc) if acc else None
    return ("most confused: " + ", ".join(f"{p['true']} taken for {p['predicted']} ({p['count']} of {p['of']})"
                                          for p in pairs)
            + (f"; lowest class accuracy {worst[0]:.1f}% ({worst[1]})" if worst else ""))
