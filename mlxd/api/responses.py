"""The OpenAI Responses surface: ``POST /v1/responses``, as the ``openai`` SDK and the Codex CLI use it.

Stateless: each request carries its whole conversation in ``input``; nothing is stored (``store`` is accepted and
ignored, ``previous_response_id`` is refused). Requests become chat-shaped jobs (:mod:`mlxd.api.responses_jobs`)
and their events become output items (:mod:`mlxd.api.responses_render`), streamed as named SSE events or not.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from mlxd.api import loading, respond
from mlxd.api.body import StrictJSON
from mlxd.api.metrics import Metrics
from mlxd.api.output import EventStream
from mlxd.api.responses_jobs import responses_job
from mlxd.api.responses_render import ResponsesRenderer, replay
from mlxd.api.responses_schemas import ResponseObject, ResponsesRequest
from mlxd.api.validate import check_size
from mlxd.daemon import Daemon
from mlxd.model_slot import ModelSlot


class ResponsesController(Controller):
    path = "/v1"
    tags = ["OpenAI Responses"]

    @post("/responses", status_code=200, dto=StrictJSON[ResponsesRequest], return_dto=None)
    async def create_response(
        self, request: Request, data: JSONBody[ResponsesRequest], daemon: NamedDependency[Daemon],
        metrics: NamedDependency[Metrics],
    ) -> ResponseObject | EventStream:
        """A model response to ``input``: a response object, or (``stream``) its named SSE events ending with
        ``response.completed``, ``response.incomplete`` or ``response.failed``. A request for a model that is not
        loaded waits for it (a stream with keep-alives)."""

        def before_wait(served: ModelSlot) -> loading.ErrorFrames:
            check_size(data, **served.size_limits())
            job, settings = responses_job(data, served.name, served.config.model.sampling)
            return loading.error_frames(ResponsesRenderer(job.request_id, int(time.time()), settings))

        return await loading.answer(daemon.models, data.model, data.stream,
                                    lambda served, arrived: _response(request, data, served, metrics, arrived),
                                    before_wait)


async def _response(request: Request, data: ResponsesRequest, served: ModelSlot, metrics: Metrics,
                    arrived: float | None) -> ResponseObject | EventStream:
    check_size(data, **served.size_limits())
    job, settings = responses_job(data, served.name, served.config.model.sampling)
    events, trace = await respond.start(served, job, "responses", metrics.observe, receive=request.receive,
                                        arrived=arrived)
    renderer = ResponsesRenderer(job.request_id, int(time.time()), settings)
    if data.stream:
        return EventStream(respond.stream_sse(events, trace, renderer))
    recorded: list[tuple[int, Any]] = []
    await respond.collect(_recording(events, recorded), trace, request.receive)
    return replay(renderer, recorded)


async def _recording(events: AsyncIterator[tuple[int, Any]], into: list[tuple[int, Any]]
                     ) -> AsyncIterator[tuple[int, Any]]:
    """``events``, each also appended to ``into`` (the order of items is in the events, not in their sum)."""
    async with aclosing(events):
        async for event in events:
            into.append(event)
            yield event
