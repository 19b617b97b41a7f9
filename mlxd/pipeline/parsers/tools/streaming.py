"""What the tool-call parsers share: a buffer of text not yet sent, a state function that consumes it, and the rule
for what may be held back (only an ending that may be the beginning of a marker)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.parsers.base import ToolParser, new_call_id

Event = ContentDelta | ToolCallDelta | ReasoningDelta
# A state reads ``final`` (no more text will come) and returns whether it made progress.
State = Callable[[bool], bool]

_WS = re.compile(r"\s*")


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character of ``text`` at or after ``pos`` (``len(text)`` if none)."""
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest ending of ``text`` that is a proper beginning of one of ``markers`` (0: none)."""
    longest = max(map(len, markers), default=1) - 1
    start = max(0, len(text) - longest)
    # The common case, text with no marker's first character near its end, costs one search per marker.
    if not any(text.find(m[0], start) >= 0 for m in markers):
        return 0
    for i in range(start, len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - i
    return 0


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The index and text of the marker that occurs first in ``text`` at or after ``start``; ``(-1, None)`` if none."""
    best, found = -1, None
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, marker
    return best, found


class StreamingToolParser(ToolParser):
    """A :class:`ToolParser` run as a small state machine over a buffer.

    Subclasses name the markers that open a call region (``openers``), the marker that closes each region
    (``closers``; none: the region ends with its body), markup around regions that is dropped (``wrappers``), and
    write the states that read a region's body, starting with the one :meth:`_start_region` returns.

    States read ``self._buf`` from ``self._pos``. Until a region has announced a call (``self._raw``), they must not
    consume its text: a region that turns out not to be a call goes out as content exactly as it was generated.
    """

    openers: ClassVar[tuple[str, ...]] = ()
    closers: ClassVar[dict[str, str]] = {}
    wrappers: ClassVar[tuple[str, ...]] = ()
    _watched: ClassVar[tuple[str, ...]] = ()
    _firsts: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._watched = cls.openers + cls.wrappers
        cls._firsts = "".join(sorted({marker[0] for marker in cls._watched}))

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._pos = 0
        self._events: list[Event] = []
        self._state: State = self._outside
        self._closer = ""
        self._raw = False
        self._index = -1

    def feed(self, text: str) -> list[Event]:
        if not self.tools:
            return [ContentDelta(text)] if text else []
        if not self._buf and self._state == self._outside and not any(c in text for c in self._firsts):
            return [ContentDelta(text)] if text else []  # the common case: text that cannot start a marker
        self._buf += text
        while self._state(False):
            pass
        return self._take()

    def finish(self) -> list[Event]:
        if not self.tools:
            return []
        while self._state(True):
            pass
        if self._raw:
            self._content(self._buf)
        self._end_of_stream()
        self._buf, self._pos, self._raw = "", 0, False
        return self._take()

    # -- hooks for the formats

    def _start_region(self, opener: str) -> State:
        """The first state of a region just opened by ``opener`` (``self._pos`` is just past it)."""
        raise NotImplementedError

    def _end_of_stream(self) -> None:
        """Called by :meth:`finish` after the last state ran; a format may close what is still open."""

    # -- events

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ContentDelta):
            self._events[-1] = ContentDelta(last.text + text)
        else:
            self._events.append(ContentDelta(text))

    def _announce(self, name: str) -> None:
        """Send a call's first delta: from here on the region is a call, whatever follows."""
        self._index = self.num_calls
        self.num_calls += 1
        self._raw = False
        self._events.append(ToolCallDelta(index=self._index, id=new_call_id(), name=name))

    def _arguments(self, fragment: str) -> None:
        if not fragment:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.index == self._index:
            self._events[-1] = ToolCallDelta(index=last.index, id=last.id, name=last.name,
                                             arguments=last.arguments + fragment)
        else:
            self._events.append(ToolCallDelta(index=self._index, arguments=fragment))

    # -- buffer and state moves

    def _consume(self, count: int) -> None:
        self._buf = self._buf[count:]
        self._pos = 0

    def _goto(self, state: State) -> bool:
        self._state = state
        return True

    def _reject(self, upto: int | None = None) -> bool:
        """The region is not a call: its text goes out as content, the first ``upto`` characters of the buffer, or
        (``None``) everything up to and with the region's closing marker (to the end of the stream if it has none)."""
        self._raw, self._pos = False, 0
        if upto is None:
            return self._goto(self._rejected)
        self._content(self._buf[:upto])
        self._consume(upto)
        return self._goto(self._outside)

    # -- the states every format uses

    def _outside(self, final: bool) -> bool:
        at, marker = find_first(self._buf, self._watched)
        if marker is None:
            keep = 0 if final else partial_suffix(self._buf, self._watched)
            cut = len(self._buf) - keep
            self._content(self._buf[:cut])
            self._consume(cut)
            return False
        self._content(self._buf[:at])
        self._consume(at)
        if marker in self.wrappers:
            self._consume(len(marker))
            return self._goto(self._between)
        self._pos, self._raw = len(marker), True
        self._closer = self.closers.get(marker, "")
        return self._goto(self._start_region(marker))

    def _between(self, final: bool) -> bool:
        """After a region: whitespace is dropped, anything else is looked at as if outside."""
        self._consume(skip_ws(self._buf, 0))
        return bool(self._buf) and self._goto(self._outside)

    def _closing(self, final: bool) -> bool:
        """After a call's body: the region's closing marker and the whitespace before it are dropped; a missing one
        is forgiven."""
        pos = skip_ws(self._buf, 0)
        closer, rest = self._closer, self._buf[pos:]
        if closer and rest.startswith(closer):
            self._consume(pos + len(closer))
        elif closer and closer.startswith(rest):
            if not final:
                return False
            self._consume(len(self._buf))
        return self._goto(self._between)

    def _rejected(self, final: bool) -> bool:
        closer = self._closer
        at = self._buf.find(closer) if closer else -1
        if at >= 0:
            return self._reject(at + len(closer))
        keep = partial_suffix(self._buf, (closer,)) if closer and not final else 0
        cut = len(self._buf) - keep
        self._content(self._buf[:cut])
        self._consume(cut)
        return False
