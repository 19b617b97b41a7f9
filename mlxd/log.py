"""structlog, configured once: JSON lines when not on a terminal (launchd, systemd), console otherwise.

Lines go to stderr, or to a file (``mlxd --log-file``) that :func:`reconfigure_logging` reopens by name, so that
logrotate or newsyslog can move it away and send SIGHUP.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LogFile:
    """A file opened for appending that can be reopened by name. Each line is one ``write`` under a lock, so a
    thread logging while the file is reopened writes its whole line to the old file or the new one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self._lock = threading.Lock()
        self._file = self._open()

    def _open(self) -> TextIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8")  # kept open until reopened or closed

    def write(self, text: str) -> int:
        with self._lock:
            written = self._file.write(text)
            self._file.flush()
            return written

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def isatty(self) -> bool:
        return False

    def reopen(self) -> None:
        """Open the path again (creating the file) and close the old one; on ``OSError`` the old one stays."""
        new = self._open()
        with self._lock:
            old, self._file = self._file, new
        old.close()

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class _Output:
    level: str = "info"
    fmt: str = "auto"
    file: LogFile | None = None
    console: bool = False  # lines rendered for a reader (not JSON)


_output = _Output()


def configure_logging(level: str = "info", fmt: str = "auto", file: str | Path | None = None) -> None:
    """Configure structlog (and the standard library's root logger) for the whole process.

    ``fmt``: ``auto`` | ``json`` | ``console``; ``auto`` is JSON unless the target is a terminal. ``file``: append
    lines to this file (its folder is created) instead of stderr. Raises ``OSError`` when it cannot be opened.
    """
    log_file = LogFile(file) if file is not None else None
    if _output.file is not None:
        _output.file.close()
    _output.file = log_file
    _apply(level, fmt)


def reconfigure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """For SIGHUP: reopen the log file, if lines go to one, and apply ``level`` and ``fmt`` where given.

    Raises ``OSError`` when the file cannot be reopened; logging then goes on unchanged, to the old file.
    """
    if _output.file is not None:
        _output.file.reopen()
    _apply(level or _output.level, fmt or _output.fmt)


def log_file() -> Path | None:
    """The file log lines go to, or ``None`` for stderr."""
    return _output.file.path if _output.file is not None else None


def _apply(level: str, fmt: str) -> None:
    _output.level, _output.fmt = level, fmt
    target = _output.file or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not target.isatty())
    _output.console = not use_json
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
        logger_factory=structlog.WriteLoggerFactory(file=target),
        cache_logger_on_first_use=False,
    )
    # Quiet libraries that log through the standard library, unless debugging; with a log file, their lines
    # (uvicorn's among them) go there too.
    std_level = logging.DEBUG if level == "debug" else logging.WARNING
    if _output.file is not None:
        logging.basicConfig(level=std_level, stream=_output.file, force=True)
    else:
        logging.basicConfig(level=std_level, stream=sys.stderr)
    logging.getLogger().setLevel(std_level)


def console_terminal() -> TextIO | None:
    """stderr, when log lines go there in the console format and it is a terminal (where a progress bar may be
    drawn between them); else ``None``."""
    if _output.file is not None or not _output.console or not sys.stderr.isatty():
        return None
    return sys.stderr


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_pytorch_notice() -> None:
    """Drop two transformers notices that are wrong for mlxd: "PyTorch was not found. Models won't be
    available..." (logged by ``transformers``' ``__init__`` at import when torch is absent, which it always is
    here: mlxd uses its tokenizers only), and "Token indices sequence length is longer than the specified maximum
    sequence length ... will result in indexing errors" (a tokenizer's ``model_max_length`` is the trained
    context; mlxd checks prompts against the served ``[model] context_length`` itself). Their other messages are
    left as they are. Call before transformers is first imported."""
    for name, start in (("transformers", "PyTorch was not found."),
                        ("transformers.tokenization_utils_base", "Token indices sequence length is longer")):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(start))


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
