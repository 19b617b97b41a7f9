"""Running a job through the pipeline and shaping what comes out: one JSON body, or SSE frames.

The pipeline's typed events (:mod:`mlxd.pipeline.events`) are rendered, never re-parsed: :func:`collect` gathers
them into an :class:`~mlxd.api.output.Output` per choice for a JSON body; :func:`stream_sse` hands each to a
surface's :class:`~mlxd.api.output.Renderer`, which turns it into SSE frames (optionally named, as the Anthropic
and Responses APIs name theirs).

Both paths end in one canonical log line per request. Leaving early (a client gone, a stop sequence) closes
the pipeline's stream, which ends the engine request; a client that leaves while its request is still being
prepared stops the preparation (:func:`prepare`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar.types import Receive

from mlxd.api.choices import fan_in, siblings
from mlxd.api.errors import redact
from mlxd.api.output import Output, Renderer, encode_frames, total
from mlxd.api.schemas import ErrorBody, ErrorDetail, PromptTokensDetails, Usage
from mlxd.engine.base import Failed, Finished, Plain
from mlxd.errors import MlxdError, PipelineError
from mlxd.log import get_logger
from mlxd.model_slot import ModelSlot
from mlxd.pipeline.events import Done, KeepAlive, TokenLogprobs
from mlxd.pipeline.job import Job
from mlxd.runtime.cancel import CancelFlag, Cancelled

log = get_logger("mlxd.request")


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
    num_choices: int = 1
    # Seconds the pipeline's preparation took (rendering, tokenizing, images), on a worker thread.
    prepare_s: float | None = None
    # Seconds the request waited for its model to load (several models: mlxd.api.loading); None when it was ready.
    model_wait_s: float | None = None
    # The engine's account of the (first choice's) request: its last event, once the engine let it go.
    engine_end: Finished | Failed | None = None
    # Whether the engine took the request on (its stream opened): its log line then waits for ``engine_end``.
    in_engine: bool = False
    # When the client's response ended (the line may be written later), and what wakes a line waiting for the
    # engine's account.
    _logged_at: float | None = field(default=None, init=False)
    _on_engine_end: Callable[[], None] | None = field(default=None, init=False)

    def engine_ended(self, event: Finished | Failed) -> None:
        """The engine's last event for this request (on the event loop), read by its stream or not."""
        self.engine_end = event
        if self._on_engine_end is not None:
            self._on_engine_end()

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
        """Write the request's log line (never the prompt or the text), then call ``on_end``.

        A request that ended without its final event (its client left, a failure mid-stream) while the engine
        still holds it is logged once the engine's account comes (it applies the cancellation between steps), or
        after ``ENGINE_ACCOUNT_WAIT_S`` without it: the line then says what its prompt got from the prefix cache
        and computed, and how long it queued and prefilled, whether or not a first token came. ``total_s`` is the
        time the client was served: until it left."""
        self._logged_at = time.monotonic()
        if self.done is not None or not self.in_engine or self.engine_end is not None:
            self._write()
            return
        waited = asyncio.get_running_loop().create_future()
        self._on_engine_end = lambda: waited.done() or waited.set_result(None)
        task = asyncio.ensure_future(_write_when(waited, self))
        _WAITING.add(task)
        task.add_done_callback(_WAITING.discard)

    def _write(self) -> None:
        done, end = self.done, self.engine_end if isinstance(self.engine_end, Finished) else None
        account: Done | Finished | None = end or done
        log.info(
            "request",
            request_id=self.job.request_id,
            endpoint=self.endpoint,
            model=self.job.model,
            model_wait_s=self.model_wait_s,
            route=self.job.route or None,
            images=len(self.job.images) or None,
            prompt_tokens=len(self.job.prompt_ids),
            completion_tokens=done.num_completion_tokens if done else None,
            cached_tokens=account.num_cached_tokens if account else None,
            prompt_tokens_computed=_num_computed(end, done),
            cache_hit=account.cache_hit if account else None,
            ttft_s=round(self.first_token - self.started, 4) if self.first_token else None,
            prepare_s=self.prepare_s,
            queued_s=account.queued_s if account else None,
            prefill_s=account.prefill_s if account else None,
            total_s=round((self._logged_at or time.monotonic()) - self.started, 4),
            finish_reason=done.finish_reason if done else end.reason if end else None,
            decode=_decode_fields(account.decode if account else None, self.job),
            max_tokens_clamped_from=self.job.max_tokens_clamped_from,
            outcome=self.outcome,
        )
        if self.on_end is not None:
            self.on_end(self)


