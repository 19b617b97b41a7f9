"""An image request and its second turn through the whole pipeline before a vision model's server reports ready.

The engine's own warm-up runs the language model's shapes; nothing runs the vision path until a user sends an image.
On an H100 (random Qwen2.5-VL-7B shape) the first vision-tower call of a process took 541 ms against 47-59 ms for
the next ones, and the first prompt pass with image features 72-98 ms against 17-28 ms (MLX builds its CUDA
kernels on first use): the first image request after a start or a restart paid about 0.6 s more. A synthetic
image request, sent the way a user's is (normalize, template, processor, route, engine, detokenize), moves most of
that cost before ``/health`` turns 200: the first 448 px image request then took 0.27-0.32 s against 0.68-0.73 s
(the next ones 0.12-0.16 s; ``benchmarks/first_image.py``, ``docs/benchmarks/vision.md``). Kernels MLX builds
per exact shape are left to the first request of each image size not warmed: ``[vision] warm_up_image_sizes``
(224 px by default) lists the sizes to send. Each counts like any request: one image encoded in ``/v1/status``'s
vision counters.

Each size also sends the conversation's second turn, which starts from the first turn's cached state: a vision
row continuing a prompt from the prefix cache, through the language model with image embeddings at a cache offset,
is a kind of pass the first turn does not run. On an H100 (random Qwen2.5-VL-7B shape, four starts each) a user's
first second turn after a start took 0.068-0.090 s to its first token with this, 0.115-0.157 s without, and the
first image request 0.216-0.271 s against 0.278-0.302 s (``benchmarks/first_image.py``, ``docs/benchmarks/vision.md``);
the time to ready did not grow. The image is in the feature cache by then, so the second turn runs no vision tower.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

from mlxd.pipeline.events import ContentDelta, Done
from mlxd.pipeline.job import Job
from mlxd.pipeline.pipeline import Pipeline

REQUEST_ID = "warm-up-image"


def warm_up_image(pipeline: Pipeline, model: str, size: int) -> tuple[float, int]:
    """Send a short request with a ``size`` x ``size`` image through ``pipeline``, then its conversation's second
    turn, waiting for the end of each; returns the seconds they took and how many prompt tokens the second turn
    found cached. Raises what a request would (``MlxdError``) if the model cannot take it."""
    first = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_uri(size)}},
        {"type": "text", "text": "What is in this picture?"},
    ]}]
    started = time.monotonic()
    answer, _ = _run(pipeline, Job(request_id=f"{REQUEST_ID}-{size}", model=model, max_tokens=2, messages=first))
    second = [*first, {"role": "assistant", "content": answer or "A picture."},
              {"role": "user", "content": "What colours does it have?"}]
    _, cached = _run(pipeline, Job(request_id=f"{REQUEST_ID}-{size}-turn-2", model=model, max_tokens=2,
                                   messages=second))
    return time.monotonic() - started, cached


def _run(pipeline: Pipeline, job: Job) -> tuple[str, int]:
    """The answer's text, and the number of prompt tokens found cached."""
    pipeline.prepare(job)
    return asyncio.run(_drain(pipeline, job))


async def _drain(pipeline: Pipeline, job: Job) -> tuple[str, int]:
    text, cached = [], 0
    async for event in pipeline.stream(job):
        if isinstance(event, ContentDelta):
            text.append(event.text)
        elif isinstance(event, Done):
            cached = event.num_cached_tokens
    return "".join(text), cached


def _png_uri(size: int) -> str:
    """A data URI of a ``size`` x ``size`` PNG with a gradient and a few shapes (not one flat colour, which
    processors may treat specially)."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    draw = ImageDraw.Draw(image)
    draw.rectangle((size // 6, size // 6, size // 2, size // 2), fill=(200, 30, 30))
    draw.ellipse((size // 2, size * 2 // 5, size * 9 // 10, size * 4 // 5), fill=(30, 160, 60))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
