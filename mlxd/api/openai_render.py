"""The OpenAI surface's rendering of the pipeline's events: chat and text completion chunks (SSE) and bodies.

Renderers keep per-response state only: the pending log-probabilities (sent with the next chunk of text) and, for
text completions, the text offset. Tool calls arrive as typed deltas and are written as OpenAI's ``tool_calls``
deltas; reasoning goes to ``reasoning_content``; nothing here parses text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxd.api.output import SSE_KEEPALIVE, Frame, Output
from mlxd.api.respond import error_body, usage_of
from mlxd.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    FunctionDelta,
    FunctionOut,
    LogprobOut,
    ToolCallChunk,
    ToolCallOut,
    TopLogprobOut,
)
from mlxd.errors import MlxdError
from mlxd.pipeline.events import (
    ContentDelta,
    Done,
    ReasoningDelta,
    TokenLogprob,
    TokenLogprobs,
    ToolCallDelta,
)

SSE_DONE = b"data: [DONE]\n\n"


def chat_logprobs(entries: list[TokenLogprob]) -> ChoiceLogprobs:
    def out(text: str, logprob: float) -> TopLogprobOut:
        return TopLogprobOut(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChoiceLogprobs(content=[
        LogprobOut(token=e.text, logprob=e.logprob, bytes=list(e.text.encode()),
                   top_logprobs=[out(t.text, t.logprob) for t in e.top])
        for e in entries
    ])


def completion_logprobs(entries: list[TokenLogprob], offset: int, with_top: bool) -> CompletionLogprobs:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return CompletionLogprobs(
        tokens=[e.text for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{t.text: t.logprob for t in e.top} for e in entries] if with_top else None,
        text_offset=offsets,
    )


def tool_call_chunk(delta: ToolCallDelta) -> ToolCallChunk:
    if delta.id is not None:  # a call's first delta: id, type and name
        return ToolCallChunk(index=delta.index, id=delta.id, type="function",
                             function=FunctionDelta(name=delta.name, arguments=delta.arguments))
    return ToolCallChunk(index=delta.index, function=FunctionDelta(arguments=delta.arguments))


@dataclass
class ChatRenderer:
    """Chat completion chunks, one choice per ``index`` (``n`` > 1 interleaves them)."""

    id: str
    created: int
    model: str
    num_choices: int = 1
    include_usage: bool = False
    logprobs: bool = False
    terminator: bytes | None = SSE_DONE
    keepalive: bytes = SSE_KEEPALIVE
    _pending: dict[int, list[TokenLogprob]] = field(default_factory=dict)

    def chunk(self, index: int, delta: Delta, finish: str | None = None,
              logprobs: ChoiceLogprobs | None = None) -> Frame:
        choice = ChunkChoice(index, delta, finish, logprobs)
        return None, ChatCompletionChunk(self.id, self.created, self.model, [choice])

    def opening(self) -> list[Frame]:
        return [self.chunk(i, Delta(role="assistant", content="")) for i in range(self.num_choices)]

    def render(self, index: int, event: Any) -> list[Frame]:
        if isinstance(event, TokenLogprobs):
            if self.logprobs:
                self._pending.setdefault(index, []).extend(event.entries)
            return []
        if isinstance(event, ContentDelta):
            delta = Delta(content=event.text)
        elif isinstance(event, ReasoningDelta):
            delta = Delta(reasoning_content=event.text)
        elif isinstance(event, ToolCallDelta):
            delta = Delta(tool_calls=[tool_call_chunk(event)])
        else:
            return []
        return [self.chunk(index, delta, logprobs=self._take(index))]

    def closing(self, index: int, done: Done) -> list[Frame]:
        return [self.chunk(index, Delta(), done.finish_reason, self._take(index))]

    def final(self, done: Done) -> list[Frame]:
        if not self.include_usage:
            return []
        return [(None, ChatCompletionChunk(self.id, self.created, self.model, [], usage_of(done)))]

    def error(self, error: MlxdError) -> list[Frame]:
        return [(None, error_body(error))]

    def _take(self, index: int) -> ChoiceLogprobs | None:
        entries = self._pending.pop(index, None)
        return chat_logprobs(entries) if entries else None


@dataclass
class CompletionRenderer:
    """Text completion chunks (the legacy API), one choice per ``index``."""

    id: str
    created: int
    model: str
    num_choices: int = 1
    include_usage: bool = False
    num_logprobs: int | None = None
    echo: str = ""  # the prompt, sent first in each choice (``echo``)
    terminator: bytes | None = SSE_DONE
    keepalive: bytes = SSE_KEEPALIVE
    _pending: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)

    def chunk(self, index: int, text: str, finish: str | None = None) -> Frame:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        entries = self._pending.pop(index, None)
        logprobs = completion_logprobs(entries, offset, bool(self.num_logprobs)) if entries else None
        choice = CompletionChoice(index, text, finish, logprobs)
        return None, Completion(self.id, self.created, self.model, [choice])

    def opening(self) -> list[Frame]:
        if not self.echo:
            return []
        for i in range(self.num_choices):
            self._offsets[i] = len(self.echo)
        return [(None, Completion(self.id, self.created, self.model, [CompletionChoice(i, self.echo, None)]))
                for i in range(self.num_choices)]

    def render(self, index: int, event: Any) -> list[Frame]:
        if isinstance(event, TokenLogprobs):
            if self.num_logprobs is not None:
                self._pending.setdefault(index, []).extend(event.entries)
            return []
        if isinstance(event, ContentDelta):
            return [self.chunk(index, event.text)]
        return []

    def closing(self, index: int, done: Done) -> list[Frame]:
        return [self.chunk(index, "", done.finish_reason)]

    def final(self, done: Done) -> list[Frame]:
        if not self.include_usage:
            return []
        return [(None, Completion(self.id, self.created, self.model, [], usage_of(done)))]

    def error(self, error: MlxdError) -> list[Frame]:
        return [(None, error_body(error))]


def chat_choice(index: int, output: Output, logprobs: bool) -> ChatChoice:
    calls = [ToolCallOut(id=i, function=FunctionOut(name=n, arguments=a)) for i, n, a in output.tool_calls()]
    message = AssistantMessage(role="assistant", content=output.text or (None if calls else ""),
                               reasoning_content=output.reasoning_text, tool_calls=calls or None)
    choice_logprobs = chat_logprobs(output.logprobs) if logprobs else None
    return ChatChoice(index=index, message=message, finish_reason=output.done.finish_reason,
                      logprobs=choice_logprobs)


def chat_completion(id: str, created: int, model: str, outputs: list[Output], done: Done,
                    logprobs: bool) -> ChatCompletion:
    choices = [chat_choice(i, output, logprobs) for i, output in enumerate(outputs)]
    return ChatCompletion(id, created, model, choices, usage_of(done))


def text_completion(id: str, created: int, model: str, outputs: list[Output], done: Done,
                    num_logprobs: int | None, echo: str = "") -> Completion:
    choices = []
    for i, output in enumerate(outputs):
        logprobs = (completion_logprobs(output.logprobs, len(echo), bool(num_logprobs))
                    if num_logprobs is not None else None)
        choices.append(CompletionChoice(i, echo + output.text, output.done.finish_reason, logprobs))
    return Completion(id, created, model, choices, usage_of(done))