# How long a request's log line waits for the engine's account of it (the engine applies a cancellation between
# steps; a step is one prompt chunk and one decode step), and the log lines waiting now.
ENGINE_ACCOUNT_WAIT_S = 60.0
_WAITING: set[asyncio.Task] = set()


async def _write_when(ended: asyncio.Future, trace: Trace) -> None:
    """Write ``trace``'s line once ``ended`` is done; without the engine's account after the wait or when the
    server shuts down first."""
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended, ENGINE_ACCOUNT_WAIT_S)
    finally:
        trace._write()


def _num_computed(end: Finished | None, done: Done | None) -> int | None:
    """Prompt tokens the request ran through the model: the engine's count, else (a first token came) the prompt
    past what the prefix cache gave."""
    if end is not None:
        return end.num_prompt_computed
    return done.num_prompt_tokens - done.num_cached_tokens if done is not None else None


def _decode_fields(decode: dict[str, Any] | None, job: Job) -> dict[str, Any] | None:
    """The log line's ``decode``: the engine's account, else the route's choice (a request that ended early)."""
    if decode is not None:
        return decode
    mode = job.decode
    return {"mode": "plain", "reason": mode.reason} if isinstance(mode, Plain) else {"mode": "speculative",
                                                                                       "drafter": mode.drafter}


async def start(served: ModelSlot, job: Job, endpoint: str, on_end: Callable[[Trace], None] | None = None,
                n: int = 1, receive: Receive | None = None,
                arrived: float | None = None) -> tuple[AsyncIterator[tuple[int, Any]], Trace]:
    """Prepare the job (:func:`prepare`) and open its stream (``n`` choices: :mod:`mlxd.api.choices`); errors here
    (bad request, overload, a client gone) become HTTP errors. The stream yields ``(choice index, event)``.
    ``on_end(trace)`` is called once the request's log line is written. ``arrived``: when a request that waited
    for its model to load came (``time.monotonic()``): its times (TTFT, total) count from then.
    """
    structlog.contextvars.bind_contextvars(request_id=job.request_id)
    now = time.monotonic()
    trace = Trace(job, endpoint, arrived if arrived is not None else now, on_end=on_end)
    if arrived is not None:
        trace.model_wait_s = round(now - arrived, 4)
    pipeline = served.pipeline
    try:
        await prepare(served, job, receive)
        trace.prepare_s = round(time.monotonic() - now, 4)
        jobs = siblings(job, n)
        if job.engine_request is not None:  # the first choice's account (siblings are copies made before this)
            job.engine_request.on_end = trace.engine_ended
        events = pipeline.stream(job)
        first = await anext(events, None)
        trace.in_engine = job.engine_request is not None and first is not None
    except MlxdError as e:
        trace.fail(e)
        trace.log()
        raise
    trace.num_choices = n
    if n == 1:
        return _tagged(first, events), trace
    return fan_in(pipeline, jobs, _prepend(first, events)), trace


