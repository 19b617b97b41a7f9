"""Bounded HTTP connections: a header size limit, header and body read deadlines, a connection limit, and one log
line per interval for the connections refused or closed by them.

uvicorn (pinned) reads a request's headers and body for as long as the client takes and keeps as many connections
as the process has descriptors. :func:`make_protocol` returns a subclass of uvicorn's httptools protocol, passed as
``uvicorn.Config(http=...)``, that adds the limits:

- a connection beyond ``max_connections`` is closed as soon as it is accepted;
- a request line and headers larger than ``max_header_bytes`` get 431 and the connection is closed, having read at
  most one socket read (256 KiB) past the limit;
- a connection that has not sent a request's complete headers ``header_timeout_s`` after it opened (or after its
  previous response, for the next request) is closed, with 408 when it had sent part of them;
- a request body not complete ``body_timeout_s`` after its headers gets 408 and the connection is closed.

Each of these, and each ``accept`` that fails (the process out of descriptors or memory: asyncio reports every
failed attempt to the loop's exception handler, a traceback each, up to 2,048 a second), is counted by reason in
:class:`DroppedConnections`, which logs the counts once per interval instead of a line per connection.
"""

from __future__ import annotations

import asyncio
import errno
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from mlxd.log import get_logger

log = get_logger("mlxd.server")

LOG_INTERVAL_S = 10.0
# accept() errors asyncio reports to the loop's exception handler (then it retries a second later).
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of :mod:`mlxd.runtime.connections`; ``max_connections`` is already resolved (not 0)."""

    max_connections: int
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


class DroppedConnections:
    """Counts connections refused or closed early, by reason, and logs the counts: at the first one, then once per
    ``interval_s`` while more come. Call :meth:`note` on the event loop's thread."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, reason: str) -> None:
        self.counts[reason] += 1
        self.totals[reason] += 1
        if self._timer is None:
            self._flush()

    def _flush(self) -> None:
        self._timer = None
        if not self.counts:
            return
        log.warning("connections_dropped", interval_s=self.interval_s, **dict(sorted(self.counts.items())))
        self.counts.clear()
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._flush)

    def close(self) -> None:
        """Log what is still counted and stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.counts:
            log.warning("connections_dropped", interval_s=self.interval_s, **dict(sorted(self.counts.items())))
            self.counts.clear()


def make_accept_error_handler(drops: DroppedConnections, fallback: Callable[..., Any] | None = None
                              ) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """A loop exception handler that counts failed ``accept`` calls in ``drops`` instead of logging a traceback for
    each, and passes every other context to ``fallback`` (the loop's default handler when ``None``)."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS and "accept" in context.get("message", ""):
            drops.note(f"accept_{errno.errorcode[exc.errno].lower()}")
        elif isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")):
            pass  # the loop's accept retry, a second after a failure, found the listening socket closed
        elif fallback is not None:
            fallback(loop, context)
        else:
            loop.default_exception_handler(context)

    return handle


class _HeadersTooLarge(Exception):
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits` (see the module docstring). Use a subclass from
    :func:`make_protocol`, which sets ``limits`` and ``drops``."""

    limits: ConnectionLimits
    drops: DroppedConnections
    after_request: Callable[[], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_headers = True
        self._header_bytes = 0  # bytes received since the request began, while its headers are incomplete
        self._header_fields = 0  # bytes of its request line and header fields as parsed
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            self.drops.note("connection_limit")
            transport.abort()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._refused:
            return
        if self.cycle is not None and self.after_request is not None:
            self.after_request()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if self.after_request is not None:
            self.after_request()
        if self._reading_headers and self._deadline is not None:  # a pipelined request's clock starts now
            self._arm(self.limits.header_timeout_s, self._headers_late)
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._reading_headers:
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._header_fields > self.limits.max_header_bytes:
                self._headers_too_large()
            else:
                self.drops.note("invalid_request")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._reading_headers and self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large()

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_fields = 0
        if self._deadline is None:  # the first request's deadline runs from connection_made
            self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._reading_headers = False
        self._header_bytes = 0
        super().on_headers_complete()
        if not self.pipeline:  # a pipelined request's body waits for the one before it, so its clock starts later
            self._arm(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _count_header_bytes(self, num_bytes: int) -> None:
        self._header_fields += num_bytes
        if self._header_fields > self.limits.max_header_bytes:
            raise _HeadersTooLarge  # httptools turns it into HttpParserError; data_received answers 431

    # Deadlines and refusals
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._busy():  # a pipelined request's clock starts once the request before it is answered
            self._arm(self.limits.header_timeout_s, self._headers_late)
            return
        self.drops.note("header_timeout")
        if self._header_bytes:
            self._reply_and_close(408, "The request's headers did not arrive in time.")
        else:
            self.transport.close()

    def _body_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.drops.note("body_timeout")
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._reply_and_close(408, "The request's body did not arrive in time.")
        else:
            self._end_cycle()
            self.transport.close()

    def _headers_too_large(self) -> None:
        self.drops.note("headers_too_large")
        if self._busy():  # a pipelined request's: the answer would land in the response before it
            self._end_cycle()
            self.transport.close()
            return
        self._reply_and_close(431, "The request's headers are too large.")

    def _busy(self) -> bool:
        """Whether the app is still answering a request of this connection."""
        return self.cycle is not None and not self.cycle.response_complete

    def _end_cycle(self) -> None:
        """The request's app sees the client as gone: its ``receive`` returns ``http.disconnect`` and its ``send``
        writes nothing more."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    def _reply_and_close(self, status: int, message: str) -> None:
        self._end_cycle()
        body = message.encode("ascii")
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend([b"content-type: text/plain; charset=utf-8\r\n",
                     b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                     b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(head))
        self.transport.close()


def make_protocol(limits: ConnectionLimits, drops: DroppedConnections,
                  after_request: Callable[[], None] | None = None) -> type[BoundedHttpToolsProtocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: :class:`BoundedHttpToolsProtocol` bound to
    ``limits`` and ``drops``; ``after_request`` (optional, cheap, on the loop) is called as each response ends and
    as each connection that carried a request closes."""
    attributes = {"limits": limits, "drops": drops, "after_request": staticmethod(after_request)}
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), attributes)
