"""Stop sequences: their bounds, and :class:`StopCutter`, which finds them in streamed text in linear time.

The cutter runs on the event loop for every piece of text a request streams, so its cost must not grow with the
text already streamed or with the square of a stop's length. Each stop keeps a Knuth-Morris-Pratt state (the
longest suffix of the text so far that begins the stop), so a piece of ``c`` characters costs ``O(c + longest stop)``
per stop, and only the text that may begin a stop (shorter than the longest stop) is kept.
"""

from __future__ import annotations

from mlxd.errors import RequestError

# Per request. OpenAI allows 4 stops and Anthropic more; 16 leaves room for agents' lists. Stops are markers such as
# "\n\nHuman:" or "</answer>"; 1,024 characters is far beyond any such marker and bounds what a stop costs to set
# up (its failure table) and to hold back.
MAX_STOPS = 16
MAX_STOP_CHARS = 1024


def check_stops(stops: list[str], param: str) -> list[str]:
    """The non-empty stops, or a 400 naming ``param`` when there are more than :data:`MAX_STOPS` or one is longer
    than :data:`MAX_STOP_CHARS` characters."""
    if len(stops) > MAX_STOPS:
        raise RequestError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}", param=param)
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise RequestError(f"stop sequence {i} is {len(stop)} characters long; at most {MAX_STOP_CHARS} are "
                               "allowed", param=param)
    return [stop for stop in stops if stop]


def _failure_table(stop: str) -> list[int]:
    """``table[i]``: the length of the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class _Matcher:
    """One stop's Knuth-Morris-Pratt state over the text fed so far."""

    __slots__ = ("stop", "table", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.table = _failure_table(stop)
        self.state = 0  # characters of the stop that the text so far ends with

    def advance(self, text: str) -> int:
        """Scan ``text``; the index in it just past the stop's first complete occurrence, or -1."""
        stop, table, k = self.stop, self.table, self.state
        if k == 0 and stop[0] not in text:  # the common case, at C speed
            return -1
        for i, char in enumerate(text):
            while k and char != stop[k]:
                k = table[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = 0
                    return i + 1
        self.state = k
        return -1


class StopCutter:
    """Finds stop sequences across token boundaries, holding back text that may start one.

    Among the stops that complete within one piece of text, the one that starts first is cut at (ties: the
    smallest string)."""

    def __init__(self, stops: list[str]) -> None:
        self._matchers = [_Matcher(stop) for stop in dict.fromkeys(s for s in stops if s)]
        self._held = ""  # text not yet emitted: it may begin a stop

    def feed(self, segment: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the stop sequence hit or None)."""
        if not self._matchers:  # nothing to find or hold back: the text passes through
            return segment, None
        text, offset = self._held + segment, len(self._held)
        hits = []
        for matcher in self._matchers:
            end = matcher.advance(segment)
            if end >= 0:
                hits.append((offset + end - len(matcher.stop), matcher.stop))
        if hits:
            at, stop = min(hits)
            self._held = ""
            return text[:at], stop
        # Every matcher's state is at most len(text): a stop begun before the held text would have been held too.
        cut = len(text) - max(matcher.state for matcher in self._matchers)
        self._held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        """The text held back, at the end of the stream."""
        text, self._held = self._held, ""
        return text
