"""Start-up phases told as they happen: converting a GGUF file, loading the weights, warming the engine up.

Each phase logs ``phase_start`` and ``phase_end`` (with its ``seconds``); code deep inside a phase reports its steps
with :func:`step`, which logs ``phase_progress`` (``step`` of ``steps``) at most every :data:`PROGRESS_EVERY_S`
seconds and, when log lines go to a terminal in the console format, redraws a one-line progress bar on it. A phase
that reports no steps logs ``phase_progress`` with its seconds so far every :data:`PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from mlxd.log import console_terminal, get_logger

log = get_logger("mlxd.startup")

PROGRESS_EVERY_S = 2.0
_BAR_WIDTH = 30


class Phase:
    """One running phase: its name, when it started, and when it last said how far it had got."""

    def __init__(self, name: str, terminal: TextIO | None) -> None:
        self.name = name
        self.started = time.monotonic()
        self.last_told = self.started
        self.terminal = terminal
        self.drawn = False
        self.stepped = False
        self._ended = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name=f"phase-{name}", daemon=True)

    def _tick(self) -> None:
        """For a phase that reports no steps (converting, loading): a ``phase_progress`` line with the seconds so far
        every :data:`PROGRESS_EVERY_S` seconds, so a long one is not silent."""
        while not self._ended.wait(PROGRESS_EVERY_S):
            if not self.stepped:
                log.info("phase_progress", phase=self.name, seconds=round(time.monotonic() - self.started, 2))

    def step(self, done: int, total: int) -> None:
        self.stepped = True
        now = time.monotonic()
        if now - self.last_told >= PROGRESS_EVERY_S:
            self.last_told = now
            log.info("phase_progress", phase=self.name, step=done, steps=total,
                     seconds=round(now - self.started, 2))
        if self.terminal is not None:
            filled = _BAR_WIDTH * done // max(total, 1)
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            self.terminal.write(f"\r{self.name} [{bar}] {done}/{total} {now - self.started:.0f}s")
            self.terminal.flush()
            self.drawn = True

    def end(self) -> float:
        self._ended.set()
        if self._ticker.is_alive():
            self._ticker.join()
        if self.drawn and self.terminal is not None:
            self.terminal.write("\r\033[K")  # the bar's line cleared, so the next log line starts on it
            self.terminal.flush()
        return time.monotonic() - self.started


_current: contextvars.ContextVar[Phase | None] = contextvars.ContextVar("mlxd_startup_phase", default=None)


@contextmanager
def phase(name: str, **fields: Any) -> Iterator[Phase]:
    """Log the start and the end (with its duration) of the phase ``name`` around the block; :func:`step` calls
    made in the block, on this thread, report on it. A phase that raises logs ``phase_failed`` instead of its end."""
    current = Phase(name, console_terminal())
    log.info("phase_start", phase=name, **fields)
    token = _current.set(current)
    current._ticker.start()
    try:
        yield current
    except BaseException:
        log.info("phase_failed", phase=name, seconds=round(current.end(), 2))
        raise
    finally:
        _current.reset(token)
    log.info("phase_end", phase=name, seconds=round(current.end(), 2), **fields)


def step(done: int, total: int) -> None:
    """``done`` of ``total`` steps of the running phase are done (nothing when no phase runs on this thread)."""
    current = _current.get()
    if current is not None:
        current.step(done, total)
