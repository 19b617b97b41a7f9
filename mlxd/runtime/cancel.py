"""Cancelling a request's preparation from outside the thread that prepares it.

Preparation (rendering, tokenizing, image decoding) runs on a worker thread, which nothing can stop from outside.
The request's :class:`CancelFlag` is set instead (the client left, the server drains), and the work checks it
between stages and inside its long loops with :func:`check_cancelled`, which raises :class:`Cancelled`: the worker
is free soon after, not when the work would have ended.

The flag travels in a context variable set by the worker for the task it runs, so code deep inside a stage (the
image decoder, a renderer) checks it without every signature carrying it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mlxd.errors import MlxdError


class Cancelled(MlxdError):
    """The request's preparation was stopped: its client left (499), or the server is shutting down (503)."""

    status = 499
    type = "client_disconnected"

    def __init__(self, message: str, *, status: int = 499) -> None:
        super().__init__(message)
        self.status = status
        if status == 503:
            self.type = "service_unavailable"


class CancelFlag:
    """Set once, from any thread; the first reason (and status) set is the one raised."""

    __slots__ = ("_event", "reason", "status")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.status = 499

    def set(self, reason: str, status: int = 499) -> None:
        if not self._event.is_set():
            self.reason, self.status = reason, status
            self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise :class:`Cancelled` if set."""
        if self._event.is_set():
            raise Cancelled(self.reason, status=self.status)


_CURRENT: contextvars.ContextVar[CancelFlag | None] = contextvars.ContextVar("mlxd_cancel_flag", default=None)


@contextmanager
def cancel_scope(flag: CancelFlag) -> Iterator[None]:
    """Make ``flag`` the one :func:`check_cancelled` reads in this context, for the ``with`` block."""
    token = _CURRENT.set(flag)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def check_cancelled() -> None:
    """Raise :class:`Cancelled` when the current preparation's flag is set; nothing outside one."""
    flag = _CURRENT.get()
    if flag is not None:
        flag.check()
