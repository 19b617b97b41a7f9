"""Every error leaves mlxd in the OpenAI error shape, from this one place.

What a client sees is safe to show: no traceback, no exception repr, no filesystem path (absolute paths are
replaced by ``<path>``), and values echoed from the request are clipped. Unexpected errors get a generic message
with the request id; their details go to the log.
"""

from __future__ import annotations

import math
import re

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, InternalServerException, ValidationException

from mlxd.api.schemas import ErrorBody, ErrorDetail
from mlxd.errors import AuthenticationError, MlxdError
from mlxd.log import get_logger

log = get_logger("mlxd.api")

# Error types by status, for Litestar's own exceptions; mlxd's errors carry their own (401 `authentication_error`
# and 403 `permission_error` are the names both OpenAI's and Anthropic's shapes use).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
CLIP = 64
# What Litestar raises (as a 500) when the client leaves while its body is read: litestar/connection/request.py.
BODY_DISCONNECT = "client disconnected prematurely"
MAX_MESSAGE = 1024
# An absolute path: POSIX with at least two segments (API routes under /v1/ and /docs/ excepted), home-relative,
# or a Windows drive path. It must start a word, so that "application/json" is left alone.
_PATH = re.compile(r"(?<![\w/.~-])(?:~|/(?!v1/|docs/))[\w.@+-]*/[^\s'\"`,;:)\]}]*|\b[A-Za-z]:\\[^\s'\"`,;:)\]}]*")
# A quoted value longer than CLIP characters: msgspec echoes unknown field names and enum values this way.
_LONG_QUOTED = re.compile(rf"(['`])([^'`]{{{CLIP}}})[^'`]+(\1|$)")


def clip(text: str, limit: int = CLIP) -> str:
    """``text`` itself when short, else its first ``limit`` characters and an ellipsis (echoing client values)."""
    return text if len(text) <= limit else text[:limit] + "…"


def redact(message: str) -> str:
    """The message with absolute paths replaced by ``<path>`` and long quoted values clipped."""
    message = _PATH.sub("<path>", message[: 16 * MAX_MESSAGE])
    message = _LONG_QUOTED.sub(lambda m: f"{m[1]}{m[2]}…{m[3]}", message)
    return clip(message, MAX_MESSAGE)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response[ErrorBody]:
    body = ErrorBody(ErrorDetail(message=redact(message), type=type_, param=param and clip(param), code=type_))
    return Response(body, status_code=status, headers=headers)


def _headers(exc: MlxdError) -> dict[str, str] | None:
    if isinstance(exc, AuthenticationError) and exc.status == 401:
        return {"WWW-Authenticate": 'Bearer realm="mlxd"'}
    if exc.status not in (429, 503) or exc.retry_after is None:
        return None
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}


def handle_mlxd_error(_: Request, exc: MlxdError) -> Response[ErrorBody]:
    return error_response(exc.status, exc.message, exc.type, exc.param, _headers(exc))


def handle_validation(_: Request, exc: ValidationException) -> Response[ErrorBody]:
    """Litestar's own validation: path and query parameters, and a missing body (``data``). Bodies themselves are
    decoded by ``mlxd.api.body``, which raises ``RequestError``."""
    details = [d for d in exc.extra if isinstance(d, dict)] if isinstance(exc.extra, list) else []
    keys = [d.get("key") for d in details]
    if "data" in keys:
        return error_response(400, "the request body is empty; send a JSON object", "invalid_request_error")
    parts = [f"`{key}`: {d.get('message')}" if key else str(d.get("message")) for key, d in zip(keys, details, strict=True)]
    message = "invalid request: " + ("; ".join(parts) if parts else str(exc.detail))
    return error_response(400, message, "invalid_request_error", keys[0] if keys else None)


def handle_http(request: Request, exc: HTTPException) -> Response[ErrorBody]:
    status = exc.status_code
    if isinstance(exc, InternalServerException) and exc.detail == BODY_DISCONNECT:
        # Nothing is sent (the client is gone) and nothing is wrong with the daemon: an info line, no traceback.
        log.info("client_disconnected", path=request.url.path, phase="reading the body")
        return error_response(499, "the client disconnected before its body was read", "client_disconnected")
    if status >= 500:
        return _internal_error(request, exc)
    return error_response(status, str(exc.detail), _TYPES.get(status, "invalid_request_error"), headers=exc.headers)


def handle_unexpected(request: Request, exc: Exception) -> Response[ErrorBody]:
    return _internal_error(request, exc)


def _internal_error(request: Request, exc: Exception) -> Response[ErrorBody]:
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    log.error("unhandled_error", path=request.url.path, exc_info=exc)
    where = f" (request {request_id})" if request_id else ""
    return error_response(500, f"internal error{where}; the details are in the server log", "server_error")


EXCEPTION_HANDLERS = {
    MlxdError: handle_mlxd_error,
    ValidationException: handle_validation,
    HTTPException: handle_http,
    Exception: handle_unexpected,
}
