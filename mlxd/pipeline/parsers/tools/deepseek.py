"""DeepSeek-V3 / R1 and V3.1 tool calls.

V3 / R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
then ``\\n`` and more calls, then ``<｜tool▁calls▁end｜>``. V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.
The bars and the small blocks are the full-width ``｜`` (U+FF5C) and ``▁`` (U+2581).
"""

from __future__ import annotations

from mlxd.pipeline.parsers.tools.json_call import JsonCallParser
from mlxd.pipeline.parsers.tools.streaming import State, skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"
_MAX_HEADER = 256  # characters before the arguments' ``{`` that a call may take


class DeepSeekToolParser(JsonCallParser):
    """Each ``<｜tool▁call▁begin｜>`` … ``<｜tool▁call▁end｜>`` is a call; the ``tool▁calls`` begin and end markers around
    them are dropped. The arguments stream as they arrive.

    At the end of the stream: a call whose arguments are complete is a call without its end markers; one that never
    got to its arguments' ``{`` is content, from ``<｜tool▁call▁begin｜>`` on.
    """

    name = "deepseek"
    special_markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)
    openers = (CALL_BEGIN,)
    closers = {CALL_BEGIN: CALL_END}
    wrappers = (CALLS_BEGIN, CALLS_END)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "tool▁calls▁begin" in chat_template or "tool▁call▁begin" in chat_template

    def _start_region(self, opener: str) -> State:
        return self._header

    def _header(self, final: bool) -> bool:
        header = self._read_header()
        if header is None and len(self._buf) - self._pos < _MAX_HEADER and CALL_END not in self._buf:
            return False
        if not header or header[0] not in self.tools:
            return self._reject()
        self._announce(header[0])
        return self._stream_args(header[1], then=self._fence)

    def _read_header(self) -> tuple[str, int] | None | bool:
        """The call's name and the index of its arguments' ``{``; None while more text is needed, False if malformed."""
        buf = self._buf
        sep = buf.find(SEP, self._pos)
        if sep < 0:
            return None
        kind, pos = buf[self._pos:sep].strip(), sep + len(SEP)
        brace = skip_ws(buf, pos)
        if brace == len(buf):
            return None
        if buf[brace] == "{":  # V3.1: the name, then the arguments
            return kind, brace
        if kind != "function":
            return False
        newline, brace = buf.find("\n", pos), buf.find("{", pos)  # V3: the name's line, a json fence
        if newline < 0 or brace < 0:
            return None
        fence = buf[newline:brace].strip()
        return (buf[pos:newline].strip(), brace) if newline < brace and fence in ("```json", "```", "") else False

    def _fence(self, final: bool) -> bool:
        """After V3's arguments: the fence's closing backticks are dropped."""
        pos = skip_ws(self._buf, 0)
        rest = self._buf[pos:]
        if rest.startswith(FENCE):
            self._consume(pos + len(FENCE))
        elif FENCE.startswith(rest) and not final:
            return False
        return self._goto(self._closing)
