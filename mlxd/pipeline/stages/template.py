"""``template``: render chat messages with the model's chat template and tokenize the prompt."""

from __future__ import annotations

from typing import Any

from mlxd.constraints.tools import check_tool_names
from mlxd.errors import ContextLengthExceeded, RequestError
from mlxd.log import get_logger
from mlxd.pipeline.hermes import tool_list_in_system, tool_mode, tools_in_messages
from mlxd.pipeline.images import ImageInputs
from mlxd.pipeline.job import Job
from mlxd.pipeline.render import ChatRenderer, render_bounds
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage
from mlxd.pipeline.stages.template_points import (
    Breakpoints,
    SharedPrefixes,
    keep_only,
    locate_marks,
    strip_marks,
    token_position,
)

log = get_logger("mlxd.pipeline")

# A token never stands for more text than the UTF-8 bytes of its vocabulary entry (byte-level BPE and SentencePiece
# alike); a normalizer such as NFKC can fold up to 3 bytes of input into 1, hence the margin.
_NORMALIZER_MARGIN = 4


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token can stand for (an upper bound)."""
    return max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)


def num_rendered_bytes(messages: list[dict[str, Any]]) -> int:
    """Bytes of content every chat template renders verbatim: all but assistant turns (templates may drop
    reasoning from those once they are history)."""
    return sum(len(_text(m.get("content")).encode()) for m in messages if m.get("role") != "assistant")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # vision messages keep their parts: text parts and image placeholders
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


class TemplateConfig(NoOptions, frozen=True):
    add_generation_prompt: bool = True
    # Extra variables for the template, e.g. {enable_thinking = false}; requests may add their own.
    kwargs: dict[str, Any] = {}


class Template(Stage):
    name = "template"
    Config = TemplateConfig
    needs = frozenset({"messages", "prompt", "tools", "template_kwargs", "cache_breakpoints", "prompt_cache_key"})
    provides = frozenset({"prompt_text", "prompt_ids", "media", "checkpoints"})

    def warm_up(self, ctx: PipelineContext) -> None:
        self.tokenizer = ctx.tokenizer
        self.renderer = ChatRenderer(ctx.tokenizer, render_bounds(ctx.config))
        self.images = ImageInputs(ctx.processor, ctx.model.image_token_id) if ctx.processor is not None else None
        self.context_length = ctx.model.context_length
        # Templates that do not render tools themselves get help (mlxd.pipeline.hermes).
        self.tool_mode = tool_mode(getattr(ctx.tokenizer, "chat_template", None))
        # Requests may set the thinking switch (Anthropic `thinking`, `reasoning_effort`); a template without one
        # ignores it, which the log says.
        self.has_thinking_switch = "enable_thinking" in str(getattr(ctx.tokenizer, "chat_template", None) or "")
        self.max_prompt_bytes = ctx.model.context_length * max_token_bytes(ctx.tokenizer) * _NORMALIZER_MARGIN
        # A snapshot shorter than this is never looked up (``[engine] prefix_cache_min_tokens``; 1 without a config).
        engine = getattr(ctx.config, "engine", None)
        self.min_checkpoint = engine.prefix_cache_min_tokens if engine is not None else 1
        self.shared_prefixes = SharedPrefixes()

    def prepare(self, job: Job) -> None:
        if job.messages is not None:
            check_tool_names(job.tools)  # a name holding tool-call markup would forge or break calls
            # The messages as the API wrote them (client breakpoints marked in their text) and as they are.
            marked, messages = job.messages, strip_marks(job.messages, job.cache_breakpoints)
            self._refuse_oversized(num_rendered_bytes(messages), "messages")
            job.prompt_text = self._render(job, self.config.add_generation_prompt, messages)
            if job.images and self.images is not None:
                job.prompt_ids, job.media = self.images.process(job.prompt_text, job.images)
            else:
                job.prompt_ids = self.tokenizer.encode(job.prompt_text, add_special_tokens=False)
            job.checkpoints = self._checkpoints(job, messages, marked)
            if "enable_thinking" in job.template_kwargs and not self.has_thinking_switch:
                log.info("thinking_switch_ignored", request_id=job.request_id,
                         reason="the chat template has no enable_thinking switch")
            log.debug("prompt_rendered", request_id=job.request_id, prompt=job.prompt_text,
                      num_tokens=len(job.prompt_ids), num_images=len(job.images))
        elif isinstance(job.prompt, str):
            self._refuse_oversized(len(job.prompt.encode()), "prompt")
            job.prompt_text = job.prompt
            job.prompt_ids = self.tokenizer.encode(job.prompt, add_special_tokens=True)
        elif job.prompt is not None:  # token ids: checked against the vocabulary by the API and the engine
            job.prompt_ids = list(job.prompt)
            job.prompt_text = self.tokenizer.decode(job.prompt_ids)

    def _refuse_oversized(self, num_bytes: int, param: str) -> None:
        """Refuse, before rendering or tokenizing, a prompt whose size alone proves it cannot fit the context."""
        if num_bytes > self.max_prompt_bytes:
            raise ContextLengthExceeded(
                f"the prompt has {num_bytes} bytes of text: more than the {self.context_length}-token context of "
                f"this model can hold (at most {self.max_prompt_bytes} bytes)",
                param=param,
            )

    def _checkpoints(self, job: Job, messages: list[dict[str, Any]], marked: list[dict[str, Any]]) -> tuple[int, ...]:
        """Token positions worth a prefix-cache snapshot (:mod:`mlxd.pipeline.stages.template_points`): where the
        last message ends, where the system prompt and tools end, each client breakpoint (``marked``: the messages
        with the API's markers), and where the prompt parts from its ``prompt_cache_key``'s previous one."""
        encode = self._encode
        offsets = [o for o in (self._system_end(job, messages), *self._breakpoint_offsets(job, marked))
                   if o is not None]
        positions = {self._last_message_boundary(job, messages)}
        positions.update(token_position(encode, job.prompt_text, job.prompt_ids, o) for o in offsets)
        if job.prompt_cache_key is not None:
            positions.add(self.shared_prefixes.shared(job.prompt_cache_key, job.prompt_ids))
        checkpoints = tuple(sorted(p for p in positions
                                   if p is not None and self.min_checkpoint <= p < len(job.prompt_ids)))
        log.debug("prompt_checkpoints", request_id=job.request_id, checkpoints=checkpoints)
        return checkpoints

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _system_end(self, job: Job, messages: list[dict[str, Any]]) -> int | None:
        """The text offset where the leading system messages and the tool definitions end: the end of their own
        render where the prompt starts with it, else the start of the first other message's content (marked)."""
        first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), None)
        if first is None or not (first or job.tools):
            return None
        if first:
            try:
                head = self._render(job, False, messages[:first])
            except RequestError:  # a template that refuses a conversation of system messages alone
                head = ""
            if head and job.prompt_text.startswith(head) and len(head) < len(job.prompt_text):
                return len(head)
        marks = Breakpoints(f"{job.request_id}-system")
        target = {**messages[first], "content": _mark_start(messages[first].get("content"), marks)}
        if not marks.marks:
            return None
        return self._locate(job, [*messages[:first], target, *messages[first + 1 :]], marks.marks).get(marks.marks[0])

    def _breakpoint_offsets(self, job: Job, marked: list[dict[str, Any]]) -> list[int]:
        """The text offsets of the client's cache breakpoints: one render with every marker, or (when a marker
        changes the render) one render per marker, for the first :data:`_MAX_BREAKPOINTS`."""
        marks = job.cache_breakpoints
        if not marks:
            return []
        found = self._locate(job, marked, marks)
        if not found and len(marks) > 1:
            for mark in marks[:_MAX_BREAKPOINTS]:
                found.update(self._locate(job, keep_only(marked, marks, mark), [mark]))
        if len(found) < len(marks):
            log.debug("cache_breakpoints_dropped", request_id=job.request_id, num_breakpoints=len(marks),
                      num_located=len(found), reason="the template renders a marked message differently")
        return sorted(found.values())

    def _locate(self, job: Job, messages: list[dict[str, Any]], marks: list[str] | tuple[str, ...]) -> dict[str, int]:
        try:
            marked_text = self._render(job, self.config.add_generation_prompt, messages)
        except RequestError:
            return {}
        return locate_marks(marked_text, marks, job.prompt_text)

    def _last_message_boundary(self, job: Job, messages: list[dict[str, Any]]) -> int | None:
        """The prompt position where the last message ends and the generation prompt begins.

        The next turn of a conversation renders this turn's prompt up to here identically, even where the
        template renders the assistant's turn differently once it is history (thinking blocks, say)."""
        if not self.config.add_generation_prompt:
            return None
        bare = self._render(job, False, messages)
        if not job.prompt_text.startswith(bare):
            return None
        tail = self.tokenizer.encode(job.prompt_text[len(bare) :], add_special_tokens=False)
        boundary = len(job.prompt_ids) - len(tail)
        return boundary if 0 < boundary < len(job.prompt_ids) and job.prompt_ids[boundary:] == tail else None

    def _render(self, job: Job, add_generation_prompt: bool, messages: list[dict[str, Any]]) -> str:
        tools = job.tools or None
        if self.tool_mode == "list" and tools:
            messages, tools = tool_list_in_system(messages, tools), None
        elif self.tool_mode == "hermes" and (tools or any(m.get("tool_calls") or m["role"] == "tool"
                                                          for m in messages)):
            messages, tools = tools_in_messages(messages, tools), None
        try:
            return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **self._switches(job, tools))
        except RequestError:  # a bound exceeded
            raise
        except Exception as e:  # jinja raises plain exceptions for conversations a template refuses
            raise RequestError(f"the chat template rejected the conversation: {e}", param="messages") from e

    def _switches(self, job: Job, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The pipeline's and the request's template variables (the request's win), less the request's switches
        that the template does not read (which render the same without them)."""
        reads = self.renderer.variables(tools)
        ignored = [key for key in job.template_kwargs if key not in reads]
        if ignored:
            log.debug("template_switches_ignored", request_id=job.request_id, switches=ignored)
        return {**self.config.kwargs, **{k: v for k, v in job.template_kwargs.items() if k in reads}}


# Client breakpoints located one render each when a marker changes the render (Anthropic allows 4 a request).
_MAX_BREAKPOINTS = 8


def _mark_start(content: Any, marks: Breakpoints) -> Any:
    """``content`` with a marker before its text (before its first text part); unchanged when it has none."""
    if isinstance(content, str):
        return marks.after("") + content
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return [*content[:i], {**part, "text": marks.after("") + part["text"]}, *content[i + 1 :]]
    return content
