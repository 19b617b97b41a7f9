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
            job.prompt_text = self._render(job)
            job.prompt_ids = self.tokenizer.encode(job.prompt_text, add_special_tokens=False)
        elif isinstance(job.prompt, str):
            job.prompt_text = job.prompt
            job.prompt_ids = self.tokenizer.encode(job.prompt, add_special_tokens=True)
        elif job.prompt is not None:
            bad = [t for t in job.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt")
            job.prompt_ids = list(job.prompt)

    def _render(self, job: Job) -> str:
        kwargs = {**self.config.kwargs, **job.template_kwargs}
        try:
            return self.tokenizer.apply_chat_template(
                job.messages,
                tools=job.tools or None,
                tokenize=False,
                add_generation_prompt=self.config.add_generation_prompt,
                **kwargs,
            )
        except Exception as e:  # jinja raises plain exceptions for conversations a template refuses
            raise RequestError(f"the chat template rejected the conversation: {e}", param="messages") from e
