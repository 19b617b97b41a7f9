"""The one error hierarchy of mlxd.

Every error carries an HTTP status and an OpenAI-style ``type``/``param``; the API layer maps them to the
OpenAI or Anthropic body shape in one place (``mlxd.api.errors``).
"""

from __future__ import annotations


class MlxdError(Exception):
    """Base of all mlxd errors."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(MlxdError):
    """A config or pipeline file is invalid. Message names the file, table/stage and field."""

    type = "config_error"


class PipelineError(MlxdError):
    """A stage could not be found, loaded or warmed up."""

    type = "pipeline_error"


class ModelLoadError(MlxdError):
    """The model source cannot be loaded (missing folder, unsupported GGUF, hub id with no hub)."""

    type = "model_load_error"


class RequestError(MlxdError):
    """The client sent something mlxd cannot honour."""

    status = 400
    type = "invalid_request_error"


class ModelNotFound(RequestError):
    status = 404
    type = "model_not_found"


class ContextLengthExceeded(RequestError):
    type = "context_length_exceeded"


class Overloaded(MlxdError):
    """Queues are full; the client should retry later."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(MlxdError):
    status = 503
    type = "service_unavailable"


class EngineError(MlxdError):
    """A failure inside the engine while serving one request."""

    type = "server_error"
