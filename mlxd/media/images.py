"""Decoding request images with Pillow: bounded before any pixel is allocated, upright, RGB, at most N pixels.

Pillow's global ``Image.MAX_IMAGE_PIXELS`` is left alone (other code in the process uses Pillow too); this module
refuses, from the size an image declares in its header, anything above Pillow's default warning threshold,
before decoding it. Below that, a large image is decoded (JPEGs at a reduced scale where libjpeg can) and
downscaled to ``max_pixels``: a big photo is never refused for being merely large.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
from dataclasses import dataclass
from functools import cache

from PIL import Image, ImageOps

from mlxd.errors import RequestError

# Pillow's default MAX_IMAGE_PIXELS (1 GiB / 4 bytes a pixel / 3, ~89.5 MP): a 60 MP camera photo decodes, a
# crafted 100000x100000 header does not. Pillow itself raises above twice this, and warns above it.
MAX_DECODE_PIXELS = 1024 * 1024 * 1024 // 4 // 3
# Formats a client plausibly sends; the rest of Pillow's plugins (EPS runs Ghostscript) are not offered the data.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
# What Pillow raises on malformed data, during open, load and EXIF parsing.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error)
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_WITH_ALPHA = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


@dataclass(frozen=True, eq=False)
class DecodedImage:
    image: Image.Image  # RGB, upright (EXIF orientation applied), at most max_pixels
    digest: str  # sha256 hex of the encoded bytes: the content identity for caches
    width: int
    height: int


def decode_image(data: bytes, *, max_pixels: int, param: str) -> DecodedImage:
    """Decode one image (the first frame of an animation) to upright RGB, downscaled to at most ``max_pixels``
    with its aspect ratio kept. Undecodable data and images declaring more than MAX_DECODE_PIXELS are a
    RequestError on ``param``, raised before the pixels are allocated."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        image = _decode(data, max_pixels, param)
    except Image.DecompressionBombError as e:
        raise _too_many_pixels(str(e), param) from e
    except _DECODE_ERRORS as e:
        raise RequestError(f"image data cannot be decoded ({type(e).__name__}: {e})", param=param) from e
    size = fit_pixels(image.width, image.height, max_pixels)
    if size != image.size:
        image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return DecodedImage(image=image, digest=digest, width=image.width, height=image.height)


def fit_pixels(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The largest size of the same aspect ratio with at most ``max_pixels`` pixels (the size itself if it fits)."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    if w * h > max_pixels:  # a side clamped to one pixel, or float rounding
        if w >= h:
            w = max(1, max_pixels // h)
        else:
            h = max(1, max_pixels // w)
    return w, h


def _decode(data: bytes, max_pixels: int, param: str) -> Image.Image:
    with Image.open(io.BytesIO(data), formats=_formats()) as im:
        if im.width * im.height > MAX_DECODE_PIXELS:
            raise _too_many_pixels(f"{im.width}x{im.height}", param)
        if im.format in (
            "JPEG",
            "MPO",
        ):  # libjpeg decodes at 1/2, 1/4 or 1/8 scale, still at least the target size
            im.draft(None, fit_pixels(im.width, im.height, max_pixels))
        upright = ImageOps.exif_transpose(im)  # loads the first frame; a new image either way
    return _to_rgb(upright)


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in _SIXTEEN_BIT:  # convert() would clip 16-bit values to white
        im = im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    if im.mode in _WITH_ALPHA or "transparency" in im.info:
        # Transparent pixels keep arbitrary colour values (often black): show them over white instead.
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


@cache
def _formats() -> tuple[str, ...]:
    Image.init()
    return tuple(f for f in FORMATS if f in Image.OPEN)  # AVIF only where this Pillow has it


def _too_many_pixels(size: str, param: str) -> RequestError:
    return RequestError(
        f"image is too large to decode ({size}); at most {MAX_DECODE_PIXELS} pixels are decoded", param=param
    )
