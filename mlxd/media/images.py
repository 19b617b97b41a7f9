"""Decoding request images with Pillow: bounded before any pixel is allocated, upright, RGB, at most N pixels.

Decoding costs time and memory in proportion to the pixels decoded, so they are bounded, from the size an image
declares in its header, before any is decoded: per image (``[vision] max_decode_pixels``) and per request
(``max_request_pixels``, through a :class:`PixelBudget`). JPEGs are decoded at a reduced scale where libjpeg can
(1/2, 1/4, 1/8, still at least ``max_pixels``) and count at that scale, so a big camera photo is not refused for
being merely large; then every image is downscaled to ``max_pixels``. :func:`bound_pillow` sets Pillow's own
``Image.MAX_IMAGE_PIXELS`` to the per-image bound, a backstop for any other Pillow use in the daemon.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import struct
import warnings
from dataclasses import dataclass
from functools import cache

from PIL import Image, ImageOps

from mlxd.errors import RequestError
from mlxd.runtime.cancel import check_cancelled

# Pixels decoded for one image when no bound is given ([vision] max_decode_pixels' default).
MAX_DECODE_PIXELS = 6144 * 6144
# An object's repr, as Pillow's messages quote the file they read ("<_io.BytesIO object at 0x7f...>").
_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")
# The size in Pillow's DecompressionBombError ("Image size (88360000 pixels) exceeds limit of ...").
_DECLARED = re.compile(r"\((\d+) pixels\)")
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


class PixelBudget:
    """The pixels a request's images may still decode (``[vision] max_request_pixels``), and the most one image
    may (``max_decode_pixels``). Per request; spent by :func:`decode_image`."""

    __slots__ = ("max_image_pixels", "max_request_pixels", "pixels_left")

    def __init__(self, max_image_pixels: int = MAX_DECODE_PIXELS, max_request_pixels: int | None = None) -> None:
        self.max_image_pixels = max_image_pixels
        self.max_request_pixels = max_request_pixels
        self.pixels_left = max_request_pixels

    def spend(self, width: int, height: int, param: str) -> None:
        """Count an image about to be decoded at ``width`` x ``height``; refuse it (400 on ``param``) beyond a
        bound."""
        pixels = width * height
        if pixels > self.max_image_pixels:
            raise _too_many_pixels(f"{width}x{height} = {pixels} pixels", param, _image_bound(self))
        if self.pixels_left is not None:
            if pixels > self.pixels_left:
                raise _too_many_pixels(f"{width}x{height} = {pixels} pixels", param,
                                       f"the images of one request may decode {self.max_request_pixels} pixels in all "
                                       f"([vision] max_request_pixels), {self.pixels_left} were left")
            self.pixels_left -= pixels


def bound_pillow(max_decode_pixels: int) -> None:
    """Set Pillow's own bound (process-wide) to ``max_decode_pixels``: Pillow then refuses twice as many pixels in
    any image the daemon opens. Its warning between once and twice the bound is silenced: :func:`decode_image`
    refuses those images itself, from the header, naming the part."""
    Image.MAX_IMAGE_PIXELS = max_decode_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def decode_image(data: bytes, *, max_pixels: int, param: str, budget: PixelBudget | None = None) -> DecodedImage:
    """Decode one image (the first frame of an animation) to upright RGB, downscaled to at most ``max_pixels``
    with its aspect ratio kept. Undecodable data and images beyond ``budget`` (by default MAX_DECODE_PIXELS per
    image) are a RequestError on ``param``, raised before the pixels are allocated; messages never quote Pillow's
    object reprs."""
    digest = hashlib.sha256(data).hexdigest()
    budget = budget or PixelBudget()
    try:
        image = _decode(data, max_pixels, param, budget)
    except Image.DecompressionBombError as e:  # Pillow's own bound (bound_pillow), met while it reads the header
        declared = _DECLARED.search(str(e))
        raise _too_many_pixels(f"{declared[1] if declared else 'more than twice this many'} pixels", param,
                               _image_bound(budget)) from e
    except Image.UnidentifiedImageError as e:
        raise RequestError(f"image data cannot be decoded: not an image in a supported format "
                           f"({', '.join(_formats())})", param=param) from e
    except _DECODE_ERRORS as e:
        message = _REPR.sub("the image", str(e))
        raise RequestError(f"image data cannot be decoded ({type(e).__name__}: {message})", param=param) from e
    check_cancelled()
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


def _decode(data: bytes, max_pixels: int, param: str, budget: PixelBudget) -> Image.Image:
    with Image.open(io.BytesIO(data), formats=_formats()) as im:  # reads the header only
        if im.format in ("JPEG", "MPO"):  # libjpeg decodes at 1/2, 1/4 or 1/8 scale, still at least the target
            im.draft(None, fit_pixels(im.width, im.height, max_pixels))
        budget.spend(im.width, im.height, param)  # the size it will decode at (after draft)
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


def _image_bound(budget: PixelBudget) -> str:
    return f"at most {budget.max_image_pixels} pixels are decoded per image ([vision] max_decode_pixels)"


def _too_many_pixels(size: str, param: str, bound: str = "") -> RequestError:
    bound = bound or f"at most {MAX_DECODE_PIXELS} pixels are decoded per image ([vision] max_decode_pixels)"
    return RequestError(f"image is too large to decode ({size}); {bound}", param=param)
