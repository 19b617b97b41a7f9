"""API keys: who may call what. Keys are loaded once, when the app is built, and never logged.

Every route handler names its access in ``opt={"access": ...}``; a handler that names none needs an API key:

- ``OPEN``: anyone (``/health``, and the page's HTML at ``/``, which holds no data: what it shows comes from
  the API with the key the page asks for).
- ``KEY`` (the default): any valid API key.
- ``METRICS``: open, unless ``[server] metrics_need_key`` asks for an API key.
- ``ADMIN``: an admin key.

With no keys configured everything is open. With API keys but no admin keys, every API key is an admin key; an
admin key is also an API key. Keys travel in ``Authorization: Bearer KEY`` or ``x-api-key: KEY``. A missing or
unknown key is a 401, a valid key on an admin endpoint a 403, both in the API's error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.config.schema import ServerConfig
from mlxd.errors import AuthenticationError, ConfigError, PermissionDenied

OPEN, KEY, METRICS, ADMIN = "open", "key", "metrics", "admin"
API_KEYS_ENV, ADMIN_KEYS_ENV = "MLXD_API_KEYS", "MLXD_ADMIN_KEYS"
_IS_ADMIN = "mlxd_is_admin"  # connection state the guard leaves for handlers that show more to admins
_HOW = "send it as `Authorization: Bearer KEY` or `x-api-key: KEY`"


@dataclass(frozen=True, slots=True)
class Keys:
    """SHA-256 digests of the configured keys (equal lengths, so comparing them reveals nothing of a key's
    length). ``api`` holds every valid key, admin keys included."""

    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    metrics_need_key: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api)


def read_keys_file(path: Path, field: str) -> list[str]:
    """The keys in ``path``, one per line; blank lines and lines starting with ``#`` are ignored.

    Raises ``ConfigError`` naming the file and the ``[server]`` field when it cannot be read or holds no key
    (an empty file would leave the API open without anyone noticing)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such file ([server] {field})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the keys file ([server] {field}): {e}") from e
    keys = [line.strip() for line in lines]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ConfigError(f"{path}: the keys file holds no key ([server] {field}); remove {field} to run "
                          "without keys")
    return keys


def _env_keys(environ: Mapping[str, str], name: str) -> list[str]:
    return [key.strip() for key in environ.get(name, "").split(",") if key.strip()]


def _file_keys(file: str, field: str, base_dir: Path | None) -> list[str]:
    if not file:
        return []
    path = Path(file).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return read_keys_file(path, field)


def load_keys(server: ServerConfig, base_dir: Path | None = None,
              environ: Mapping[str, str] | None = None) -> Keys:
    """Keys from ``[server] api_keys_file`` / ``admin_keys_file`` (relative paths from ``base_dir``, the
    config's folder) and the ``MLXD_API_KEYS`` / ``MLXD_ADMIN_KEYS`` environment variables (comma separated).
    Files and variables add up."""
    environ = os.environ if environ is None else environ
    admin = _file_keys(server.admin_keys_file, "admin_keys_file", base_dir) + _env_keys(environ, ADMIN_KEYS_ENV)
    api = _file_keys(server.api_keys_file, "api_keys_file", base_dir) + _env_keys(environ, API_KEYS_ENV)
    return Keys(api=_digests(api + admin), admin=_digests(admin), metrics_need_key=server.metrics_need_key)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _digests(keys: list[str]) -> tuple[bytes, ...]:
    return tuple(dict.fromkeys(digest(key) for key in keys))


def presented_keys(connection: ASGIConnection) -> list[str]:
    """The keys a request carries: the ``Authorization: Bearer`` token and the ``x-api-key`` header."""
    found = []
    scheme, _, token = connection.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        found.append(token.strip())
    if api_key := connection.headers.get("x-api-key", "").strip():
        found.append(api_key)
    return found


def matches(presented: list[str], digests: tuple[bytes, ...]) -> bool:
    """Whether any presented key is one of the keys behind ``digests``. Every pair is compared with
    ``hmac.compare_digest``, so the time taken does not depend on which key matched or how much of it."""
    found = False
    for candidate in map(digest, presented):
        for key in digests:
            found |= hmac.compare_digest(candidate, key)
    return found


Guard = Callable[[ASGIConnection, BaseRouteHandler], Awaitable[None]]


def make_guard(keys: Keys) -> Guard:
    """The app-wide Litestar guard enforcing each handler's ``access`` (see the module docstring).

    A coroutine function doing no blocking work (a few SHA-256 digests of header values): Litestar runs a plain
    function guard on a worker thread, where it would wait behind request work before even ``/health`` could
    answer."""

    async def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        access = handler.opt.get("access", KEY)
        if not keys.enabled:
            connection.state[_IS_ADMIN] = True
            return
        if access == OPEN or connection.scope.get("method") == "OPTIONS":
            return
        if access == METRICS and not keys.metrics_need_key:
            return
        presented = presented_keys(connection)
        if not presented:
            raise AuthenticationError(f"this endpoint needs an API key; {_HOW}")
        if not matches(presented, keys.api):
            raise AuthenticationError("the API key is not valid")
        is_admin = not keys.admin or matches(presented, keys.admin)
        connection.state[_IS_ADMIN] = is_admin
        if access == ADMIN and not is_admin:
            raise PermissionDenied("this endpoint needs an admin key")

    return guard


def is_admin(connection: ASGIConnection) -> bool:
    """Whether the request showed an admin key (always, with no keys configured). Set by the guard."""
    return bool(connection.state.get(_IS_ADMIN, False))
