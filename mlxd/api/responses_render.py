"""The Responses API's rendering of the pipeline's events: output items and their named SSE events.

One state machine, :class:`ResponsesRenderer`, serves both ways of answering: streamed, its frames are sent;
not streamed, the same events go through it and only the final response object is kept, so the two answers cannot
differ. The events become output items in the order they come: a ``reasoning`` item for reasoning text, a
``message`` item for answer text, a ``function_call`` item per tool call; a change of kind closes the open item
and opens the next, at the next ``output_index``.

Whitespace that only separates items (the blank lines a template puts after ``</think>``, the newline before a
tool call) opens no item: a text item opens at its first non-blank text, without the newlines before it, and ends
without trailing whitespace.

The events, in order: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``,
then for a message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a reasoning item ``response.reasoning_summary_part.added``,
``response.reasoning_summary_text.delta``..., ``response.reasoning_summary_text.done``,
``response.reasoning_summary_part.done``; for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done`` with the whole item. Last,
``response.completed`` (``response.incomplete`` at ``max_output_tokens``, ``response.failed`` on a failure) with
the whole response and its usage. Every event carries an increasing ``sequence_number``; there is no ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mlxd.api.errors import redact
from mlxd.api.output import SSE_KEEPALIVE, Frame
from mlxd.api.responses_schemas import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemEvent,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ResponseError,
    ResponseObject,
    ResponseSettings,
    ResponseUsage,
    SummaryDeltaEvent,
    SummaryDoneEvent,
    SummaryPartEvent,
    SummaryText,
    TextDeltaEvent,
    TextDoneEvent,
)
from mlxd.errors import MlxdError
from mlxd.pipeline.events import ContentDelta, Done, ReasoningDelta, ToolCallDelta

MESSAGE, REASONING, CALL = "message", "reasoning", "function_call"
PREFIXES = {MESSAGE: "msg_", REASONING: "rs_", CALL: "fc_"}


@dataclass(slots=True)
class _Item:
    """The output item being written."""

    kind: str
    id: str
    output_index: int
    parts: list[str] = field(default_factory=list)  # text or arguments sent so far
    pending: str = ""  # trailing whitespace held back: sent if more text follows
    call_id: str = ""
    name: str = ""
    call_index: int = -1

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class ResponsesRenderer:
    """Frames of one streamed response (``n`` = 1), and the response object itself (:meth:`response`)."""

    id: str
    created_at: int
    settings: ResponseSettings
    terminator: bytes | None = None
    keepalive: bytes = SSE_KEEPALIVE
    _sequence: int = 0
    _items: list[OutputItem] = field(default_factory=list)
    _open: _Item | None = None
    _lead: tuple[str, str] = ("", "")  # (kind, blank text) seen before a text item opens
    _chars: dict[str, int] = field(default_factory=lambda: {MESSAGE: 0, REASONING: 0, CALL: 0})

    def opening(self) -> list[Frame]:
        return [self._lifecycle("response.created", self.response(None)),
                self._lifecycle("response.in_progress", self.response(None))]

    def render(self, index: int, event: Any) -> list[Frame]:
        if isinstance(event, ContentDelta):
            return self._text(MESSAGE, event.text)
        if isinstance(event, ReasoningDelta):
            return self._text(REASONING, event.text)
        if isinstance(event, ToolCallDelta):
            return self._call(event)
        return []  # logprobs (not asked for on this surface) and anything new

    def closing(self, index: int, done: Done) -> list[Frame]:
        return self._close("incomplete" if done.finish_reason == "length" else "completed")

    def final(self, done: Done) -> list[Frame]:
        response = self.response(done)
        return [self._lifecycle(f"response.{response.status}", response)]

    def error(self, error: MlxdError) -> list[Frame]:
        frames = self._close("incomplete")
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        failed = msgspec.structs.replace(self.response(None), status="failed",
                                         error=ResponseError(code, redact(error.message)))
        return [*frames, self._lifecycle("response.failed", failed)]

    def response(self, done: Done | None) -> ResponseObject:
        """The response object: in progress (``done`` None), or finished with its usage."""
        fields = msgspec.structs.asdict(self.settings)
        if done is None:
            return ResponseObject(id=self.id, created_at=self.created_at, status="in_progress",
                                  output=list(self._items), **fields)
        length = done.finish_reason == "length"
        return ResponseObject(
            id=self.id, created_at=self.created_at, status="incomplete" if length else "completed",
            completed_at=int(time.time()), output=list(self._items), usage=self._usage(done),
            incomplete_details=IncompleteDetails("max_output_tokens") if length else None, **fields,
        )

    def _usage(self, done: Done) -> ResponseUsage:
        generated = sum(self._chars.values())
        reasoning = round(done.num_completion_tokens * self._chars[REASONING] / generated) if generated else 0
        return ResponseUsage(
            input_tokens=done.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=done.num_cached_tokens),
            output_tokens=done.num_completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=done.num_prompt_tokens + done.num_completion_tokens,
        )

    # ---- items ----

    def _text(self, kind: str, text: str) -> list[Frame]:
        self._chars[kind] += len(text)
        frames: list[Frame] = []
        item = self._open
        if item is None or item.kind != kind:
            lead = (self._lead[1] if self._lead[0] == kind else "") + text
            if not lead.strip():
                self._lead = (kind, lead)
                return []
            text = lead.lstrip("\r\n")
            frames = self._close("completed")
            item = self._start(kind, frames)
        body = text.rstrip()
        if not body:
            item.pending += text
            return frames
        delta, item.pending = item.pending + body, text[len(body):]
        item.parts.append(delta)
        if kind == MESSAGE:
            frames.append(self._frame(TextDeltaEvent, item, content_index=0, delta=delta))
        else:
            frames.append(self._frame(SummaryDeltaEvent, item, summary_index=0, delta=delta))
        return frames

    def _call(self, delta: ToolCallDelta) -> list[Frame]:
        self._chars[CALL] += len(delta.arguments)
        frames: list[Frame] = []
        item = self._open
        if delta.id is not None:
            frames = self._close("completed")
            item = self._start(CALL, frames, call_id=delta.id, name=delta.name or "", call_index=delta.index)
        if item is None or item.kind != CALL or item.call_index != delta.index or not delta.arguments:
            return frames
        item.parts.append(delta.arguments)
        frames.append(self._frame(ArgumentsDeltaEvent, item, delta=delta.arguments))
        return frames

    def _start(self, kind: str, frames: list[Frame], **call: Any) -> _Item:
        item = self._open = _Item(kind, PREFIXES[kind] + uuid.uuid4().hex, len(self._items), **call)
        self._lead = ("", "")
        frames.append(self._item_event("response.output_item.added", item, self._snapshot(item, "in_progress")))
        if kind == MESSAGE:
            frames.append(self._frame(ContentPartEvent, item, "response.content_part.added", content_index=0,
                                      part=OutputText("")))
        elif kind == REASONING:
            frames.append(self._frame(SummaryPartEvent, item, "response.reasoning_summary_part.added",
                                      summary_index=0, part=SummaryText("")))
        return item

    def _close(self, status: str) -> list[Frame]:
        """The open item's closing events (none open: none); ``status`` is the item's."""
        item, self._open = self._open, None
        if item is None:
            return []
        frames = list(self._closing_events(item))
        final = self._snapshot(item, status)
        self._items.append(final)
        frames.append(self._item_event("response.output_item.done", item, final))
        return frames

    def _closing_events(self, item: _Item) -> Iterable[Frame]:
        text = item.text
        if item.kind == MESSAGE:
            yield self._frame(TextDoneEvent, item, content_index=0, text=text)
            yield self._frame(ContentPartEvent, item, "response.content_part.done", content_index=0,
                              part=OutputText(text))
        elif item.kind == REASONING:
            yield self._frame(SummaryDoneEvent, item, summary_index=0, text=text)
            yield self._frame(SummaryPartEvent, item, "response.reasoning_summary_part.done", summary_index=0,
                              part=SummaryText(text))
        else:
            if not text:  # a call with no arguments still sends a JSON object
                item.parts.append("{}")
                yield self._frame(ArgumentsDeltaEvent, item, delta="{}")
            yield self._frame(ArgumentsDoneEvent, item, name=item.name, arguments=item.text)

    def _snapshot(self, item: _Item, status: str) -> OutputItem:
        done = status != "in_progress"
        if item.kind == MESSAGE:
            return MessageItem(id=item.id, status=status, content=[OutputText(item.text)] if done else [])
        if item.kind == REASONING:
            return ReasoningItem(id=item.id, status=status, summary=[SummaryText(item.text)] if done else [])
        return FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text,
                                status=status)

    # ---- frames ----

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence - 1

    def _lifecycle(self, type_: str, response: ResponseObject) -> Frame:
        return type_, LifecycleEvent(type=type_, sequence_number=self._next(), response=response)

    def _item_event(self, type_: str, item: _Item, snapshot: OutputItem) -> Frame:
        return type_, ItemEvent(type=type_, sequence_number=self._next(), output_index=item.output_index,
                                item=snapshot)

    def _frame(self, cls: type, item: _Item, type_: str | None = None, **fields: Any) -> Frame:
        type_ = type_ or _EVENT_TYPES[cls]
        return type_, cls(type=type_, sequence_number=self._next(), item_id=item.id,
                          output_index=item.output_index, **fields)


_EVENT_TYPES = {
    TextDeltaEvent: "response.output_text.delta",
    TextDoneEvent: "response.output_text.done",
    SummaryDeltaEvent: "response.reasoning_summary_text.delta",
    SummaryDoneEvent: "response.reasoning_summary_text.done",
    ArgumentsDeltaEvent: "response.function_call_arguments.delta",
    ArgumentsDoneEvent: "response.function_call_arguments.done",
}


def replay(renderer: ResponsesRenderer, events: Iterable[tuple[int, Any]]) -> ResponseObject:
    """The response object for a non-streamed response: its recorded events through ``renderer`` (the frames are
    not sent), so that it equals the streamed one. The events end with their ``Done``."""
    done = None
    for index, event in events:
        if isinstance(event, Done):
            done = event
            renderer.closing(index, event)
        else:
            renderer.render(index, event)
    if done is None:
        raise MlxdError("the response ended without a final event")
    return renderer.response(done)
