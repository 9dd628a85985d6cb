"""Decode and augment, from encoded bytes to an HWC uint8 tensor, the standard ImageNet recipe.

Each transform picks its crop *before* decoding and asks libjpeg-turbo (through Pillow's draft mode) to
decode at 1/2, 1/4 or 1/8 scale whenever the crop still covers the output at that scale; the crop and
resize are then one Pillow ``resize(box=...)``. Batches stay uint8 until :func:`normalize_batch`.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import torch
from PIL import Image

# ImageNet channel statistics, in 0..255 units because batches arrive as uint8.
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _decode(im: Image.Image, want: tuple[int, int] | None) -> Image.Image:
    if want is not None:
        im.draft("RGB", want)  # JPEG only; picks the largest DCT scale whose output is still >= want
    return im if im.mode == "RGB" else im.convert("RGB")


def _to_tensor(im: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(im, dtype=np.uint8))  # H, W, C


class DecodeOnly:
    """The whole image at full resolution, as stored."""

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        return _to_tensor(_decode(Image.open(io.BytesIO(data)), None))


class TrainTransform:
    """RandomResizedCrop(size, scale, ratio) and a horizontal flip, as torchvision samples them."""

    def __init__(self, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5,
                 draft: bool = True):
        self.size, self.scale, self.ratio, self.flip, self.draft = size, scale, ratio, flip, draft

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        rng = rng or random  # the module's functions: the RNG DataLoader seeds in each worker
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        top, left, ch, cw = crop_params(w, h, self.scale, self.ratio, rng)
        want = (math.ceil(w * self.size / cw), math.ceil(h * self.size / ch)) if self.draft else None
        im = _decode(im, want)
        sx, sy = im.width / w, im.height / h
        im = im.resize((self.size, self.size), Image.Resampling.BILINEAR,
                       box=(left * sx, top * sy, (left + cw) * sx, (top + ch) * sy))
        if rng.random() < self.flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _to_tensor(im)


def crop_params(w: int, h: int, scale, ratio, rng=random) -> tuple[int, int, int, int]:
    """(top, left, height, width): torchvision's RandomResizedCrop.get_params, drawing from ``rng``."""
    area = w * h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        cw, ch = int(round(h * max(ratio))), h
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


class EvalTransform:
    """Resize the short side to ``resize``, then a center crop of ``size`` (torchvision's rounding)."""

    def __init__(self, resize: int = 256, size: int = 224, draft: bool = True):
        self.resize, self.size, self.draft = resize, size, draft

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        nw, nh = (self.resize, int(self.resize * h / w)) if w <= h else (int(self.resize * w / h), self.resize)
        top, left = int(round((nh - self.size) / 2.0)), int(round((nw - self.size) / 2.0))
        im = _decode(im, (nw, nh) if self.draft else None)
        sx, sy = im.width / nw, im.height / nh  # resized-image pixels -> decoded pixels
        box = (left * sx, top * sy, (left + self.size) * sx, (top + self.size) * sy)
        return _to_tensor(im.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box))


def normalize_batch(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last: bool = False,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 N,H,W,C -> normalized N,C,H,W in ``dtype``; channels_last keeps the NHWC memory for free."""
    x = images.permute(0, 3, 1, 2).to(dtype)  # preserves the NHWC strides: channels_last memory format
    if not channels_last:
        x = x.contiguous()
    m = torch.tensor(mean, dtype=dtype).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=dtype).view(1, 3, 1, 1)
    return x.sub_(m).div_(s)
