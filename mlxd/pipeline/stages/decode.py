"""``decode``: submit the engine request and relay its token stream; cancel it if the consumer leaves."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from mlxd.engine.base import Failed, Finished, Progress
from mlxd.errors import EngineError, PipelineError, RequestError
from mlxd.pipeline.events import KeepAlive
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage


class Decode(Stage):
    name = "decode"

    def warm_up(self, ctx: PipelineContext) -> None:
        self.engine = ctx.engine
        self.keepalive_s = ctx.config.server.keepalive_s

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        if job.engine_request is None:
            raise PipelineError("decode needs an engine request: put a `prefill` stage before it")
        if _constrained(job) and job.engine_request.logits_processors is None:
            raise RequestError("this server's pipeline has no `parse` stage, so tool_choice and response_format "
                               "cannot be enforced", param="response_format" if job.response_format else "tool_choice")
        handle = self.engine.submit(job.engine_request)
        try:
            # Accepted: lets the API send response headers before the first token exists.
            yield KeepAlive()
            last_progress = time.monotonic()
            async for event in handle.events(self.keepalive_s):
                if event is None:
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


def _constrained(job: Job) -> bool:
    forced = bool(job.tools) and (job.tool_choice == "required" or isinstance(job.tool_choice, dict))
    return forced or job.response_format is not None
