"""Decode and augment, from encoded bytes to an HWC uint8 tensor: the recipe of ``data.augment``.

:class:`Augment` picks its crop *before* decoding. With the ``pillow`` decoder it asks libjpeg-turbo
(Pillow's draft mode) to decode at 1/2, 1/4 or 1/8 scale whenever the crop still covers the output at that
scale, and the crop and resize are one Pillow ``resize(box=...)``; with ``torchvision`` it decodes the
whole image with ``torchvision.io.decode_jpeg`` and resizes the crop with ``resized_crop``. The pixel steps
(flips, turns, torchvision ``transforms.v2`` for the rest) then work on the uint8 tensor. Batches stay
uint8 until :func:`normalize_batch`; :class:`BatchMix` mixes a normalized batch (mixup, cutmix).

Every draw comes from the ``random.Random`` the dataset passes (seeded by seed, epoch and index), the
torchvision steps' too, so a sample gets the same augmentation wherever it is read.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import torch
from PIL import Image

from hpcdl.data.recipe import IMAGENET_STATS, Step, parse
from hpcdl.names import DECODERS

IMAGENET_MEAN, IMAGENET_STD = IMAGENET_STATS  # 0..1 units, as data.mean, data.std and a manifest's stats
_MODE = {1: "L", 3: "RGB"}


def _decode(im: Image.Image, want: tuple[int, int] | None, mode: str = "RGB") -> Image.Image:
    if want is not None:
        im.draft(mode, want)  # JPEG only; picks the largest DCT scale whose output is still >= want
    return im if im.mode == mode else im.convert(mode)


def _to_tensor(im: Image.Image) -> torch.Tensor:
    a = np.array(im, dtype=np.uint8)
    return torch.from_numpy(a if a.ndim == 3 else a[:, :, None])  # H, W, C


def _decode_tv(data: bytes, channels: int) -> torch.Tensor:
    """The whole image, C,H,W uint8, through torchvision's libjpeg-turbo (JPEG; other formats through Pillow)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if data[:2] != b"\xff\xd8":
        return _to_tensor(_decode(Image.open(io.BytesIO(data)), None, _MODE[channels])).permute(2, 0, 1)
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)


def _steps(steps) -> list[Step]:
    """Parsed steps as given, or a recipe spec (a string or a list of strings) parsed."""
    return steps if isinstance(steps, list) and all(isinstance(s, Step) for s in steps) else parse(steps)


class DecodeOnly:
    """The whole image at full resolution, as stored."""

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        return _to_tensor(_decode(Image.open(io.BytesIO(data)), None))


class Augment:
    """The training transform of a list of :class:`hpcdl.data.recipe.Step` or a recipe spec (``"imagenet"``,
    ``"light, rot90"``, a list of strings), at crop ``size``.

    The batch steps (mixup, cutmix) are left to :class:`BatchMix`.
    """

    def __init__(self, steps, size: int = 224, decoder: str = "pillow", channels: int = 3):
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r}: choose one of {', '.join(DECODERS)}")
        self.steps = _steps(steps)
        self.size, self.decoder, self.channels = size, decoder, channels
        self.sizing = self.steps[0]
        self.pixel = [_pixel_step(s) for s in self.steps[1:] if s.kind == "pixel"]

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        rng = rng or random  # the module's functions: the RNG DataLoader seeds in each worker
        x = self._sized(data, rng)
        for step in self.pixel:
            x = step(x, rng)
        return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.require(x, requirements=("C", "W")))

    def _box(self, w: int, h: int, rng) -> tuple[tuple[float, float, float, float], tuple[int, int]]:
        """The source box (left, top, right, bottom) that becomes the crop, and the shift (dx, dy) of pad_crop."""
        s = self.sizing
        if s.name == "resized_crop":
            p = s.params
            scale, ratio = (p["min_scale"], p["max_scale"]), (p["min_ratio"], p["max_ratio"])
            top, left, ch, cw = crop_params(w, h, scale, ratio, rng)
            return (left, top, left + cw, top + ch), (0, 0)
        side = min(w, h)  # center_crop and pad_crop: the central square, resized to the crop
        left, top = (w - side) / 2, (h - side) / 2
        shift = (0, 0)
        if s.name == "pad_crop":
            pad = round(s.params["pad"] * self.size)
            shift = (rng.randint(-pad, pad), rng.randint(-pad, pad))
        return (left, top, left + side, top + side), shift

    def _sized(self, data: bytes, rng):
        """The crop, H,W,C uint8: a tensor (torchvision) or a numpy array (Pillow: flips, turns and shifts
        stay in numpy, so the common recipes run no torch op, which a forked process may not survive)."""
        if self.decoder == "torchvision":
            import torchvision.transforms.v2.functional as F

            img = _decode_tv(data, self.channels)
            (l, t, r, b), shift = self._box(img.shape[2], img.shape[1], rng)
            x = F.resized_crop(img, round(t), round(l), round(b - t), round(r - l), [self.size, self.size],
                               antialias=True).permute(1, 2, 0)
        else:
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            (l, t, r, b), shift = self._box(w, h, rng)
            want = (math.ceil(w * self.size / (r - l)), math.ceil(h * self.size / (b - t)))
            im = _decode(im, want, _MODE[self.channels])
            sx, sy = im.width / w, im.height / h
            im = im.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(l * sx, t * sy, r * sx, b * sy))
            x = np.asarray(im, dtype=np.uint8)
            x = x if x.ndim == 3 else x[:, :, None]
        return _shift(x, *shift) if shift != (0, 0) else x


