"""A fallback for models of no known family: JSON call objects ``{"name": ..., "arguments"|"parameters": {...}}``
anywhere in the text, bare, between ``<tool_call>`` tags or in a json code fence."""

from __future__ import annotations

import re

from mlxd.pipeline.parsers.tools.json_call import JsonCallParser
from mlxd.pipeline.parsers.tools.streaming import State, skip_ws

FENCE, CLOSE_FENCE = "```json", "```"
TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# A template that does something with the request's tools (a Jinja tag naming them).
_USES_TOOLS = re.compile(r"{[{%][^}]*\btools\b")


class GenericToolParser(JsonCallParser):
    """Finds call objects in free text. A ``{`` followed by anything but a key's ``"`` is content at once; an object
    that is not a call to a known tool goes out as content once it is complete (or, in a fence or tags, with them).

    At the end of the stream: a complete call object is a call even without its closing tag or fence; an
    incomplete one is content.
    """

    name = "generic"
    openers = (TAG, FENCE, "{")
    closers = {TAG: CLOSE_TAG, FENCE: CLOSE_FENCE}

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Any template that renders the request's tools, in a format no other parser knows."""
        return bool(_USES_TOOLS.search(chat_template))

    def _start_region(self, opener: str) -> State:
        if opener != "{":
            return self._json_call
        self._pos = 0
        return self._brace

    def _brace(self, final: bool) -> bool:
        pos = skip_ws(self._buf, 1)
        if pos == len(self._buf):
            return False
        if self._buf[pos] != '"':
            return self._reject(1)
        return self._goto(self._json_call)
