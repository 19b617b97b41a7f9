"""One image request through the whole pipeline before a vision model's server reports ready.

The engine's own warm-up runs the language model's shapes; nothing runs the vision path until a user sends an image.
On an H100 (random Qwen2.5-VL-7B shape) the first vision-tower call of a process took 541 ms against 47-59 ms for
the next ones, and the first prompt pass with image features 72-98 ms against 17-28 ms (MLX builds its CUDA
kernels on first use): the first image request after a start or a restart paid about 0.6 s more. A synthetic
image request, sent the way a user's is (normalize, template, processor, route, engine, detokenize), moves most of
that cost before ``/health`` turns 200: the first 448 px image request then took 0.27-0.32 s against 0.68-0.73 s
(the next ones 0.12-0.16 s; kernels MLX builds per exact shape are left to the first request of each size;
``benchmarks/first_image.py``, ``docs/benchmarks/vision.md``). It counts like any request: one image encoded in
``/v1/status``'s vision counters.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

from mlxd.pipeline.job import Job
from mlxd.pipeline.pipeline import Pipeline

REQUEST_ID = "warm-up-image"
IMAGE_SIZE = 224  # pixels a side: a few dozen image tokens for the Qwen-VL families


def warm_up_images(pipeline: Pipeline, model: str) -> float:
    """Send one short image request through ``pipeline`` and wait for its end; returns the seconds it took.
    Raises what a request would (``MlxdError``) if the model cannot take it."""
    job = Job(request_id=REQUEST_ID, model=model, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_uri()}},
        {"type": "text", "text": "What is in this picture?"},
    ]}])
    started = time.monotonic()
    pipeline.prepare(job)
    asyncio.run(_drain(pipeline, job))
    return time.monotonic() - started


async def _drain(pipeline: Pipeline, job: Job) -> None:
    async for _ in pipeline.stream(job):
        pass


def _png_uri() -> str:
    """A data URI of a PNG with a gradient and a few shapes (not one flat colour, which processors may treat
    specially)."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((IMAGE_SIZE, IMAGE_SIZE)).convert("RGB")
    draw = ImageDraw.Draw(image)
    draw.rectangle((40, 40, 120, 120), fill=(200, 30, 30))
    draw.ellipse((110, 90, 200, 180), fill=(30, 160, 60))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
