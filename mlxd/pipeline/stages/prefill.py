"""``prefill``, the prefill chunker: the prompt's chunk plan (:class:`~mlxd.pipeline.job.ChunkPlan`).

The engine processes a prompt in chunks, between other requests' decode steps; this stage says how: chunks of
``[engine] prefill_chunk`` tokens (the engine's own setting, so that warm-up and serving use the same size), a chunk
ending at each checkpoint (where the last message ends, from ``template``: a prefix-cache snapshot there serves the
conversation's next turn), and the completion room the context leaves after the prompt. A prompt that has no plan
is refused here: an empty one, one the context cannot hold, or one whose ``max_tokens`` does not fit beside it
(agent surfaces that always send a huge ``max_tokens`` get what the context leaves instead).
"""

from __future__ import annotations

from mlxd.errors import ContextLengthExceeded, RequestError
from mlxd.pipeline.job import ChunkPlan, Job
from mlxd.pipeline.stage import PipelineContext, Stage


class Prefill(Stage):
    """Takes no options: the chunk size is the engine's (``[engine] prefill_chunk``)."""

    name = "prefill"
    needs = frozenset({"prompt_ids", "checkpoints", "max_tokens", "clamp_max_tokens"})
    provides = frozenset({"chunk_plan", "max_tokens_clamped_from"})
    moved_options = {"chunk_size": "[engine] prefill_chunk"}

    def warm_up(self, ctx: PipelineContext) -> None:
        self.prefill_chunk = ctx.config.engine.prefill_chunk
        self.context_length = ctx.model.context_length
        self.default_max_tokens = ctx.config.model.sampling.max_tokens

    def prepare(self, job: Job) -> None:
        num_prompt = len(job.prompt_ids)
        if num_prompt == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if num_prompt >= self.context_length:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt} tokens; this model's context is {self.context_length} tokens",
                param="messages",
            )
        checkpoints = tuple(sorted(c for c in set(job.checkpoints) if 0 < c < num_prompt))
        job.chunk_plan = ChunkPlan(chunk_tokens=self.prefill_chunk, checkpoints=checkpoints,
                                   max_tokens=self._max_tokens(job, self.context_length - num_prompt))

    def _max_tokens(self, job: Job, room: int) -> int:
        """The completion tokens the request may generate: what it asked for, the config's default, or (agent
        surfaces, ``clamp_max_tokens``) what the context leaves."""
        if job.max_tokens is None:
            return room if job.clamp_max_tokens else min(self.default_max_tokens, room)
        if job.max_tokens <= room:
            return job.max_tokens
        if job.clamp_max_tokens:
            job.max_tokens_clamped_from = job.max_tokens
            return room
        raise ContextLengthExceeded(
            f"max_tokens={job.max_tokens} plus the prompt's {len(job.prompt_ids)} tokens exceeds the context of "
            f"{self.context_length} tokens (at most {room} completion tokens fit)",
            param="max_tokens",
        )
