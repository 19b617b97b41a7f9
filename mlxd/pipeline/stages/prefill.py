"""``prefill``: check the prompt against the context and build the engine request (chunked prompt processing)."""

from __future__ import annotations

from mlxd.engine.base import EngineRequest
from mlxd.errors import ContextLengthExceeded, RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage


class Prefill(Stage):
    """Takes no options: the chunk size is the engine's (``[engine] prefill_chunk``), so that warm-up and
    serving use the same one."""

    name = "prefill"
    moved_options = {"chunk_size": "[engine] prefill_chunk"}

    def warm_up(self, ctx: PipelineContext) -> None:
        self.prefill_chunk = ctx.config.engine.prefill_chunk
        self.context_length = ctx.model.context_length
        self.default_max_tokens = ctx.config.model.sampling.max_tokens
        self.eos_token_ids = ctx.model.eos_token_ids

    def prepare(self, job: Job) -> None:
        num_prompt = len(job.prompt_ids)
        if num_prompt == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if num_prompt >= self.context_length:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt} tokens; this model's context is {self.context_length} tokens",
                param="messages",
            )
        room = self.context_length - num_prompt
        if job.max_tokens is None and job.clamp_max_tokens:
            max_tokens = room  # agent surfaces (Responses) without a limit: what the context leaves
        elif job.max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif job.max_tokens > room and job.clamp_max_tokens:
            max_tokens, job.max_tokens_clamped_from = room, job.max_tokens
        elif job.max_tokens > room:
            raise ContextLengthExceeded(
                f"max_tokens={job.max_tokens} plus the prompt's {num_prompt} tokens exceeds the context of "
                f"{self.context_length} tokens (at most {room} completion tokens fit)",
                param="max_tokens",
            )
        else:
            max_tokens = job.max_tokens
        job.engine_request = EngineRequest(
            request_id=job.request_id,
            prompt=job.prompt_ids,
            max_tokens=max_tokens,
            sampling=job.sampling,
            stop_token_ids=self.eos_token_ids,
            prefill_chunk=self.prefill_chunk,
            checkpoints=job.checkpoints,
            media=job.media,
            route=job.route or "text",
            prompt_text=job.prompt_text,
            num_logprobs=job.num_logprobs,
            decode=job.decode,
        )
