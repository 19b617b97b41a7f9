"""Llama 3.1 / 3.2 JSON tool calls: the whole message is ``{"name": "f", "parameters": {...}}`` (maybe after
``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

from typing import Any

from mlxd.pipeline.parsers.tools.json_call import JsonCallParser
from mlxd.pipeline.parsers.tools.streaming import skip_ws

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(JsonCallParser):
    """A message is calls only when it starts (after whitespace) with ``{`` or ``<|python_tag|>``; any other
    message is content, passed through at once. Text after the calls that is not another call is content.

    At the end of the stream: a complete call object is a call; an incomplete one before its name (and
    ``"parameters":``) is content.
    """

    name = "llama3"
    special_markers = (PYTHON_TAG,)
    args_keys = ("parameters", "arguments")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = self._start
        self._after_call = self._next

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        headers = "<|start_header_id|>" in chat_template or "<|header_start|>" in chat_template
        return PYTHON_TAG in chat_template or (headers and '"parameters"' in chat_template)

    def _start(self, final: bool) -> bool:
        buf = self._buf
        pos = skip_ws(buf, 0)
        if buf.startswith(PYTHON_TAG, pos):
            self._pos, self._raw = pos + len(PYTHON_TAG), True
            return self._goto(self._json_call)
        if buf.startswith("{", pos):
            self._pos, self._raw = pos, True
            return self._goto(self._json_call)
        if not final and PYTHON_TAG.startswith(buf[pos:]):
            return False
        return self._goto(self._outside)

    def _next(self, final: bool) -> bool:
        """After a call: another one (after ``;`` or whitespace), else the rest is content."""
        pos = len(self._buf) - len(self._buf.lstrip(_SEPARATORS))
        if pos == len(self._buf):
            self._consume(pos)
            return False
        self._consume(pos)
        if self._buf.startswith("{"):
            self._raw = True
            return self._goto(self._json_call)
        return self._goto(self._outside)
