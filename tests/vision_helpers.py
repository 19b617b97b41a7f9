"""Images and requests shared by the vision tests."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image


def png(seed: int, size: int = 64) -> bytes:
    """A deterministic, clearly patterned PNG: different seeds give different pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((size, size), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(seed: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(png(seed))}}


def user_with_images(text: str, *seeds: int) -> dict[str, Any]:
    return {"role": "user", "content": [*(image_part(s) for s in seeds), {"type": "text", "text": text}]}


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
