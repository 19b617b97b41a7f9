"""One device, several engines: each engine step (and each engine's warm-up) takes the device's turn
(:class:`DeviceTurn`), so that no two engine threads run device work at once. Turns are served first come first
served, so one model's burst cannot starve another's streams: with two engines busy, their steps alternate.
Plain Python; the engine side is :class:`mlxd.engine.engine.BatchedEngine`'s ``held``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DeviceTurn:
    """A first-come-first-served lock (a ticket lock): whoever asked first runs next. Plain Python.

    ``on_turn(holder)``, when set, is called with each holder's name as it gets the turn (tests read the order)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._now_serving = 0
        self.num_turns = 0
        self.on_turn: Callable[[str], None] | None = None

    def take(self, holder: str = "") -> None:
        """Wait for the turn, after every thread that asked before."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._now_serving:
                self._cond.wait()
            self.num_turns += 1
        if self.on_turn is not None:
            self.on_turn(holder)

    @property
    def num_asked(self) -> int:
        """Turns asked for so far (taken, held or waited for)."""
        return self._next_ticket

    def give(self) -> None:
        """Hand the turn to whoever asked next."""
        with self._cond:
            self._now_serving += 1
            self._cond.notify_all()

    def held(self, holder: str = "") -> _Held:
        """``with turn.held(name): ...`` takes and gives the turn around a block."""
        return _Held(self, holder)


class _Held:
    def __init__(self, turn: DeviceTurn, holder: str) -> None:
        self.turn, self.holder = turn, holder

    def __enter__(self) -> None:
        self.turn.take(self.holder)

    def __exit__(self, *_: Any) -> None:
        self.turn.give()
