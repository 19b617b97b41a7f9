"""Running a job through the pipeline and shaping what comes out: one JSON body, or SSE frames.

Both paths end in one canonical log line per request. Leaving early (a client gone, a stop sequence) closes
the pipeline's stream, which cancels the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from litestar.types import Receive

from mlxd.api.errors import redact
from mlxd.api.schemas import ErrorBody, ErrorDetail, PromptTokensDetails, Usage
from mlxd.errors import MlxdError, PipelineError
from mlxd.log import get_logger
from mlxd.pipeline.job import Done, Job, KeepAlive, TextDelta
from mlxd.pipeline.pipeline import Pipeline

log = get_logger("mlxd.request")
ENCODER = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


def sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + ENCODER.encode(payload) + b"\n\n"


def usage_of(done: Done) -> Usage:
    return Usage(
        prompt_tokens=done.num_prompt_tokens,
        completion_tokens=done.num_completion_tokens,
        total_tokens=done.num_prompt_tokens + done.num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.num_cached_tokens),
    )


@dataclass(slots=True)
class Trace:
    """Timings and outcome of one request, for its log line and ``on_end`` (the metrics)."""

    job: Job
    endpoint: str
    started: float
    first_token: float | None = None
    last_token: float | None = None
    # Seconds between consecutive text deltas: one token each, unless the detokenizer held text back (an
    # unfinished UTF-8 character, a possible stop sequence).
    gaps: list[float] = field(default_factory=list)
    done: Done | None = None
    outcome: str = "ok"
    # The outcome as a label with few values: "ok", "client_disconnected" or "error_<status>".
    result: str = "ok"
    on_end: Callable[[Trace], None] | None = None

    def text_sent(self) -> None:
        """A text delta is going out now."""
        now = time.monotonic()
        if self.last_token is None:
            self.first_token = now
        else:
            self.gaps.append(now - self.last_token)
        self.last_token = now

    def fail(self, exc: BaseException) -> None:
        self.outcome = _outcome(exc)
        if self.outcome == "client disconnected":
            self.result = "client_disconnected"
        else:
            self.result = f"error_{exc.status if isinstance(exc, MlxdError) else 500}"

    def log(self) -> None:
        """Write the request's log line (never the prompt or the text), then call ``on_end``."""
        now = time.monotonic()
        done = self.done
        log.info(
            "request",
            request_id=self.job.request_id,
            endpoint=self.endpoint,
            model=self.job.model,
            route=self.job.route or None,
            images=len(self.job.images) or None,
            prompt_tokens=len(self.job.prompt_ids),
            completion_tokens=done.num_completion_tokens if done else None,
            cached_tokens=done.num_cached_tokens if done else None,
            cache_hit=done.cache_hit if done else None,
            ttft_s=round(self.first_token - self.started, 4) if self.first_token else None,
            total_s=round(now - self.started, 4),
            finish_reason=done.finish_reason if done else None,
            outcome=self.outcome,
        )
        if self.on_end is not None:
            self.on_end(self)


async def start(pipeline: Pipeline, job: Job, endpoint: str,
                on_end: Callable[[Trace], None] | None = None) -> tuple[AsyncIterator[Any], Trace]:
    """Prepare the job and open its stream; errors here (bad request, overload) become HTTP errors.
    ``on_end(trace)`` is called once the request's log line is written.

    The stages' ``prepare`` (rendering, tokenization) runs on a worker thread: a huge prompt never stalls the
    event loop, so every other request, ``/health`` included, keeps being answered.
    """
    structlog.contextvars.bind_contextvars(request_id=job.request_id)
    trace = Trace(job, endpoint, time.monotonic(), on_end=on_end)
    try:
        await asyncio.to_thread(pipeline.prepare, job)
        events = pipeline.stream(job)
        first = await anext(events, None)
    except MlxdError as e:
        trace.fail(e)
        trace.log()
        raise
    return _prepend(first, events), trace


async def _prepend(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async with aclosing(events):
        if first is not None:
            yield first
        async for event in events:
            yield event


class ClientDisconnected(MlxdError):
    """The client closed the connection before its non-streaming response was ready."""

    status = 499
    type = "client_disconnected"


async def collect(events: AsyncIterator[Any], trace: Trace, receive: Receive | None = None) -> tuple[str, Done]:
    """Drain the stream into (text, Done) for a non-streaming response.

    With the request's ASGI ``receive`` channel, a client that disconnects while waiting aborts the request at
    once (closing the stream cancels the engine request) and :class:`ClientDisconnected` is raised.
    """
    try:
        if receive is None:
            return await _drain(events, trace)
        drain = asyncio.ensure_future(_drain(events, trace))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({drain, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not drain.done():
                await _cancel(drain)
                raise ClientDisconnected("the client disconnected before the response was ready")
        return drain.result()
    except BaseException as e:
        trace.fail(e)
        raise
    finally:
        trace.log()


async def _drain(events: AsyncIterator[Any], trace: Trace) -> tuple[str, Done]:
    parts: list[str] = []
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextDelta):
                trace.text_sent()
                parts.append(event.text)
            elif isinstance(event, Done):
                trace.done = event
    if trace.done is None:
        raise PipelineError("the pipeline ended without a final event (is `detokenize` last?)")
    return "".join(parts), trace.done


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a task and wait for it; closing its stream cancels the engine request."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _disconnected(receive: Receive) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (the body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream_sse(
    events: AsyncIterator[Any],
    trace: Trace,
    on_text: Callable[[str], msgspec.Struct],
    on_done: Callable[[Done], list[msgspec.Struct]],
    opening: msgspec.Struct | None = None,
) -> AsyncIterator[bytes]:
    """SSE frames: an optional opening chunk, one chunk per text delta, closing chunks, then ``[DONE]``."""
    try:
        async with aclosing(events):
            if opening is not None:
                yield sse(opening)
            async for event in events:
                if isinstance(event, TextDelta):
                    trace.text_sent()
                    yield sse(on_text(event.text))
                elif isinstance(event, KeepAlive):
                    yield SSE_KEEPALIVE
                elif isinstance(event, Done):
                    trace.done = event
                    for chunk in on_done(event):
                        yield sse(chunk)
        yield SSE_DONE
    except MlxdError as e:
        # Mid-stream failure: one frame in the API's error shape, then the end of the stream.
        trace.fail(e)
        yield sse(ErrorBody(ErrorDetail(message=redact(e.message), type=e.type, code=e.type)))
        yield SSE_DONE
    except BaseException as e:
        trace.fail(e)
        raise
    finally:
        trace.log()


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, ClientDisconnected | GeneratorExit | OSError | asyncio.CancelledError):
        return "client disconnected"
    if type(exc).__name__ == "ClientDisconnect":
        return "client disconnected"
    if isinstance(exc, MlxdError):
        return f"error {exc.status}: {exc.message}"
    return f"error: {type(exc).__name__}: {exc}"
