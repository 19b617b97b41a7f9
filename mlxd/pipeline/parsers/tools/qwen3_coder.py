"""Qwen3-Coder (and Nemotron) tool calls, in XML: ``<tool_call>\\n<function=NAME>\\n<parameter=p>\\nvalue\\n</parameter>
\\n</function>\\n</tool_call>``, values typed by the tool's schema."""

from __future__ import annotations

from typing import Any

from mlxd.pipeline.parsers.tools.streaming import State, StreamingToolParser, find_first, skip_ws
from mlxd.pipeline.parsers.tools.typed_args import TypedArguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
_MAX_NAME = 256


class Qwen3CoderToolParser(StreamingToolParser):
    """The call is announced at ``<function=NAME>``; each parameter goes out when its ``</parameter>`` arrives
    (a missing one is forgiven at ``</function>``), and the object closes at ``</function>``.

    At the end of the stream: a call is closed with the parameters it has, unless the stream ended inside a
    parameter's value (its arguments then stay unterminated); a call with no complete ``<function=NAME>`` is content.

    A format that wraps the same body in other markers (Seed-OSS) subclasses this with its own ``openers`` and
    ``closers``.
    """

    name = "qwen3_coder"
    special_markers = (OPEN, CLOSE)
    openers = (OPEN,)
    closers = {OPEN: CLOSE}

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._args: TypedArguments | None = None
        self._parameter = ""
        self._searched = 0  # how much of a value has been searched for its end
        self._value_ends = (END_PARAMETER, END_FUNCTION, *self.closers.values())
        self._longest_end = max(map(len, self._value_ends))

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return FUNCTION in chat_template and PARAMETER in chat_template

    def _start_region(self, opener: str) -> State:
        return self._function

    def _tag(self, prefix: str, pos: int) -> tuple[str, int] | None | bool:
        """``<prefix NAME>`` at ``pos`` (after whitespace): the name and the index past ``>``; None while more text
        is needed; False when it is not there."""
        buf = self._buf
        pos = skip_ws(buf, pos)
        if not buf.startswith(prefix, pos):
            return None if prefix.startswith(buf[pos:]) else False
        end = buf.find(">", pos)
        if end < 0:
            return None if len(buf) - pos < _MAX_NAME else False
        return buf[pos + len(prefix):end].strip(), end + 1

    def _function(self, final: bool) -> bool:
        tag = self._tag(FUNCTION, self._pos)
        if tag is None:
            return False
        if not tag or tag[0] not in self.tools:
            return self._reject()
        self._announce(tag[0])
        self._args = TypedArguments(self.tools[tag[0]])
        self._consume(tag[1])
        return self._goto(self._parameters)

    def _parameters(self, final: bool) -> bool:
        assert self._args is not None
        tag = self._tag(PARAMETER, 0)
        if tag:
            self._parameter, self._searched = tag[0], 0
            self._consume(tag[1])
            return self._goto(self._value)
        pos = skip_ws(self._buf, 0)
        rest = self._buf[pos:]
        if rest.startswith((END_FUNCTION, self._closer)):
            self._arguments(self._args.close())
            self._consume(pos + (len(END_FUNCTION) if rest.startswith(END_FUNCTION) else 0))
            return self._goto(self._closing)
        if tag is None or END_FUNCTION.startswith(rest) or self._closer.startswith(rest):
            return False
        # Stray text inside the call is dropped, up to the next tag.
        skip = self._buf.find("<", pos + 1)
        self._consume(len(self._buf) if skip < 0 else skip)
        return skip >= 0

    def _value(self, final: bool) -> bool:
        assert self._args is not None
        at, end = find_first(self._buf, self._value_ends, max(0, self._searched - self._longest_end))
        if end is None:
            self._searched = len(self._buf)
            return False
        self._arguments(self._args.add(self._parameter, self._buf[:at]))
        self._consume(at + (len(end) if end == END_PARAMETER else 0))
        return self._goto(self._parameters)

    def _end_of_stream(self) -> None:
        if self._args is not None and self._state != self._value:
            self._arguments(self._args.close())
