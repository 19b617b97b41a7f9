"""Every error leaves mlxd in the OpenAI error shape, from this one place."""

from __future__ import annotations

import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from mlxd.api.schemas import ErrorBody, ErrorDetail
from mlxd.errors import MlxdError, Overloaded
from mlxd.log import get_logger

log = get_logger("mlxd.api")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response[ErrorBody]:
    body = ErrorBody(ErrorDetail(message=message, type=type_, param=param, code=type_))
    return Response(body, status_code=status, headers=headers)


def handle_mlxd_error(_: Request, exc: MlxdError) -> Response[ErrorBody]:
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if isinstance(exc, Overloaded) else None
    return error_response(exc.status, exc.message, exc.type, exc.param, headers)


def handle_validation(_: Request, exc: ValidationException) -> Response[ErrorBody]:
    details = [d for d in exc.extra if isinstance(d, dict)] if isinstance(exc.extra, list) else []
    parts, params = [], []
    for detail in details:
        # Litestar names the whole body `data`; the field is then in msgspec's message.
        key, text = detail.get("key"), str(detail.get("message"))
        unknown = re.search(r"unknown field `([^`]+)`", text)
        param = unknown.group(1) if unknown else (None if key == "data" else key)
        params.append(param)
        parts.append(f"`{param}`: {text}" if param and not unknown else text)
    message = "invalid request body: " + ("; ".join(parts) if parts else str(exc.detail))
    return error_response(400, message, "invalid_request_error", params[0] if params else None)


def handle_http(_: Request, exc: HTTPException) -> Response[ErrorBody]:
    status = exc.status_code
    message = str(exc.detail)
    if isinstance(exc.__cause__, SerializationException | msgspec.DecodeError):
        message = f"malformed JSON body: {message}"
    return error_response(status, message, _TYPES.get(status, "server_error"), headers=exc.headers)


def handle_unexpected(request: Request, exc: Exception) -> Response[ErrorBody]:
    log.exception("unhandled_error", path=request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


EXCEPTION_HANDLERS = {
    MlxdError: handle_mlxd_error,
    ValidationException: handle_validation,
    HTTPException: handle_http,
    Exception: handle_unexpected,
}
