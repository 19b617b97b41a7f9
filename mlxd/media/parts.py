"""The images of an OpenAI-style chat request: found in prompt order, counted, loaded and decoded.

Messages are plain dicts; ``content`` is a string or a list of parts. Image parts, by ``type``:

- ``image_url`` / ``input_image``: ``"image_url": {"url": ...}`` or ``"image_url": "..."`` (OpenAI chat and
  Responses shapes);
- ``image``: the same, or ``"source": {"type": "base64", "media_type": ..., "data": ...}`` /
  ``{"type": "url", "url": ...}`` (Anthropic), or ``"image": "..."`` (Hugging Face chat templates).

Video parts (``video_url``, ``input_video``, ``video``) are refused; other parts (text ...) are not looked at.
Every error names the part, as ``messages[i].content[j]``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config.schema import VisionConfig
from mlxd.errors import RequestError
from mlxd.media.fetch import load_image_bytes
from mlxd.media.images import DecodedImage, PixelBudget, decode_image
from mlxd.media.remote import Resolver
from mlxd.runtime.cancel import check_cancelled

IMAGE_TYPES = frozenset({"image_url", "input_image", "image"})
VIDEO_TYPES = frozenset({"video_url", "input_video", "video"})


@dataclass(frozen=True)
class ImagePart:
    """An image part found in the messages, not yet loaded."""

    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return part_param(self.message, self.part)


@dataclass(frozen=True, eq=False)
class PromptImage(DecodedImage):
    """A decoded image (``.image``, ``.digest``, ``.width``, ``.height``) and where it sits in the messages."""

    message: int
    part: int


def part_param(message: int, part: int) -> str:
    return f"messages[{message}].content[{part}]"


def is_image_part(part: Any) -> bool:
    """Whether a content part is an image part (of any of the shapes this module's docstring lists)."""
    return isinstance(part, dict) and part.get("type") in IMAGE_TYPES


def find_image_parts(messages: list[dict[str, Any]], *, max_images: int) -> list[ImagePart]:
    """The image parts in prompt order, with their URLs (a data URI for base64 sources). Refuses video parts and
    the first image part beyond ``max_images``, naming the part; nothing is fetched or decoded."""
    found: list[ImagePart] = []
    for i, j, part in _content_parts(messages):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in VIDEO_TYPES:
            raise RequestError(f"video input is not supported (a {kind!r} part)", param=part_param(i, j))
        if kind not in IMAGE_TYPES:
            continue
        if len(found) >= max_images:
            raise RequestError(
                f"too many images: at most {max_images} per request ([vision] max_images)",
                param=part_param(i, j),
            )
        found.append(ImagePart(i, j, image_url(part, param=part_param(i, j))))
    return found


def collect_images(
    messages: list[dict[str, Any]],
    *,
    config: VisionConfig,
    base_dir: Path | None = None,
    resolver: Resolver | None = None,
    allow_hosts: Collection[str] = frozenset(),
) -> list[PromptImage]:
    """Load and decode every image of ``messages`` in prompt order (see ``find_image_parts``, ``load_image_bytes``
    and ``decode_image`` for what is refused). Blocking: call it from a worker thread."""
    parts = find_image_parts(messages, max_images=config.max_images)
    return load_images(parts, config=config, base_dir=base_dir, resolver=resolver, allow_hosts=allow_hosts)


def load_images(
    parts: list[ImagePart],
    *,
    config: VisionConfig,
    base_dir: Path | None = None,
    resolver: Resolver | None = None,
    allow_hosts: Collection[str] = frozenset(),
) -> list[PromptImage]:
    """Load and decode image parts found by ``find_image_parts``, in order, within ``[vision]
    max_decode_pixels`` per image and ``max_request_pixels`` in all. Blocking; stops between images once the
    request's preparation is cancelled (:func:`~mlxd.runtime.cancel.check_cancelled`)."""
    images = []
    budget = PixelBudget(config.max_decode_pixels, config.max_request_pixels)
    for part in parts:
        check_cancelled()
        data = load_image_bytes(
            part.url,
            config=config,
            param=part.param,
            base_dir=base_dir,
            resolver=resolver,
            allow_hosts=allow_hosts,
        )
        decoded = decode_image(data, max_pixels=config.max_pixels, param=part.param, budget=budget)
        images.append(PromptImage(**vars(decoded), message=part.message, part=part.part))
    return images


def image_url(part: dict[str, Any], *, param: str) -> str:
    """The URL of one image part, in any of the shapes this module's docstring lists."""
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None and "source" in part:
        value = _source_url(part["source"], param)
    if value is None:
        value = part.get("image")
    if isinstance(value, str) and value:
        return value
    if part.get("file_id"):
        raise RequestError(
            "image parts with a file_id are not supported: send a data: URI or URL", param=param
        )
    raise RequestError("image part has no URL (expected image_url.url)", param=param)


def _content_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, Any]]:
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                yield i, j, part


def _source_url(source: Any, param: str) -> str:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or ''};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise RequestError(
        f"image source of type {kind!r} is not supported (expected base64 or url)", param=param
    )
