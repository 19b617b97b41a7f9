"""A request for a model that is not loaded yet (several models: :mod:`mlxd.registry`). What can be refused before the
load is refused first, as an HTTP error: an unknown model (404), a model that cannot fit the memory budget now (503
with ``Retry-After``), a body the model's config refuses (400). Then a non-streaming request waits for the load,
and a stream still waiting after ``[server] keepalive_s`` opens and gets an SSE comment (``: keep-alive``) every
``keepalive_s`` while the model loads, so that clients and proxies see a live connection instead of silence; then
the response's own frames follow. A failure once the stream is open (the load failed, the loaded model refused the
request) is the surface's error frame. A request that waited counts its times (TTFT, total) from its arrival, and
its log line says how long it waited (``model_wait_s``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from mlxd.api.output import SSE_KEEPALIVE, EventStream, Renderer, encode_frames
from mlxd.errors import MlxdError
from mlxd.log import get_logger
from mlxd.model_slot import ModelSlot
from mlxd.registry import ModelRegistry

log = get_logger("mlxd.request")

# How a surface writes a failure into a stream that is open (its error frame, its end of stream).
ErrorFrames = Callable[[MlxdError], list[bytes]]
# The response to a request once its model is ready: given the slot, and when the request came if it waited.
Respond = Callable[[ModelSlot, float | None], Awaitable[Any]]


async def answer(models: ModelRegistry, requested: str, stream: bool, respond: Respond,
                 before_wait: Callable[[ModelSlot], ErrorFrames]) -> Any:
    """``respond(slot, arrived)``'s response once the model ``requested`` names is ready (admitted by
    :meth:`mlxd.registry.ModelRegistry.admit`; ``arrived``: when the request came, None when the model was ready).
    A streaming request for a model still loading after ``[server] keepalive_s`` gets an :class:`EventStream` then:
    ``before_wait(slot)`` first checks what the model's config can check (raising a 4xx before the stream opens)
    and says how the surface writes an error frame; keep-alive comments follow until the model is ready, then
    ``respond``'s stream."""
    arrived = time.monotonic()
    slot, loaded = await models.admit(requested)
    if loaded is None:
        return await respond(slot, None)
    keepalive_s = slot.config.server.keepalive_s
    if stream:
        error_frames = before_wait(slot)
        # A load (or its failure) within one keep-alive interval is answered as if the model had been ready: a
        # failure is then an HTTP error with Retry-After rather than a frame in an open stream.
        await asyncio.wait({loaded}, timeout=keepalive_s)
        if not loaded.done():
            return EventStream(after_load(slot.name, loaded, keepalive_s, lambda ready: respond(ready, arrived),
                                          error_frames))
    return await respond(await loaded, arrived)


async def after_load(name: str, loaded: asyncio.Future, keepalive_s: float,
                     respond: Callable[[ModelSlot], Awaitable[Any]], error_frames: ErrorFrames) -> AsyncIterator[bytes]:
    """SSE bytes: a keep-alive comment at once (the caller has waited ``keepalive_s`` already; the response's headers
    go out with it) and every ``keepalive_s`` until ``loaded`` gives the ready slot, then the frames of
    ``respond(slot)``'s stream. A client that leaves meanwhile leaves the load running (other requests may wait
    for it)."""
    yield SSE_KEEPALIVE
    while not loaded.done():
        await asyncio.wait({loaded}, timeout=keepalive_s)
        if not loaded.done():
            yield SSE_KEEPALIVE
    try:
        response = await respond(loaded.result())
    except MlxdError as e:
        log.warning("request_failed_after_load_wait", model=name, status=e.status, error=e.message)
        for frame in error_frames(e):
            yield frame
        return
    async with aclosing(response.frames) as frames:
        async for frame in frames:
            yield frame


def error_frames(renderer: Renderer) -> ErrorFrames:
    """How ``renderer``'s surface ends an open stream on a failure: its error frames, then its terminator (as
    :func:`mlxd.api.respond.stream_sse` does mid-stream)."""

    def frames(error: MlxdError) -> list[bytes]:
        return [encode_frames(renderer.error(error)), *([renderer.terminator] if renderer.terminator else [])]

    return frames