def _shift(x, dx: int, dy: int):
    """x moved by (dx, dy) pixels, zeros where it leaves: pad by |d| and crop back at the shifted place."""
    out = torch.zeros_like(x) if isinstance(x, torch.Tensor) else np.zeros_like(x)
    h, w = x.shape[:2]
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = x[max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]
    return out


def _flip(x, dim: int):
    return x.flip(dim) if isinstance(x, torch.Tensor) else np.flip(x, dim)


def _turn(x, k: int):
    return x.rot90(k, (0, 1)) if isinstance(x, torch.Tensor) else np.rot90(x, k, (0, 1))


def _pixel_step(step: Step):
    """A function (HWC uint8 tensor or array, rng) -> tensor or array for one pixel step."""
    p = step.params
    if step.name in ("hflip", "vflip"):
        dim = 1 if step.name == "hflip" else 0
        return lambda x, rng: _flip(x, dim) if rng.random() < p["p"] else x
    if step.name == "rot90":
        return lambda x, rng: _turn(x, rng.randint(1, 3)) if rng.random() < p["p"] else x
    import torchvision.transforms.v2 as v2

    if step.name == "color_jitter":
        t = v2.ColorJitter(brightness=p["brightness"], contrast=p["contrast"], saturation=p["saturation"], hue=p["hue"])
    elif step.name == "grayscale":
        t = v2.RandomGrayscale(p=p["p"])
    elif step.name == "randaugment":
        t = v2.RandAugment(num_ops=p["num_ops"], magnitude=p["magnitude"])
    elif step.name == "trivialaugment":
        t = v2.TrivialAugmentWide()
    else:  # erasing
        t = v2.RandomErasing(p=p["p"], scale=(p["min_area"], p["max_area"]), value=0)
    return lambda x, rng: _seeded(t, x, rng)


def _seeded(t, x, rng) -> torch.Tensor:
    """torchvision's transform ``t`` on HWC ``x``, drawing from torch's RNG seeded from ``rng``; torch's own
    RNG (dropout, the sampler) is left as it was."""
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(np.require(x, requirements=("C", "W")))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.getrandbits(63))
        return t(x.permute(2, 0, 1)).permute(1, 2, 0)


class BatchMix:
    """mixup and cutmix on a normalized batch: (images, labels) -> (mixed images, soft labels). With both,
    each batch takes one of them at random (torch's RNG, a part of every checkpoint)."""

    def __init__(self, steps, num_classes: int):
        steps = _steps(steps)
        self.mixes = []
        batch = [s for s in steps if s.kind == "batch"]
        if batch:  # torchvision only when asked for: an environment without it trains the other recipes
            import torchvision.transforms.v2 as v2

            kinds = {"mixup": v2.MixUp, "cutmix": v2.CutMix}
            self.mixes = [kinds[s.name](alpha=s.params["alpha"], num_classes=num_classes) for s in batch]

    def __bool__(self) -> bool:
        return bool(self.mixes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mix = self.mixes[0] if len(self.mixes) == 1 else self.mixes[int(torch.randint(len(self.mixes), ()))]
        return mix(images, labels)


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

    def __init__(self, resize: int = 256, size: int = 224, draft: bool = True, decoder: str = "pillow",
                 channels: int = 3):
        self.resize, self.size, self.draft, self.decoder, self.channels = resize, size, draft, decoder, channels

    def __call__(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        if self.decoder == "torchvision":
            import torchvision.transforms.v2.functional as F

            img = _decode_tv(data, self.channels)
            return F.center_crop(F.resize(img, [self.resize], antialias=True), [self.size]).permute(1, 2, 0)
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        nw, nh = (self.resize, int(self.resize * h / w)) if w <= h else (int(self.resize * w / h), self.resize)
        top, left = int(round((nh - self.size) / 2.0)), int(round((nw - self.size) / 2.0))
        im = _decode(im, (nw, nh) if self.draft else None, _MODE[self.channels])
        sx, sy = im.width / nw, im.height / nh  # resized-image pixels -> decoded pixels
        box = (left * sx, top * sy, (left + self.size) * sx, (top + self.size) * sy)
        return _to_tensor(im.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box))


def normalize_batch(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last: bool = False,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 N,H,W,C -> normalized N,C,H,W in ``dtype``; channels_last keeps the NHWC memory for free.
    ``mean`` and ``std`` are in 0..1 units, one per channel."""
    x = images.permute(0, 3, 1, 2).to(dtype)  # preserves the NHWC strides: channels_last memory format
    if not channels_last:
        x = x.contiguous()
    m = torch.tensor([v * 255 for v in mean], dtype=dtype).view(1, -1, 1, 1)
    s = torch.tensor([v * 255 for v in std], dtype=dtype).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)
