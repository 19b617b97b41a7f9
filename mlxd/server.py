"""Running the app under uvicorn with mlxd's lifecycle.

- SIGTERM or SIGINT: drain (new requests get 503 with ``Retry-After``; running ones finish within
  ``[server] drain_timeout_s``, the rest end with a final error event), then exit 0.
- A second signal: exit at once (128 + the signal's number).
- SIGHUP: re-read the config file's ``[logging]`` table and reopen the log file (after logrotate or newsyslog
  moved it); serving goes on.
- SIGUSR1, SIGUSR2: logged and ignored (their default action would end the process without a drain).
- A fatal daemon error (the model failed to load, the engine thread ended): exit 1, so that launchd's
  ``KeepAlive`` or systemd's ``Restart=on-failure`` restarts the process.

Connections are bounded (:mod:`mlxd.runtime.connections`, ``[server]`` max_header_bytes, header_timeout_s,
body_timeout_s, max_connections); the descriptor limit is raised to its hard limit first, and failed ``accept``
calls are counted into one log line per interval instead of a traceback each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import uvicorn

from mlxd.config import load_config
from mlxd.config.schema import ServerConfig
from mlxd.daemon import Daemon
from mlxd.errors import ConfigError
from mlxd.log import get_logger, log_file, reconfigure_logging
from mlxd.runtime.connections import (
    ConnectionLimits,
    DroppedConnections,
    make_accept_error_handler,
    make_protocol,
)
from mlxd.runtime.descriptors import STARTED_WITH, accept_backlog, connection_limit, raise_descriptor_limit
from mlxd.runtime.heap import HeapTrimmer

log = get_logger("mlxd.server")

EXIT_FATAL = 1
# Their default action ends the process with no drain; mlxd ignores them (mlxd.cli, before serving) and logs them.
USER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# uvicorn's own wait for open connections once the drain is over (the drain already ended every stream).
GRACE_S = 5


class Server(uvicorn.Server):
    """uvicorn's server with mlxd's signal handling; :meth:`run` returns the process exit code.

    ``config_path``: the daemon config whose ``[logging]`` table SIGHUP re-reads (``None``: SIGHUP is not handled).
    """

    def __init__(self, config: uvicorn.Config, daemon: Daemon, config_path: Path | None = None,
                 drops: DroppedConnections | None = None) -> None:
        super().__init__(config)
        self.daemon = daemon
        self.config_path = config_path
        self.drops = drops
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
        # uvicorn handles only SIGINT and SIGTERM; these handlers run on the loop, not inside the signal.
        main = threading.current_thread() is threading.main_thread()
        hangup = self.config_path is not None and main
        if hangup:
            self._loop.add_signal_handler(signal.SIGHUP, self._reload_logging, self.config_path)
        for sig in USER_SIGNALS if main else ():
            self._loop.add_signal_handler(sig, self._user_signal, sig)
        if self.drops is not None:
            self._loop.set_exception_handler(make_accept_error_handler(self.drops, self._loop.get_exception_handler()))
        try:
            await super().serve(sockets)
        finally:
            if hangup:
                self._loop.remove_signal_handler(signal.SIGHUP)
            for sig in USER_SIGNALS if main else ():
                self._loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)  # not back to the default, which ends the process
            if self.drops is not None:
                self.drops.close()

    def _user_signal(self, sig: int) -> None:
        log.info("signal_ignored", signal=signal.Signals(sig).name,
                 reason="mlxd gives SIGUSR1 and SIGUSR2 no meaning; SIGHUP reopens the log, SIGTERM drains")

    def _reload_logging(self, config_path: Path) -> None:
        """SIGHUP: reopen the log file and apply the config's ``[logging]`` table. A config that no longer
        loads keeps the current level and format (the file is reopened all the same); nothing stops serving."""
        settings, error = None, None
        try:
            settings = load_config(config_path).logging
        except ConfigError as e:
            error = e.message
        try:
            reconfigure_logging(settings.level if settings else None, settings.format if settings else None)
        except OSError as e:
            log.error("log_reopen_failed", file=str(log_file()), reason=e.strerror or str(e))
            return
        if error is not None:  # logged to the reopened file, where an operator looks after rotating
            log.error("logging_reload_failed", reason=error, kept="the current level and format")
        else:
            log.info("logging_reloaded", level=settings.level, format=settings.format,
                     file=str(log_file() or "stderr"))

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


def run_server(app: object, daemon: Daemon, config_path: Path | None = None) -> int:
    """Serve ``app`` on the daemon's host and port until drained or failed; return the exit code. With
    ``config_path``, SIGHUP re-reads that file's ``[logging]`` table and reopens the log file."""
    server = daemon.config.server
    limits, backlog = connection_limits(server)
    drops, trimmer = DroppedConnections(), HeapTrimmer()
    # log_config=None: uvicorn's lines go through the root logger that mlxd.log set up (the log file, if any).
    config = uvicorn.Config(app, host=server.host, port=server.port, access_log=False, log_level="warning",
                            log_config=None, timeout_graceful_shutdown=GRACE_S, backlog=backlog,
                            http=make_protocol(limits, drops, after_request=trimmer.request_ended))
    trimmer.start()
    try:
        return Server(config, daemon, config_path, drops).run()
    finally:
        trimmer.stop()


def connection_limits(server: ServerConfig) -> tuple[ConnectionLimits, int]:
    """The ``[server]`` connection bounds and the listen backlog, after raising the descriptor limit (logged)."""
    limit = raise_descriptor_limit()
    lowered = {"started_with": STARTED_WITH[1], "lowered_by": "mlx-lm, at import (this process may not raise it)"
               } if limit.hard < STARTED_WITH[1] else {}
    log.info("descriptor_limit", soft=limit.soft, hard=limit.hard, was_soft=limit.was_soft, **lowered)
    limits = ConnectionLimits(max_connections=connection_limit(server.max_connections, limit.soft),
                              max_header_bytes=server.max_header_bytes, header_timeout_s=server.header_timeout_s,
                              body_timeout_s=server.body_timeout_s)
    if limits.max_connections >= limit.soft:
        log.warning("max_connections", max_connections=limits.max_connections, descriptor_limit=limit.soft,
                    reason="above the descriptor limit: accepts will fail before the connection limit is reached")
    backlog = accept_backlog(limit.soft, limits.max_connections)
    log.info("connection_limits", **vars(limits), backlog=backlog)
    return limits, backlog
