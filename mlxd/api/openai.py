"""The OpenAI surface: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from mlxd.api import jobs, loading, respond
from mlxd.api import openai_render as render
from mlxd.api.body import StrictJSON
from mlxd.api.metrics import Metrics
from mlxd.api.output import EventStream
from mlxd.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from mlxd.api.validate import check_size
from mlxd.daemon import Daemon
from mlxd.model_slot import ModelSlot


class OpenAIController(Controller):
    path = "/v1"
    tags = ["OpenAI"]

    @post("/chat/completions", status_code=200, dto=StrictJSON[ChatCompletionRequest], return_dto=None)
    async def chat_completions(
        self, request: Request, data: JSONBody[ChatCompletionRequest], daemon: NamedDependency[Daemon],
        metrics: NamedDependency[Metrics],
    ) -> ChatCompletion | EventStream:
        """Chat completion, streaming (SSE) or not, in the OpenAI format: content, reasoning_content, tool calls,
        logprobs, ``n`` choices. A request for a model that is not loaded waits for it (a stream with keep-alives)."""

        def before_wait(served: ModelSlot) -> loading.ErrorFrames:
            check_size(data, **served.size_limits())
            job = jobs.chat_job(data, served.name, served.config.model.sampling, served.config.engine.max_n)
            return loading.error_frames(render.ChatRenderer(job.request_id, int(time.time()), served.name, data.n))

        return await loading.answer(daemon.models, data.model, data.stream,
                                    lambda served, arrived: _chat(request, data, served, metrics, arrived), before_wait)

    @post("/completions", status_code=200, dto=StrictJSON[CompletionRequest], return_dto=None)
    async def completions(
        self, request: Request, data: JSONBody[CompletionRequest], daemon: NamedDependency[Daemon],
        metrics: NamedDependency[Metrics],
    ) -> Completion | EventStream:
        """Text completion of a raw prompt (no chat template): logprobs, ``n`` choices, ``echo``. A request for a
        model that is not loaded waits for it (a stream with keep-alives)."""

        def before_wait(served: ModelSlot) -> loading.ErrorFrames:
            check_size(data, **served.size_limits())
            job = jobs.completion_job(data, served.name, served.config.model.sampling, served.config.engine.max_n)
            return loading.error_frames(render.CompletionRenderer(job.request_id, int(time.time()), served.name,
                                                                  data.n))

        return await loading.answer(daemon.models, data.model, data.stream,
                                    lambda served, arrived: _completion(request, data, served, metrics, arrived),
                                    before_wait)

    @get("/models")
    async def list_models(self, daemon: NamedDependency[Daemon]) -> ModelList:
        """Every configured model with its state (aliases are patterns, so they are not listed as models)."""
        return ModelList([ModelCard(slot.name, daemon.created, state=slot.state) for slot in daemon.models.slots])

    @get("/models/{model_id:path}")
    async def get_model(self, model_id: FromPath[str], daemon: NamedDependency[Daemon]) -> ModelCard:
        """One model by id: the served name, or any id matching an alias pattern (404 otherwise)."""
        model_id = model_id.lstrip("/")
        return ModelCard(model_id, daemon.created, state=daemon.models.resolve(model_id).state)


async def _chat(request: Request, data: ChatCompletionRequest, served: ModelSlot, metrics: Metrics,
                arrived: float | None) -> ChatCompletion | EventStream:
    model = served.name
    jobs.check_vocabulary(data, served.model_info)
    check_size(data, **served.size_limits())
    job = jobs.chat_job(data, model, served.config.model.sampling, served.config.engine.max_n)
    events, trace = await respond.start(served, job, "chat", metrics.observe, n=data.n, receive=request.receive,
                                        arrived=arrived)
    created, logprobs = int(time.time()), job.num_logprobs is not None
    if not data.stream:
        outputs = await respond.collect(events, trace, request.receive)
        return render.chat_completion(job.request_id, created, model, outputs, trace.done, logprobs)
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    renderer = render.ChatRenderer(job.request_id, created, model, data.n, include_usage, logprobs)
    return EventStream(respond.stream_sse(events, trace, renderer))


async def _completion(request: Request, data: CompletionRequest, served: ModelSlot, metrics: Metrics,
                      arrived: float | None) -> Completion | EventStream:
    model = served.name
    jobs.check_vocabulary(data, served.model_info)
    check_size(data, **served.size_limits())
    job = jobs.completion_job(data, model, served.config.model.sampling, served.config.engine.max_n)
    events, trace = await respond.start(served, job, "completions", metrics.observe, n=data.n,
                                        receive=request.receive, arrived=arrived)
    created = int(time.time())
    echo = job.prompt_text if data.echo else ""
    if not data.stream:
        outputs = await respond.collect(events, trace, request.receive)
        return render.text_completion(job.request_id, created, model, outputs, trace.done, data.logprobs, echo)
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    renderer = render.CompletionRenderer(job.request_id, created, model, data.n, include_usage, data.logprobs,
                                         echo=echo)
    return EventStream(respond.stream_sse(events, trace, renderer))
