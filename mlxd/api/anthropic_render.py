"""The Anthropic surface's rendering of the pipeline's events: a Messages body, or its stream of named SSE events.

A response's content is a list of blocks: ``thinking`` (reasoning), ``text`` and one ``tool_use`` per call, in
that order in a body and in the order the events come in a stream. The stream opens a block when the kind of
event changes and closes it before the next one opens: ``message_start``, then per block
``content_block_start`` / ``content_block_delta``... / ``content_block_stop`` with increasing indexes, then
``message_delta`` (stop reason, usage) and ``message_stop``; ``ping`` while nothing else is sent, ``error`` when
the request fails mid-stream. There is no ``[DONE]``.

mlxd does not sign reasoning: a thinking block's ``signature`` is the empty string (the stream sends it as a
``signature_delta`` before the block stops, as Anthropic's does).

Usage: ``input_tokens`` counts the prompt tokens that were computed, ``cache_read_input_tokens`` those served from
the prefix cache (nothing is billed, so ``cache_creation_input_tokens`` is 0). Which prompt tokens the cache serves
is known only once the request ends: ``message_start`` counts the whole prompt as ``input_tokens``, and
``message_delta`` carries the split (the SDKs take the later counts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxd.api.anthropic_schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorObject,
    ErrorResponse,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    SignatureDelta,
    StopInfo,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
)
from mlxd.api.errors import redact
from mlxd.api.output import Frame, Output
from mlxd.errors import ContextLengthExceeded, MlxdError, Overloaded
from mlxd.pipeline.events import ContentDelta, Done, ReasoningDelta, ToolCallDelta

PING = b'event: ping\ndata: {"type": "ping"}\n\n'

Block = TextOut | ThinkingOut | ToolUseOut
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def stop_reason(done: Done, clamped: bool) -> str:
    """Anthropic's ``stop_reason`` for a finished response. ``clamped``: the request's ``max_tokens`` was cut to
    what the context leaves, so running out of tokens means the context window is full."""
    if done.finish_reason == "tool_calls":
        return "tool_use"
    if done.finish_reason == "length":
        return "model_context_window_exceeded" if clamped else "max_tokens"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


def usage(done: Done) -> Usage:
    return Usage(input_tokens=done.num_prompt_tokens - done.num_cached_tokens,
                 output_tokens=done.num_completion_tokens, cache_read_input_tokens=done.num_cached_tokens)


def tool_use_id(call_id: str) -> str:
    """A parser's call id in Anthropic's form (``call_abc`` → ``toolu_abc``)."""
    return "toolu_" + call_id.removeprefix("call_")


def status_of(error: MlxdError) -> int:
    """The HTTP status of an mlxd error on this surface: a full queue is Anthropic's 529 (overloaded), not 429
    (which Anthropic's clients read as the account's rate limit)."""
    return 529 if isinstance(error, Overloaded) else error.status


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status. 503 (loading, draining, an engine restarting) is
    ``overloaded_error``: every 503 of mlxd is temporary and says when to retry, which clients do for that type."""
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_message(error: MlxdError) -> str:
    """The error's message for a client: a prompt too long for the context starts as Anthropic's does ("prompt is
    too long"), the words agents such as Claude Code look for before compacting the conversation."""
    if isinstance(error, ContextLengthExceeded) and error.param != "max_tokens":
        return f"prompt is too long: {error.message}"
    return error.message


def error_body(status: int, message: str) -> ErrorResponse:
    """Anthropic's error shape (``message`` is redacted: no paths, long echoed values clipped)."""
    return ErrorResponse(error=ErrorObject(type=error_type(status), message=redact(message)))


def message(id: str, model: str, output: Output, done: Done, clamped: bool) -> Message:
    """The body of a non-streaming response."""
    content: list[Block] = []
    if output.reasoning_text:  # as the stream, which sends no empty delta
        content.append(ThinkingOut(thinking=output.reasoning_text))
    if output.text:
        content.append(TextOut(text=output.text))
    for call_id, name, arguments in output.tool_calls():
        content.append(ToolUseOut(id=tool_use_id(call_id), name=name, input=json.loads(arguments or "{}")))
    return Message(id=id, model=model, content=content, stop_reason=stop_reason(done, clamped),
                   stop_sequence=done.stop_sequence, usage=usage(done))


@dataclass
class MessageRenderer:
    """The named SSE events of one streamed message (one choice: the Messages API has no ``n``)."""

    id: str
    model: str
    num_prompt_tokens: int
    clamped: bool
    terminator: bytes | None = None
    keepalive: bytes = PING
    _index: int = -1  # the open block's index (-1: none yet)
    _kind: str = ""  # the open block's kind ("" when none is open)
    _call: int | None = None  # the open tool_use block's call index

    def opening(self) -> list[Frame]:
        start = Message(id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
                        usage=Usage(input_tokens=self.num_prompt_tokens, output_tokens=0))
        return [_named(MessageStart(message=start))]

    def render(self, index: int, event: Any) -> list[Frame]:
        if isinstance(event, ContentDelta) and event.text:
            return self._delta("text", TextOut(text=""), TextDelta(text=event.text))
        if isinstance(event, ReasoningDelta) and event.text:
            return self._delta("thinking", ThinkingOut(thinking=""), ThinkingDelta(thinking=event.text))
        if isinstance(event, ToolCallDelta):
            return self._tool_call(event)
        return []

    def closing(self, index: int, done: Done) -> list[Frame]:
        return self._close()

    def final(self, done: Done) -> list[Frame]:
        stop = StopInfo(stop_reason=stop_reason(done, self.clamped), stop_sequence=done.stop_sequence)
        return [_named(MessageDelta(delta=stop, usage=usage(done))), _named(MessageStop())]

    def error(self, error: MlxdError) -> list[Frame]:
        return [_named(error_body(status_of(error), error_message(error)))]

    def _delta(self, kind: str, block: Block, delta: Any) -> list[Frame]:
        frames = [] if self._kind == kind else self._open(kind, block)
        return [*frames, _named(ContentBlockDelta(index=self._index, delta=delta))]

    def _tool_call(self, event: ToolCallDelta) -> list[Frame]:
        frames: list[Frame] = []
        if self._kind != "tool_use" or self._call != event.index:
            # A call's first delta carries its id and name.
            block = ToolUseOut(id=tool_use_id(event.id or ""), name=event.name or "", input={})
            frames = self._open("tool_use", block)
            self._call = event.index
        if event.arguments:
            delta = InputJSONDelta(partial_json=event.arguments)
            frames.append(_named(ContentBlockDelta(index=self._index, delta=delta)))
        return frames

    def _open(self, kind: str, block: Block) -> list[Frame]:
        frames = self._close()
        self._index, self._kind = self._index + 1, kind
        return [*frames, _named(ContentBlockStart(index=self._index, content_block=block))]

    def _close(self) -> list[Frame]:
        if not self._kind:
            return []
        frames = []
        if self._kind == "thinking":
            frames.append(_named(ContentBlockDelta(index=self._index, delta=SignatureDelta(signature=""))))
        frames.append(_named(ContentBlockStop(index=self._index)))
        self._kind, self._call = "", None
        return frames


def _named(event: Any) -> Frame:
    """An event as a frame named after its type (Anthropic's SSE events are named so)."""
    return event.__struct_config__.tag, event
