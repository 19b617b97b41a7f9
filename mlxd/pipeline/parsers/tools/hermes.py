"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several in
a row for parallel calls."""

from __future__ import annotations

from mlxd.pipeline.parsers.tools.json_call import JsonCallParser
from mlxd.pipeline.parsers.tools.streaming import State

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(JsonCallParser):
    """Calls as JSON objects between ``<tool_call>`` and ``</tool_call>``; the arguments stream as they arrive.

    At the end of the stream: a call whose object is complete is a call even without ``</tool_call>``; one that
    never got as far as its name (and ``"arguments":``) is content, ``<tool_call>`` included.
    """

    name = "hermes"
    special_markers = (OPEN, CLOSE)
    openers = (OPEN,)
    closers = {OPEN: CLOSE}

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template

    def _start_region(self, opener: str) -> State:
        return self._json_call
