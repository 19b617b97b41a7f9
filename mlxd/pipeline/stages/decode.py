"""``decode``, the batch decoder: hand the request to the engine and relay its events.

``prepare`` builds the :class:`~mlxd.engine.base.EngineRequest` from what the earlier stages decided: the token ids
and images (``template``), the path and decode mode (``route``), the chunk plan (``prefill``). ``parse``, later,
adds its grammar to it. ``stream`` submits it to the engine (which answers ``Overloaded``, a 429, when its queue is
full), where it decodes in one batch with every other running request, and relays the engine's token events;
closing the stream (the client went away, or a later stage has what it needs) ends the request in the engine. Tokens
that came together (paced by the engine, or several of one step) go on as one :class:`~mlxd.engine.base.Tokens`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from mlxd.engine.base import EngineRequest, Failed, Finished, Progress, Token, Tokens
from mlxd.errors import EngineError, PipelineError, RequestError
from mlxd.pipeline.events import KeepAlive
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage
from mlxd.pipeline.stages.route import TEXT, VISION


class Decode(Stage):
    name = "decode"
    needs = frozenset({"prompt_ids", "prompt_text", "media", "route", "decode", "chunk_plan", "sampling",
                       "num_logprobs"})
    provides = frozenset({"engine_request"})

    def warm_up(self, ctx: PipelineContext) -> None:
        self.engine = ctx.engine
        self.keepalive_s = ctx.config.server.keepalive_s
        self.eos_token_ids = ctx.model.eos_token_ids

    def prepare(self, job: Job) -> None:
        plan = job.chunk_plan
        if plan is None:
            raise PipelineError("the pipeline made no chunk plan for this request")
        _check_route(job)
        job.engine_request = EngineRequest(
            request_id=job.request_id,
            prompt=job.prompt_ids,
            max_tokens=plan.max_tokens,
            sampling=job.sampling,
            stop_token_ids=self.eos_token_ids,
            prefill_chunk=plan.chunk_tokens,
            checkpoints=plan.checkpoints,
            media=job.media,
            route=job.route,
            decode=job.decode,
            prompt_text=job.prompt_text,
            num_logprobs=job.num_logprobs,
        )

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        request = job.engine_request
        if request is None:
            raise PipelineError("the request was not prepared for the engine")
        forced = job.forced_output()
        if forced is not None and request.logits_processors is None:
            raise RequestError(f"this server's pipeline has no `parse` stage, so {forced} cannot be enforced",
                               param=forced)
        handle = self.engine.submit(request)
        try:
            # Accepted: lets the API send response headers before the first token exists.
            yield KeepAlive()
            last_progress = time.monotonic()
            async for event in handle.events(self.keepalive_s):
                if type(event) is Token:  # nearly every event: nothing to check
                    more = handle.take_tokens()
                    yield Tokens((event, *more)) if more else event
                elif event is None:
                    yield KeepAlive()
                elif isinstance(event, Progress):
                    # A long prompt reports every chunk, so the engine is never silent for keepalive_s: keep the
                    # client's connection alive from these instead.
                    if time.monotonic() - last_progress >= self.keepalive_s:
                        last_progress = time.monotonic()
                        yield KeepAlive()
                elif isinstance(event, Failed):  # 503 when the server is going away or the queue was too long
                    raise EngineError(event.message, status=event.status)
                else:
                    yield event
                    if isinstance(event, Finished):
                        return
        finally:
            handle.cancel("stop" if job.ended_by_pipeline else "cancelled")


def _check_route(job: Job) -> None:
    """The engine acts on the route alone, so a route that contradicts the request (a stage in place of ``route``
    that got it wrong) is refused here, naming it, rather than run down the wrong path."""
    if job.route not in (TEXT, VISION):
        raise PipelineError(f"the route {job.route!r} is not one the engine runs; it runs {TEXT!r} and {VISION!r}")
    if job.media is not None and job.route != VISION:
        raise PipelineError(f"the route {job.route!r} was chosen for a request with images; only "
                            f"{VISION!r} runs them")
    if job.media is None and job.route == VISION:
        raise PipelineError(f"the route {VISION!r} was chosen for a request without images (the pipeline "
                            "processed none for the model)")
