"""``template``: render chat messages with the model's chat template and tokenize the prompt."""

from __future__ import annotations

from typing import Any

from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage


class TemplateConfig(NoOptions, frozen=True):
    add_generation_prompt: bool = True
    # Extra variables for the template, e.g. {enable_thinking = false}; requests may add their own.
    kwargs: dict[str, Any] = {}


class Template(Stage):
    name = "template"
    Config = TemplateConfig

    def warm_up(self, ctx: PipelineContext) -> None:
        self.tokenizer = ctx.tokenizer
        self.vocab_size = len(ctx.tokenizer)

    def prepare(self, job: Job) -> None:
        if job.messages is not None:
            job.prompt_text = self._render(job, self.config.add_generation_prompt)
            job.prompt_ids = self.tokenizer.encode(job.prompt_text, add_special_tokens=False)
            boundary = self._last_message_boundary(job)
            job.checkpoints = (boundary,) if boundary else ()
        elif isinstance(job.prompt, str):
            job.prompt_text = job.prompt
            job.prompt_ids = self.tokenizer.encode(job.prompt, add_special_tokens=True)
        elif job.prompt is not None:
            bad = [t for t in job.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt")
            job.prompt_ids = list(job.prompt)

    def _last_message_boundary(self, job: Job) -> int | None:
        """The prompt position where the last message ends and the generation prompt begins.

        The next turn of a conversation renders this turn's prompt up to here identically, even where the
        template renders the assistant's turn differently once it is history (thinking blocks, say)."""
        if not self.config.add_generation_prompt:
            return None
        bare = self._render(job, False)
        if not job.prompt_text.startswith(bare):
            return None
        tail = self.tokenizer.encode(job.prompt_text[len(bare) :], add_special_tokens=False)
        boundary = len(job.prompt_ids) - len(tail)
        return boundary if 0 < boundary < len(job.prompt_ids) and job.prompt_ids[boundary:] == tail else None

    def _render(self, job: Job, add_generation_prompt: bool) -> str:
        kwargs = {**self.config.kwargs, **job.template_kwargs}
        try:
            return self.tokenizer.apply_chat_template(
                job.messages,
                tools=job.tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as e:  # jinja raises plain exceptions for conversations a template refuses
            raise RequestError(f"the chat template rejected the conversation: {e}", param="messages") from e
