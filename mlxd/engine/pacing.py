"""How often a stream's tokens are handed to its event loop.

Every hand-over wakes the stream's task on the event loop, which runs the request's stages and writes a frame: some
60 µs of Python a token on an H200's host at 64 streams. The engine thread needs the same interpreter lock to build
its next step, so with many streams the event loop's work lengthens every step (4 ms a 64-row step). The pacer caps
the hand-overs: with ``updates_per_s`` the most the server makes in a second across its streams, each stream gets its
tokens at most once every ``streams / updates_per_s`` seconds, several together when more came meanwhile (one frame,
one wake). A stream whose tokens come further apart than that interval (few streams) gets each at once.

A stream's first token and its last event (and whatever is held before them) go at once: the time to first token
and a stream's end do not wait. Plain Python, on the engine thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from mlxd.engine.base import LAST_EVENTS, RequestHandle, Token

Outbox = list[tuple[RequestHandle, Any]]


class StreamPacer:
    """Holds token events of streams handed some within their interval; ``updates_per_s`` 0 holds none."""

    def __init__(self, updates_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.updates_per_s = updates_per_s
        self._clock = clock
        self._last: dict[RequestHandle, float] = {}  # when each stream was last handed events
        self._held: dict[RequestHandle, list[Any]] = {}

    def release(self, outbox: Outbox, num_streams: int, *, flush: bool = False) -> Outbox:
        """What of ``outbox`` (and of the events held before it) goes now, in order per stream; the rest is held.
        ``flush`` releases everything (the engine is stopping)."""
        if not self.updates_per_s:
            return outbox
        now = self._clock()
        interval_s = num_streams / self.updates_per_s
        out: Outbox = []
        last, holding = self._last, self._held
        for handle, event in outbox:
            held = holding.get(handle)
            if held is not None:
                held.append(event)
            elif not flush and type(event) is Token and now - last.get(handle, -math.inf) < interval_s:
                holding[handle] = [event]
            else:
                out.append((handle, event))
                if type(event) is Token:  # a prompt's progress reports do not count
                    last[handle] = now
        for handle, held in list(holding.items()):
            if flush or now - last[handle] >= interval_s or isinstance(held[-1], LAST_EVENTS):
                out.extend((handle, event) for event in held)
                del holding[handle]
                last[handle] = now
        for handle, event in out:  # ended streams are forgotten
            if isinstance(event, LAST_EVENTS):
                last.pop(handle, None)
        return out

    @property
    def num_held(self) -> int:
        """Streams with events held now."""
        return len(self._held)
