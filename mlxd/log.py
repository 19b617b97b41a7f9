"""structlog, configured once: JSON lines when not on a terminal (launchd, systemd), console otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog for the whole process. ``fmt``: ``auto`` | ``json`` | ``console``."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Quiet libraries that log through the standard library, unless debugging.
    logging.basicConfig(level=logging.DEBUG if level == "debug" else logging.WARNING, stream=sys.stderr)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
