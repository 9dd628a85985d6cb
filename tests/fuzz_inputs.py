"""The packer fuzz corpus: real files that Pillow writes, and the mutations a cluster's inputs go through
(partial downloads, bit rot, wrong files, decompression bombs).

``corpus()`` -> name -> bytes; ``mutants(corpus, n, seed)`` -> (name, bytes), ``n`` scaling the random
mutations per file (the tests use ``HPCDL_FUZZ_N``, default 8).
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def _pixels(size=(48, 40), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    base = np.stack([x * 5 % 256, y * 6 % 256, (x + y) * 3 % 256], -1)
    return (base + rng.integers(0, 40, base.shape)).clip(0, 255).astype(np.uint8)


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def corpus() -> dict[str, bytes]:
    rgb = Image.fromarray(_pixels())
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray((_pixels()[..., 0] // 2).astype(np.uint8)))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90
    frames = [Image.fromarray(_pixels(seed=s)).convert("P") for s in range(3)]
    gray16 = Image.fromarray(_pixels()[..., 0].astype(np.uint16) * 257)  # mode I;16
    return {
        "baseline.jpg": _save(rgb, "JPEG", quality=90),
        "progressive.jpg": _save(rgb, "JPEG", quality=85, progressive=True),
        "cmyk.jpg": _save(rgb.convert("CMYK"), "JPEG"),
        "grayscale.jpg": _save(rgb.convert("L"), "JPEG"),
        "exif_rotated.jpg": _save(rgb, "JPEG", exif=exif.tobytes()),
        "rgb.png": _save(rgb, "PNG"),
        "rgba.png": _save(rgba, "PNG"),
        "gray16.png": _save(gray16, "PNG"),
        "palette_transparent.png": _save(palette, "PNG", transparency=0),
        "palette_transparent.gif": _save(palette, "GIF", transparency=0),
        "animated.gif": _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0),
        "rgb.webp": _save(rgb, "WEBP", quality=80),
        "rgb.tiff": _save(rgb, "TIFF"),
        "rgb.bmp": _save(rgb, "BMP"),
    }


def _segments(data: bytes) -> list[int]:
    """Offsets of JPEG markers (0xFF followed by a marker byte) or PNG chunk starts: where truncations and
    flips hurt the most."""
    if data[:2] == b"\xff\xd8":
        return [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] not in (0x00, 0xFF)][:40]
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        offsets, pos = [], 8
        while pos + 8 <= len(data):
            offsets.append(pos)
            pos += 12 + struct.unpack(">I", data[pos:pos + 4])[0]
        return offsets
    return []


def bombs() -> dict[str, bytes]:
    """Files that declare a huge size in a few bytes (decompression bombs)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 200_000, 200_000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + chunk(b"IEND", b""))
    jpeg = bytearray(corpus()["baseline.jpg"])
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 65_000, 65_000)  # height, width
    gif = bytearray(corpus()["palette_transparent.gif"])
    gif[6:10] = struct.pack("<HH", 65_000, 65_000)
    return {"bomb.png": png, "bomb.jpg": bytes(jpeg), "bomb_screen.gif": bytes(gif)}


def mutants(files: dict[str, bytes], n: int = 8, seed: int = 0):
    """Yield (name, bytes): each file whole, truncated inside the header, at segment boundaries and in the
    data, with ``n`` single-byte flips and ``n // 4 + 1`` overwritten runs; then random garbage, zero
    length and the bombs."""
    rng = np.random.default_rng(seed)
    for name, data in files.items():
        yield name, data
        cuts = sorted({*range(1, min(len(data), 64), 7), *range(64, min(len(data), 700), 53),
                       *_segments(data), *(int(x) for x in np.linspace(len(data) // 3, len(data) - 1, 4))})
        for cut in cuts:
            yield f"{name}:cut{cut}", data[:cut]
        for i in range(n):
            pos = int(rng.integers(0, len(data)))
            flipped = bytearray(data)
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
            yield f"{name}:flip{pos}", bytes(flipped)
        for i in range(n // 4 + 1):
            pos = int(rng.integers(0, len(data)))
            run = bytearray(data)
            run[pos:pos + 16] = rng.integers(0, 256, len(run[pos:pos + 16]), dtype=np.uint8).tobytes()
            yield f"{name}:overwrite{pos}", bytes(run)
    for i in range(n):
        yield f"garbage{i}", rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
    yield "empty", b""
    yield from bombs().items()


# Configs: each preset's YAML with one key deleted, retyped, renamed or moved.
CONFIG_VALUES = ["x", "", -1, 0, 1.5, True, None, [], [1, "a"], {}, {"a": 1}, 10 ** 30, "1e400", float("nan")]
CONFIG_DOCS = ["", "[]", "3", "a: [", "preset: nope", "preset: [1]", "preset: demo_tiny_lars\nloop: 3",
               "{preset: demo_tiny_lars, schedule: {decay: cosine}}", "preset: demo_tiny_lars\nnope: 1",
               "preset: demo_tiny_lars\nschedule: {epochs: 3}", "\t- x", "model: resnet50"]


def _paths(data: dict, prefix=()):
    for key, value in data.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key,))


def _parent(data: dict, path):
    for key in path[:-1]:
        data = data[key]
    return data


def config_mutants(base: dict):
    """Yield (what, mapping) for ``base`` (a config as plain data) with one change each."""
    import copy

    for path in list(_paths(base)):
        name = ".".join(path)
        m = copy.deepcopy(base)
        del _parent(m, path)[path[-1]]
        yield f"delete {name}", m
        for value in CONFIG_VALUES:
            m = copy.deepcopy(base)
            _parent(m, path)[path[-1]] = value
            yield f"set {name}={value!r}", m
        m = copy.deepcopy(base)
        parent = _parent(m, path)
        parent[path[-1] + "_x"] = parent.pop(path[-1])
        yield f"rename {name}", m
        m = copy.deepcopy(base)
        value = _parent(m, path).pop(path[-1])
        target = "loop" if path[0] != "loop" else "data"
        m[target][path[-1]] = value
        yield f"move {name} under {target}", m
        if len(path) > 1:
            m = copy.deepcopy(base)
            m[path[-1]] = _parent(m, path).pop(path[-1])
            yield f"hoist {name} to the top", m
            m = copy.deepcopy(base)
            m[path[-1]] = {"nested": _parent(m, path)[path[-1]]}
            yield f"nest {name}", m
