"""GLM-4.5 / 4.6 / 4.7 tool calls: ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``
(4.7 writes no newlines), values typed by the tool's schema."""

from __future__ import annotations

import re
from typing import Any

from mlxd.pipeline.parsers.tools.streaming import State, StreamingToolParser, skip_ws
from mlxd.pipeline.parsers.tools.typed_args import TypedArguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, VALUE, END_VALUE = "<arg_key>", "<arg_value>", "</arg_value>"
_NAME_END = re.compile(r"[\n<]")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_MAX_NAME = 256


class Glm45ToolParser(StreamingToolParser):
    """The call is announced when its name ends (at a newline or ``<``); each argument goes out when its
    ``</arg_value>`` arrives, and the object closes at ``</tool_call>``.

    At the end of the stream: a call is closed with the arguments it has, unless the stream ended inside an
    argument (its arguments then stay unterminated); a call with no complete name yet is content.
    """

    name = "glm45"
    special_markers = (OPEN, CLOSE, KEY, "</arg_key>", VALUE, END_VALUE)
    openers = (OPEN,)
    closers = {OPEN: CLOSE}

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._args: TypedArguments | None = None
        self._in_pair = False
        self._searched = 0  # how much of the buffer has been searched for </arg_value>

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return KEY in chat_template and OPEN in chat_template

    def _start_region(self, opener: str) -> State:
        return self._name

    def _name(self, final: bool) -> bool:
        start = skip_ws(self._buf, self._pos)
        end = _NAME_END.search(self._buf, start)
        if end is None:
            return len(self._buf) - start >= _MAX_NAME and self._reject()
        name = self._buf[start:end.start()].strip()
        if name not in self.tools:
            return self._reject()
        self._announce(name)
        self._args = TypedArguments(self.tools[name])
        self._consume(end.start())
        self._searched = 0
        return self._goto(self._pairs)

    def _pairs(self, final: bool) -> bool:
        assert self._args is not None
        ended = self._buf.find(END_VALUE, max(0, self._searched - len(END_VALUE))) >= 0
        self._searched = len(self._buf)
        m = _PAIR.match(self._buf) if ended else None
        if m:
            self._arguments(self._args.add(m.group(1).strip(), m.group(2)))
            self._consume(m.end())
            self._searched = 0
            return True
        pos = skip_ws(self._buf, 0)
        rest = self._buf[pos:]
        self._in_pair = rest.startswith(KEY)
        if rest.startswith(CLOSE):
            self._arguments(self._args.close())
            return self._goto(self._closing)
        if self._in_pair or KEY.startswith(rest) or CLOSE.startswith(rest):
            return False
        # Stray text inside the call is dropped, up to the next tag.
        skip = self._buf.find("<", pos + 1)
        self._consume(len(self._buf) if skip < 0 else skip)
        self._searched = 0
        return skip >= 0

    def _end_of_stream(self) -> None:
        if self._args is not None and not self._in_pair:
            self._arguments(self._args.close())
