"""What a response is made of, whatever the surface: SSE frames, the :class:`Renderer` protocol each surface
implements, and :class:`Output`, a whole response gathered from its typed events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from litestar.response import Stream

from mlxd.errors import MlxdError
from mlxd.pipeline.events import (
    ContentDelta,
    Done,
    ReasoningDelta,
    TokenLogprob,
    TokenLogprobs,
    ToolCallDelta,
)

ENCODER = msgspec.json.Encoder()
SSE_KEEPALIVE = b": keep-alive\n\n"

# An SSE frame to write: its event name (None: a plain `data:` frame) and its payload.
Frame = tuple[str | None, msgspec.Struct]


def sse(payload: msgspec.Struct, event: str | None = None) -> bytes:
    data = b"data: " + ENCODER.encode(payload) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


def encode_frames(frames: list[Frame]) -> bytes:
    """``frames`` as the bytes to write: one write for all the frames one event makes."""
    if len(frames) == 1:
        return sse(frames[0][1], frames[0][0])
    return b"".join([sse(payload, name) for name, payload in frames])


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Stream):
    """An SSE response. Litestar lets a handler's inferred media type (JSON here) override the response's
    own, so this one insists on ``text/event-stream``."""

    def __init__(self, frames: AsyncIterator[bytes]) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        self.frames = frames  # for a stream that sends them after frames of its own (mlxd.api.loading)

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


class Renderer(Protocol):
    """How one API surface writes a response stream. Events come with their choice's index (``n`` > 1 interleaves
    choices): frames for the opening, each event, each choice's end, the whole response's end (with the usage
    of all choices) and a failure."""

    # Written after the last frame (OpenAI's `data: [DONE]`), or None.
    terminator: bytes | None
    # Written while nothing else is (queued, prefilling): an SSE comment, or a surface's own event (a `ping`).
    keepalive: bytes

    def opening(self) -> list[Frame]: ...

    def render(self, index: int, event: ContentDelta | ReasoningDelta | ToolCallDelta | TokenLogprobs) -> list[Frame]:
        ...

    def closing(self, index: int, done: Done) -> list[Frame]: ...

    def final(self, done: Done) -> list[Frame]: ...

    def error(self, error: MlxdError) -> list[Frame]: ...


def total(dones: list[Done]) -> Done:
    """One final event for a response of several choices: their token counts added up; the first choice's reason.
    The prompt is counted once (the choices share it)."""
    first = dones[0]
    if len(dones) == 1:
        return first
    return msgspec.structs.replace(first, num_completion_tokens=sum(d.num_completion_tokens for d in dones))


@dataclass(slots=True)
class CallParts:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Output:
    """A whole response, gathered from its events (for non-streaming responses)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, CallParts] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: Done | None = None

    def add(self, event: Any) -> bool:
        """Take one event; return whether it was output (text, reasoning, a call or logprobs)."""
        if isinstance(event, ContentDelta):
            self.content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ToolCallDelta):
            call = self.calls.get(event.index)
            if call is None:
                call = self.calls[event.index] = CallParts(event.id or "", event.name or "")
            call.arguments.append(event.arguments)
        elif isinstance(event, TokenLogprobs):
            self.logprobs.extend(event.entries)
        else:
            return False
        return True

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) if self.reasoning else None

    def tool_calls(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments as JSON text) of each call, in order."""
        return [(c.id, c.name, "".join(c.arguments)) for _, c in sorted(self.calls.items())]
