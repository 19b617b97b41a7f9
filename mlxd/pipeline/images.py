"""A vision request's images through the model's processor: pixel inputs, and placeholder tokens expanded.

The chat template puts one placeholder where each image is; the processor replaces it with as many placeholder
tokens as the image has features and computes the pixel inputs. This runs on the worker thread that prepares the
request, never on the event loop. mlx-vlm's processors return MLX arrays whatever ``return_tensors`` says (made from
numpy, nothing to compute); they are handed on as numpy arrays, so the engine thread sees them only as data. Each
image's span of placeholder tokens and its digest travel with the prompt as :class:`~mlxd.engine.base.Media`.

Nothing here may switch MLX's device or stream (``mx.stream(...)``): MLX's default device is one for the whole
process, so a worker that switched it to the CPU while the engine thread built a step sent that step, and with
racing workers every later one, to the CPU. On a GPU that looked like a hang under concurrent image requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxd.engine.base import Media
from mlxd.errors import RequestError


class ImageInputs:
    """Runs the processor of a vision model (``image_token_id``: the placeholder it repeats per image)."""

    def __init__(self, processor: Any, image_token_id: int | None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id

    def process(self, text: str, images: Sequence[Any]) -> tuple[list[int], Media]:
        """Token ids of the rendered ``text`` with its images' placeholders expanded, and the images' media.

        ``images`` are decoded images (``.image``: a PIL image, ``.digest``) in the order the prompt shows them.
        """
        from mlx_vlm.utils import process_inputs

        try:
            out = process_inputs(self.processor, prompts=[text], images=[i.image for i in images],
                                 padding=False, return_tensors="np")
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise RequestError(f"the model's processor could not prepare the images: {e}", param="messages") from e
        arrays = {k: np.asarray(v) for k, v in dict(out).items() if v is not None}
        ids = [int(t) for t in arrays.pop("input_ids").reshape(-1)]
        arrays.pop("attention_mask", None)
        if "images" in arrays:
            arrays["pixel_values"] = arrays.pop("images")
        spans = self._spans(ids, len(images))
        media = Media(digests=tuple(i.digest for i in images), spans=tuple(spans), inputs=arrays)
        return ids, media

    def _spans(self, ids: list[int], num_images: int) -> list[tuple[int, int]]:
        """Each image's placeholder span: the runs of the image token, grouped evenly when a processor splits an
        image into several runs (tiles)."""
        runs = image_spans(ids, self.image_token_id) if self.image_token_id is not None else []
        if not runs or len(runs) % num_images:
            raise RequestError(f"the prompt shows {len(runs)} image placeholder runs for {num_images} image(s): the "
                               "chat template must render every image part", param="messages")
        per_image = len(runs) // num_images
        return [(runs[i * per_image][0], runs[(i + 1) * per_image - 1][1]) for i in range(num_images)]


def image_spans(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """The runs of ``image_token_id`` in ``prompt``, as ``[start, end)`` pairs in order."""
    spans, start = [], None
    for i, token in enumerate(prompt):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(prompt)))
    return spans
