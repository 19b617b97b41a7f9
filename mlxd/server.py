"""Running the app under uvicorn with mlxd's lifecycle.

- SIGTERM or SIGINT: drain (new requests get 503 with ``Retry-After``; running ones finish within
  ``[server] drain_timeout_s``, the rest end with a final error event), then exit 0.
- A second signal: exit at once (128 + the signal's number).
- A fatal daemon error (the model failed to load, the engine thread ended): exit 1, so that launchd's
  ``KeepAlive`` or systemd's ``Restart=on-failure`` restarts the process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from types import FrameType

import uvicorn

from mlxd.daemon import Daemon
from mlxd.log import get_logger

log = get_logger("mlxd.server")

EXIT_FATAL = 1
# uvicorn's own wait for open connections once the drain is over (the drain already ended every stream).
GRACE_S = 5


class Server(uvicorn.Server):
    """uvicorn's server with mlxd's signal handling; :meth:`run` returns the process exit code."""

    def __init__(self, config: uvicorn.Config, daemon: Daemon) -> None:
        super().__init__(config)
        self.daemon = daemon
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain: asyncio.Task | None = None
        daemon.on_fatal = self._on_fatal

    def run(self, sockets: list | None = None) -> int:  # type: ignore[override]
        super().run(sockets)
        return self.exit_code

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): the first signal starts the drain, a second one exits at once."""
        if self._signalled:
            log.warning("shutdown", reason=f"second signal {signal.Signals(sig).name}: exiting at once")
            sys.stderr.flush()
            os._exit(128 + sig)
        self._signalled = True
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        log.info("shutdown", reason=f"signal {signal_name}", phase="draining")
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.daemon.drain(self.daemon.config.server.drain_timeout_s)
        finally:
            self.should_exit = True

    def _on_fatal(self, reason: str) -> None:
        """Any thread: stop serving and exit non-zero."""
        log.error("shutdown", reason=reason, exit_code=EXIT_FATAL)
        self.exit_code = EXIT_FATAL
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit)
        else:
            self.should_exit = True

    def _exit(self) -> None:
        self.should_exit = True


def run_server(app: object, daemon: Daemon) -> int:
    """Serve ``app`` on the daemon's host and port until drained or failed; return the exit code."""
    server = daemon.config.server
    config = uvicorn.Config(app, host=server.host, port=server.port, access_log=False, log_level="warning",
                            timeout_graceful_shutdown=GRACE_S)
    return Server(config, daemon).run()