async def prepare(served: ModelSlot, job: Job, receive: Receive | None = None, until: str | None = None) -> Job:
    """Run the model's stages' ``prepare`` (rendering, tokenizing, images; up to the stage ``until``) on one of the
    daemon's preparation workers (:meth:`ModelSlot.prepare`: a 429 when too many wait for them), never on the event loop or
    its default executor, so ``/health`` and every other request keep being answered.

    With the request's ASGI ``receive`` channel, a client that leaves meanwhile stops the work at its next check
    (between stages, between images) and :class:`ClientDisconnected` is raised at once.
    """
    flag = CancelFlag()
    work = asyncio.ensure_future(served.prepare(job, flag, until))
    gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
    try:
        await asyncio.wait({work, gone} if gone is not None else {work}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        flag.set("the client disconnected while its request was being prepared")
        raise ClientDisconnected("the client disconnected before the request was prepared")
    finally:
        if gone is not None:
            gone.cancel()
        if not work.done():  # the client left, or this request's task is cancelled (shutdown)
            flag.set("the request ended while it was being prepared")
            work.cancel()


async def _prepend(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async with aclosing(events):
        if first is not None:
            yield first
        async for event in events:
            yield event


async def _tagged(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """A lone choice's stream, its events tagged with index 0 (what :func:`_prepend` does, in the same step)."""
    async with aclosing(events):
        if first is not None:
            yield 0, first
        async for event in events:
            yield 0, event


class ClientDisconnected(MlxdError):
    """The client closed the connection before its non-streaming response was ready."""

    status = 499
    type = "client_disconnected"


async def collect(events: AsyncIterator[tuple[int, Any]], trace: Trace,
                  receive: Receive | None = None) -> list[Output]:
    """Drain the stream into one :class:`Output` per choice for a non-streaming response.

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


async def _drain(events: AsyncIterator[tuple[int, Any]], trace: Trace) -> list[Output]:
    outputs = [Output() for _ in range(trace.num_choices)]
    async with aclosing(events):
        async for index, event in events:
            if isinstance(event, Done):
                outputs[index].done = event
            elif outputs[index].add(event) and not isinstance(event, TokenLogprobs):
                trace.text_sent()
    if any(output.done is None for output in outputs):
        raise PipelineError("the pipeline ended without a final event (is `detokenize` after `decode`?)")
    trace.done = total([output.done for output in outputs])
    return outputs


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a task and wait for it; closing its stream cancels the engine request."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _disconnected(receive: Receive) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (the body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream_sse(events: AsyncIterator[tuple[int, Any]], trace: Trace,
                     renderer: Renderer) -> AsyncIterator[bytes]:
    """SSE frames: the renderer's opening, its frames for each event and each choice's end, its final frames (once
    every choice has ended), its terminator."""
    dones: dict[int, Done] = {}
    try:
        async with aclosing(events):
            if opening := renderer.opening():
                yield encode_frames(opening)
            async for index, event in events:
                if isinstance(event, KeepAlive):
                    yield renderer.keepalive
                elif frames := _frames(renderer, trace, dones, index, event):
                    yield encode_frames(frames)
        if renderer.terminator:
            yield renderer.terminator
    except MlxdError as e:
        # Mid-stream failure: the surface's error frame(s), then the end of the stream.
        trace.fail(e)
        yield encode_frames(renderer.error(e))
        if renderer.terminator:
            yield renderer.terminator
    except BaseException as e:
        trace.fail(e)
        raise
    finally:
        trace.log()


def _frames(renderer: Renderer, trace: Trace, dones: dict[int, Done], index: int, event: Any) -> list:
    if not isinstance(event, Done):
        if not isinstance(event, TokenLogprobs):
            trace.text_sent()
        return renderer.render(index, event)
    dones[index] = event
    frames = renderer.closing(index, event)
    if len(dones) == trace.num_choices:
        trace.done = total([dones[i] for i in sorted(dones)])
        frames += renderer.final(trace.done)
    return frames


def error_body(error: MlxdError) -> ErrorBody:
    """The OpenAI error shape of a failure, for an error frame in a stream."""
    return ErrorBody(ErrorDetail(message=redact(error.message), type=error.type, code=error.type))


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, ClientDisconnected | GeneratorExit | OSError | asyncio.CancelledError):
        return "client disconnected"
    if isinstance(exc, Cancelled) and exc.status == 499:
        return "client disconnected"
    if type(exc).__name__ == "ClientDisconnect":
        return "client disconnected"
    if isinstance(exc, MlxdError):
        return f"error {exc.status}: {exc.message}"
    return f"error: {type(exc).__name__}: {exc}"
