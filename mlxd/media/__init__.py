"""Request-side image inputs for vision-language models: where an image may come from (``fetch``, ``remote``),
how it is decoded (``images``) and how the images of a chat request are found (``parts``). Plain Python and
Pillow; no MLX."""

from mlxd.media.fetch import load_image_bytes
from mlxd.media.images import DecodedImage, decode_image
from mlxd.media.parts import (
    ImagePart,
    PromptImage,
    collect_images,
    find_image_parts,
    is_image_part,
    load_images,
)
from mlxd.media.remote import address_refusal

__all__ = [
    "DecodedImage",
    "ImagePart",
    "PromptImage",
    "address_refusal",
    "collect_images",
    "decode_image",
    "find_image_parts",
    "is_image_part",
    "load_image_bytes",
    "load_images",
]
