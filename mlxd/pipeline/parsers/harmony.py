"""OpenAI's Harmony response format (gpt-oss): messages on channels, tool calls addressed to ``functions.NAME``.

The model writes a sequence of messages, each a header and a body::

    <|channel|>analysis<|message|>…reasoning…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>

The header (everything before ``<|message|>``) names the channel and, for a tool call, the recipient, which may
also stand before the channel (``<|start|>assistant to=functions.x<|channel|>commentary json<|message|>``). The
usual generation prompt ends with ``<|start|>assistant``, so output starts with ``<|channel|>`` (or `` to=``).

:class:`HarmonyScanner` cuts the text into messages; :class:`HarmonyParser` (tool calls and reasoning) and
:class:`HarmonyReasoningParser` (reasoning only) route each message's body by its header.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.parsers.base import ReasoningParser, ToolParser, new_call_id

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_CLOSERS = (END, RETURN, CALL)
_MAX_MARKER = max(map(len, MARKERS))
# A header starts with one of these; at the start of the output also with " to=" (after "<|start|>assistant"),
# or "to=" where the detokenizer drops the first token's leading space.
_HEADER_STARTS = (START, CHANNEL)
_FIRST_HEADER_STARTS = (START, CHANNEL, " to=", "to=")

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT_RE = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


class Header(NamedTuple):
    channel: str | None
    recipient: str | None


class Open(NamedTuple):
    """A message begins; its body follows."""

    header: Header


class Text(NamedTuple):
    text: str


class Close(NamedTuple):
    """The message ends: at an end marker or a new header, or at the end of the stream."""


def parse_header(text: str) -> Header:
    """The channel and recipient named in a message header (the text before ``<|message|>``)."""
    channel = _CHANNEL_RE.search(text)
    recipient = _RECIPIENT_RE.search(text)
    return Header(channel and channel.group(1), recipient and recipient.group(1))


class HarmonyScanner:
    """Cuts streamed Harmony text into :class:`Open`, :class:`Text` and :class:`Close` items.

    Markers never appear in a :class:`Text`. Body text is released at once except a trailing ``<`` or a partial
    marker; header text is held until ``<|message|>``. Text at a message boundary that cannot begin a header
    (a model that writes no Harmony framing) is an unframed message: ``Header(None, None)``.
    ``channel``: the prompt already opened a message on this channel, so the output starts in its body.
    """

    def __init__(self, channel: str | None = None) -> None:
        self._buffer = ""
        self._items: list[Open | Text | Close] = []
        self._in_body = channel is not None
        self._at_boundary = channel is None  # framed (a header follows) or unframed text: not yet known
        self._header_starts = _FIRST_HEADER_STARTS if channel is None else _HEADER_STARTS
        if channel is not None:
            self._items.append(Open(Header(channel, None)))

    def feed(self, text: str) -> list[Open | Text | Close]:
        self._buffer += text
        while self._buffer and (self._body_step() if self._in_body else self._header_step()):
            pass
        items, self._items = self._items, []
        return items

    def finish(self) -> list[Open | Text | Close]:
        """The rest: an open body's text (a partial marker in it is text), then its :class:`Close`. An
        unfinished header is markup and is dropped, unless it may still have been unframed text."""
        if not self._in_body and self._at_boundary and self._buffer:
            self._items.append(Open(Header(None, None)))
            self._in_body = True
        if self._in_body:
            self._text(self._buffer)
            self._items.append(Close())
        self._buffer, self._in_body = "", False
        items, self._items = self._items, []
        return items

    def _text(self, text: str) -> None:
        if text:
            self._items.append(Text(text))

    def _header_step(self) -> bool:
        """Consume a header if ``<|message|>`` has arrived; False when more text is needed."""
        buffer = self._buffer
        if self._at_boundary:
            if not buffer.startswith(self._header_starts):
                if any(start.startswith(buffer) for start in self._header_starts):
                    return False
                self._items.append(Open(Header(None, None)))
                self._in_body = True
            self._at_boundary = False
            self._header_starts = _HEADER_STARTS
            return True
        end = buffer.find(MESSAGE)
        if end < 0:
            return False
        self._items.append(Open(parse_header(buffer[:end])))
        self._buffer = buffer[end + len(MESSAGE) :]
        self._in_body = True
        return True

    def _body_step(self) -> bool:
        """Release body text up to the next marker and act on it; False when more text is needed."""
        buffer = self._buffer
        at, marker = _find_marker(buffer)
        if at < 0:  # no marker: all of it is text, but a trailing "<" may begin one
            keep = 1 if buffer.endswith("<") else 0
            self._text(buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
            return False
        self._text(buffer[:at])
        if marker is None:  # a partial marker at the end
            self._buffer = buffer[at:]
            return False
        self._buffer = buffer[at + len(marker) :]
        if marker in _CLOSERS:
            self._items.append(Close())
            self._in_body, self._at_boundary = False, True
        elif marker in _HEADER_STARTS:  # a new message without an end marker before it
            self._items.append(Close())
            self._in_body, self._buffer = False, buffer[at:]
        # a stray <|message|> or <|constrain|> in a body is dropped
        return True


def _find_marker(text: str) -> tuple[int, str | None]:
    """The first marker in ``text`` and where it is; ``(at, None)`` for a partial marker ending the text;
    ``(-1, None)`` for neither."""
    at = text.find("<|")
    while at >= 0:
        for marker in MARKERS:
            if text.startswith(marker, at):
                return at, marker
        if len(text) - at < _MAX_MARKER and any(m.startswith(text[at:]) for m in MARKERS):
            return at, None
        at = text.find("<|", at + 2)
    return -1, None


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class _HarmonyRouter:
    """Turns scanned messages into events. ``_route`` says where a body goes: ``"reasoning"``, ``"content"``,
    ``"call"`` (held until the message ends, then a call if it is a JSON object, else content) or ``"drop"``."""

    _scanner: HarmonyScanner

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Templates that write Harmony messages (``<|channel|>`` and ``<|message|>``)."""
        return CHANNEL in chat_template and MESSAGE in chat_template

    def _start(self, channel: str | None = None) -> None:
        self._scanner = HarmonyScanner(channel)
        self._route = "content"
        self._call_name: str | None = None
        self._call_text: list[str] = []

    def _events(self, items: list[Open | Text | Close]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if isinstance(item, Open):
                self._route, self._call_name = self._classify(item.header)
            elif isinstance(item, Text):
                self._on_text(item.text, out)
            elif self._route == "call":
                self._end_call(out)
        return out

    def _on_text(self, text: str, out: list[Any]) -> None:
        if self._route == "reasoning":
            out.append(ReasoningDelta(text))
        elif self._route == "content":
            out.append(ContentDelta(text))
        elif self._route == "call":
            self._call_text.append(text)

    def _end_call(self, out: list[Any]) -> None:
        body, self._call_text = "".join(self._call_text), []
        if self._call_name is not None and _is_json_object(body):
            self._emit_call(self._call_name, body.strip(), out)
        elif body:
            out.append(ContentDelta(body))

    def _classify(self, header: Header) -> tuple[str, str | None]:
        recipient = header.recipient
        if recipient and recipient != "assistant":
            name = recipient[len("functions.") :] if recipient.startswith("functions.") else None
            return self._route_call(name)
        return ("reasoning" if header.channel == "analysis" else "content"), None

    def _route_call(self, name: str | None) -> tuple[str, str | None]:
        raise NotImplementedError

    def _emit_call(self, name: str, arguments: str, out: list[Any]) -> None:
        raise NotImplementedError


class HarmonyParser(_HarmonyRouter, ToolParser):
    """Tool calls and reasoning in the Harmony format (gpt-oss).

    ``analysis`` → :class:`ReasoningDelta`; ``final``, and ``commentary`` with no recipient (a preamble) →
    :class:`ContentDelta`; a message addressed ``to=functions.NAME`` with NAME among the request's tools → one
    call. A call's body is held until its message ends (``<|call|>``, another marker or the end of the stream),
    then goes out as the first delta (id, name) and one argument delta, if it is a JSON object; otherwise, and
    for a name not among the tools (or a built-in tool such as ``python``), its body goes out as content.
    A call is held rather than streamed because one that turns out not to be JSON must go out as content, which a
    streamed call could not take back; ``<|call|>`` ends generation, so little waiting is lost.
    """

    name = "harmony"
    special_markers = MARKERS

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._start()

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta | ReasoningDelta]:
        return self._events(self._scanner.feed(text))

    def finish(self) -> list[ContentDelta | ToolCallDelta | ReasoningDelta]:
        return self._events(self._scanner.finish())

    def _route_call(self, name: str | None) -> tuple[str, str | None]:
        return ("call", name) if name in self.tools else ("content", None)

    def _emit_call(self, name: str, arguments: str, out: list[Any]) -> None:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        out.append(ToolCallDelta(index=index, id=new_call_id(), name=name))
        out.append(ToolCallDelta(index=index, arguments=arguments))


class HarmonyReasoningParser(_HarmonyRouter, ReasoningParser):
    """Reasoning only, in the Harmony format: ``analysis`` → reasoning, ``final`` and preambles → content; a
    message addressed to a tool is dropped whole (for requests without tools; :class:`HarmonyParser` does both).

    ``in_reasoning``: the prompt ended inside an ``analysis`` message (see :meth:`opens_in_prompt`)."""

    name = "harmony"
    special_markers = MARKERS

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__(in_reasoning)
        self._start("analysis" if in_reasoning else None)

    @classmethod
    def opens_in_prompt(cls, prompt_text: str) -> bool:
        """True when the prompt ends with an open ``analysis`` message (the usual ``<|start|>assistant`` does not)."""
        return prompt_text.rstrip().endswith(CHANNEL + "analysis" + MESSAGE)

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        return self._events(self._scanner.feed(text))

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        return self._events(self._scanner.finish())

    def _route_call(self, name: str | None) -> tuple[str, str | None]:
        return "drop", None
