"""Pack-time image handling: validate each input, keep its bytes when they are a sound RGB JPEG, and
otherwise convert, optionally resize, and re-encode. Each refusal is a :class:`Rejected` with a reason."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from hpcdl.data.options import Encoding


class Rejected(Exception):
    """This input is skipped; the message is the reason the manifest records."""




def prepare(data: bytes, enc: Encoding) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """-> (JPEG bytes, stored (height, width), original (height, width)). Raises Rejected."""
    if not data:
        raise Rejected("empty file")
    try:  # a file cut inside its header fails in open(), one cut in its data in load()
        with warnings.catch_warnings():  # Pillow's warnings on damaged metadata: the manifest says it
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            original = (im.height, im.width)
            target = enc.target(*im.size)
            if target and im.format == "JPEG":
                im.draft("RGB", target)  # decode at 1/2, 1/4 or 1/8 scale when that still covers the target
            fmt, mode = im.format, im.mode
            im.load()  # a full decode: truncated and corrupt files fail here, not in training
    except UnidentifiedImageError:
        raise Rejected("not an image: no image format Pillow knows starts these bytes") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise Rejected(f"not an image: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise Rejected(f"truncated or corrupt: {exc}") from None
    if fmt == "JPEG" and mode == "RGB" and target is None:
        return data, original, original
    im = to_rgb(im)
    if target:
        im = im.resize(target, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=enc.quality)
    return out.getvalue(), (im.height, im.width), original


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB for any mode: CMYK through Pillow's Adobe-aware conversion, transparency composited on white."""
    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        im = im.convert("RGBA")
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, im).convert("RGB")
    try:
        return im.convert("RGB")
    except ValueError as exc:
        raise Rejected(f"unsupported image mode {im.mode}: {exc}") from None
