"""What a decode step costs, plain and speculative, measured on this engine: the price of verifying drafts.

A verify step feeds ``width`` positions a row; on some backends that costs little more than one position (memory
bound), on others several times more. Each decode step's period (from its start to the next decode step's start,
with no prompt chunk run between) is averaged per kind and batch size; :meth:`StepCosts.ratio` says how many plain
steps one verify step costs. Speculative rows back off when their drafts gain less than that.
"""

from __future__ import annotations

import time

_WEIGHT = 0.2  # of the newest period in the running average


class StepCosts:
    def __init__(self) -> None:
        self._periods: dict[tuple[int, int], float] = {}  # (batch size, width) → seconds; width 1: plain
        self._last: tuple[tuple[int, int], float] | None = None

    def tick(self, batch_size: int, width: int) -> None:
        """A decode step of ``batch_size`` rows feeding up to ``width`` positions each starts now."""
        now = time.perf_counter()
        if self._last is not None:
            (size, fed), started = self._last
            self.record(size, fed, now - started)
        self._last = ((batch_size, width), now)

    def record(self, batch_size: int, width: int, seconds: float) -> None:
        """One step's period, into the running average of its kind."""
        previous = self._periods.get((batch_size, width))
        self._periods[(batch_size, width)] = seconds if previous is None else (1 - _WEIGHT) * previous + _WEIGHT * seconds

    def interrupt(self) -> None:
        """Other work (a prompt chunk) ran since the last tick: that period measures nothing."""
        self._last = None

    def ratio(self, batch_size: int, width: int) -> float | None:
        """Plain steps one verify step of ``width`` costs at this batch size; None until both were measured."""
        plain, verify = self._periods.get((batch_size, 1)), self._periods.get((batch_size, width))
        return verify / plain if plain and verify else None
