"""The Anthropic surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

``anthropic-version`` and ``anthropic-beta`` headers and the ``?beta=true`` query (Claude Code's) are accepted and
change nothing; the API key may come as ``x-api-key`` (``mlxd.api.auth``).

Every error on these routes leaves in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``:
the controller's exception handlers take precedence over the app's (OpenAI-shaped) ones for its routes, the API
key guard's 401 included (Litestar runs guards inside the route's exception handling). The messages are the ones
the OpenAI surface writes (``mlxd.api.errors``), so both surfaces say the same thing; statuses and types follow
``mlxd.api.anthropic_render.error_type``, and a full queue is a 529 with ``Retry-After``.
"""

from __future__ import annotations

import math

import structlog
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException, ValidationException
from litestar.params import JSONBody

from mlxd.api import anthropic_jobs as jobs
from mlxd.api import anthropic_render as render
from mlxd.api import errors, loading, respond
from mlxd.api.anthropic_schemas import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorResponse,
    Message,
    MessagesRequest,
)
from mlxd.api.body import StrictJSON
from mlxd.api.metrics import Metrics
from mlxd.api.output import EventStream
from mlxd.api.schemas import ErrorBody
from mlxd.api.validate import check_size
from mlxd.daemon import Daemon
from mlxd.errors import AuthenticationError, MlxdError
from mlxd.log import get_logger
from mlxd.model_slot import ModelSlot

log = get_logger("mlxd.request")

# The stage whose `prepare` first needs the prompt to fit the context (and builds the engine request).
PREFILL_STAGE = "prefill"


def handle_mlxd_error(_: Request, exc: MlxdError) -> Response[ErrorResponse]:
    """mlxd's errors: their status (a full queue's 429 as 529), ``Retry-After`` on 429, 503 and 529."""
    status = render.status_of(exc)
    headers = {}
    if status in (429, 503, 529) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, AuthenticationError) and status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="mlxd"'
    return Response(render.error_body(status, render.error_message(exc)), status_code=status,
                    headers=headers or None)


def _reshaped(response: Response[ErrorBody]) -> Response[ErrorResponse]:
    """An error the OpenAI surface's handler wrote (its message, status and headers) in Anthropic's shape."""
    status = response.status_code
    return Response(render.error_body(status, response.content.error.message), status_code=status,
                    headers=dict(response.headers) or None)


def handle_validation(request: Request, exc: ValidationException) -> Response[ErrorResponse]:
    return _reshaped(errors.handle_validation(request, exc))


def handle_http(request: Request, exc: HTTPException) -> Response[ErrorResponse]:
    """Litestar's own errors (a body over ``max_body_bytes`` is a 413 ``request_too_large``)."""
    return _reshaped(errors.handle_http(request, exc))


def handle_unexpected(request: Request, exc: Exception) -> Response[ErrorResponse]:
    """A bug: a generic 500 ``api_error`` naming the request id; the details go to the log."""
    return _reshaped(errors.handle_unexpected(request, exc))


class AnthropicController(Controller):
    path = "/v1"
    tags = ["Anthropic"]
    exception_handlers = {
        MlxdError: handle_mlxd_error,
        ValidationException: handle_validation,
        HTTPException: handle_http,
        Exception: handle_unexpected,
    }

    @post("/messages", status_code=200, dto=StrictJSON[MessagesRequest], return_dto=None)
    async def messages(
        self, request: Request, data: JSONBody[MessagesRequest], daemon: NamedDependency[Daemon],
        metrics: NamedDependency[Metrics],
    ) -> Message | EventStream:
        """A message, streamed (named SSE events) or not, in Anthropic's format: thinking, text and tool_use
        blocks. A ``max_tokens`` beyond what the context leaves is clamped, not refused. A request for a model that
        is not loaded waits for it (a stream with keep-alives)."""

        def before_wait(served: ModelSlot) -> loading.ErrorFrames:
            check_size(data, **served.size_limits())
            job = jobs.messages_job(data, served.name, served.config.model.sampling)
            return loading.error_frames(render.MessageRenderer(job.request_id, served.name, 0, clamped=False))

        return await loading.answer(daemon.models, data.model, data.stream,
                                    lambda served, arrived: _message(request, data, served, metrics, arrived),
                                    before_wait)

    @post("/messages/count_tokens", status_code=200, dto=StrictJSON[CountTokensRequest], return_dto=None)
    async def count_tokens(self, request: Request, data: JSONBody[CountTokensRequest],
                           daemon: NamedDependency[Daemon]) -> CountTokensResponse:
        """The number of tokens of the prompt a request with these messages, system prompt, tools and thinking
        setting would run (the stages before ``prefill``: normalize, template, route); nothing is generated, and a
        prompt longer than the context is counted, not refused, unless its text alone proves it cannot fit (400)."""
        served = await daemon.models.acquire(data.model)  # loads it if it is not loaded
        model = served.name
        check_size(data, **served.size_limits())
        job = jobs.prompt_job(data, model)
        structlog.contextvars.bind_contextvars(request_id=job.request_id)
        await respond.prepare(served, job, request.receive, until=PREFILL_STAGE)
        log.info("count_tokens", request_id=job.request_id, model=model, prompt_tokens=len(job.prompt_ids))
        return CountTokensResponse(input_tokens=len(job.prompt_ids))


async def _message(request: Request, data: MessagesRequest, served: ModelSlot, metrics: Metrics,
                   arrived: float | None) -> Message | EventStream:
    model = served.name
    jobs.check_vocabulary(data, served.model_info)
    check_size(data, **served.size_limits())
    job = jobs.messages_job(data, model, served.config.model.sampling)
    events, trace = await respond.start(served, job, "messages", metrics.observe, receive=request.receive,
                                        arrived=arrived)
    clamped = job.max_tokens_clamped_from is not None
    if not data.stream:
        outputs = await respond.collect(events, trace, request.receive)
        return render.message(job.request_id, model, outputs[0], trace.done, clamped)
    renderer = render.MessageRenderer(job.request_id, model, len(job.prompt_ids), clamped)
    return EventStream(respond.stream_sse(events, trace, renderer))
