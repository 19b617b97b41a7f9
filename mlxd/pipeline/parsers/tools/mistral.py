"""Mistral tool calls: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` and the newer
``[TOOL_CALLS]f[ARGS]{...}`` (Mistral Small 3.2, Magistral, Devstral, Ministral 3), ``[CALL_ID]id`` allowed before
``[ARGS]``."""

from __future__ import annotations

import re
from typing import Any

from mlxd.pipeline.parsers.tools.json_call import JsonCallParser
from mlxd.pipeline.parsers.tools.streaming import State, skip_ws

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]*")
_MAX_HEADER = 256  # characters of a name (and call id) before ``[ARGS]`` is given up on


class MistralToolParser(JsonCallParser):
    """Both forms stream their arguments. The region has no closing marker: it ends with its last call.

    At the end of the stream: a call whose arguments are complete is a call; one that never got to its arguments'
    ``{`` (or, in the list form, past ``"arguments":``) is content, ``[TOOL_CALLS]`` included.
    """

    name = "mistral"
    special_markers = (TOOL_CALLS, ARGS, CALL_ID)
    openers = (TOOL_CALLS,)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._after_call = self._list_next

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template

    def _start_region(self, opener: str) -> State:
        return self._form

    def _form(self, final: bool) -> bool:
        pos = skip_ws(self._buf, self._pos)
        if pos == len(self._buf):
            return False
        if self._buf[pos] == "[":
            self._pos = pos + 1
            return self._goto(self._list_item)
        self._pos = pos
        return self._goto(self._named)

    def _named(self, final: bool) -> bool:
        header = self._header()
        if header is None:
            return False
        if not header or header[0] not in self.tools:
            return self._reject()
        self._announce(header[0])
        return self._stream_args(header[1], then=self._between)

    def _header(self) -> tuple[str, int] | None | bool:
        """``name[ARGS]`` (or ``name[CALL_ID]id[ARGS]``, or ``name{``) at ``self._pos``: the name and the index of the
        arguments' ``{``; None while more text is needed; False when it is not that."""
        buf, start = self._buf, self._pos
        end = _NAME.match(buf, start).end()  # type: ignore[union-attr]
        rest = buf[end:end + len(CALL_ID)]
        if buf.startswith(ARGS, end):
            at = end + len(ARGS)
        elif buf.startswith(CALL_ID, end):
            at = buf.find(ARGS, end)
            if at < 0:
                return None if len(buf) - start < _MAX_HEADER else False
            at += len(ARGS)
        elif buf.startswith("{", end):
            at = end
        elif len(buf) - start < _MAX_HEADER and (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
            return None
        else:
            return False
        at = skip_ws(buf, at)
        if at == len(buf):
            return None
        return (buf[start:end], at) if end > start and buf[at] == "{" else False

    def _list_item(self, final: bool) -> bool:
        pos = skip_ws(self._buf, self._pos)
        if pos == len(self._buf):
            return False
        if self._buf[pos] == "{":
            self._pos = pos
            return self._goto(self._json_call)
        return self._reject()

    def _list_next(self, final: bool) -> bool:
        """After a call of the list form: ``,`` and the next call, or ``]`` and the end of the region."""
        pos = skip_ws(self._buf, 0)
        if pos == len(self._buf):
            return False
        char = self._buf[pos]
        self._consume(pos + 1 if char in ",]" else pos)
        if char == ",":
            self._raw = True
            return self._goto(self._list_item)
        return self._goto(self._between)
