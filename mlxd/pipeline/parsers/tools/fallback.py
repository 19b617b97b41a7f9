"""A second chance for calls written in another known format: the content the configured parser leaves goes
through the generic parser (``<tool_call>{json}</tool_call>``, a json fence, or a bare ``{"name": ..., "arguments":
...}``) as long as the configured parser has found no call of its own."""

from __future__ import annotations

from typing import Any

from mlxd.log import get_logger
from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.parsers.base import ToolParser
from mlxd.pipeline.parsers.tools.generic import CLOSE_TAG, GenericToolParser
from mlxd.pipeline.parsers.tools.json_call import NeedMore, NotCanonical, read_call_head

Event = ContentDelta | ToolCallDelta | ReasoningDelta
log = get_logger("mlxd.pipeline")


class _RecoveredCalls(GenericToolParser):
    """The generic parser, held to complete calls: a call is announced once its object is whole (a cut-off one
    stays text), and an object with a name but no arguments is text.

    Only an object that begins as a call (``{"name": "...", "arguments": {``) is held until it ends, so ordinary
    JSON in the content streams on at once; between ``<tool_call>`` tags the keys may come in any order.
    """

    require_arguments = True

    def _json_call(self, final: bool) -> bool:
        try:
            read_call_head(self._buf, self._pos, self.args_keys)
        except NeedMore:
            return False
        except NotCanonical:
            if self._closer == CLOSE_TAG:
                return self._read_whole()
            return self._reject(None if self._closer else 1)
        return self._read_whole()


class FallbackToolParser(ToolParser):
    """The configured parser (``primary``), with :class:`GenericToolParser` over the content it passes on.

    While ``primary`` has found no call, its content is read by the fallback, which turns a complete call to one of
    the request's tools into a call (logged as ``tool_call_fallback``, with both parsers' names) and passes every
    other text on as content, unchanged. Once ``primary`` finds a call, the fallback gives back what it holds and
    retires: the model writes the configured format, and the rest is the configured parser's alone. Calls are
    numbered in the order they start, whichever parser read them. Without tools there is nothing to recover, so
    nothing changes: every call of either kind is content.
    """

    name = "fallback"

    def __init__(self, primary: ToolParser, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.primary = primary
        self.fallback: ToolParser | None = _RecoveredCalls(tools)
        self._indexes: dict[tuple[int, int], int] = {}  # (which parser, its index) -> the response's index

    def feed(self, text: str) -> list[Event]:
        return self.route(self.primary.feed(text))

    def finish(self) -> list[Event]:
        out = self.route(self.primary.finish())
        if self.fallback is not None:
            out += self._number(1, self.fallback.finish())
        return out

    def route(self, events: list[Event]) -> list[Event]:
        """``primary``'s events, with the content it passed on read by the fallback while it has found no call
        (for a caller that feeds ``primary`` itself; :meth:`feed` is ``route(primary.feed(text))``)."""
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallDelta):
                if self.fallback is not None:  # retire the fallback: what it holds comes first
                    out += self._number(1, self.fallback.finish())
                    self.fallback = None
                out += self._number(0, [event])
            elif isinstance(event, ContentDelta) and self.fallback is not None:
                out += self._number(1, self.fallback.feed(event.text))
            else:
                out.append(event)
        return out

    def _number(self, source: int, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if not isinstance(event, ToolCallDelta):
                out.append(event)
                continue
            key = (source, event.index)
            if key not in self._indexes:
                self._indexes[key] = self.num_calls
                self.num_calls += 1
                if source:
                    log.info("tool_call_fallback", parser=self.primary.name, fallback=GenericToolParser.name,
                             tool=event.name)
            out.append(ToolCallDelta(index=self._indexes[key], id=event.id, name=event.name,
                                     arguments=event.arguments))
        return out
