"""The one error hierarchy of mlxd.

Every error carries an HTTP status and an OpenAI-style ``type``/``param``; the API layer maps them to the
OpenAI or Anthropic body shape in one place (``mlxd.api.errors``).
"""

from __future__ import annotations


class MlxdError(Exception):
    """Base of all mlxd errors."""

    status: int = 500
    type: str = "server_error"
    # Seconds a client should wait before retrying (429 and 503 answers carry it as ``Retry-After``).
    retry_after: float | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if retry_after is not None:
            self.retry_after = retry_after


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


class UnsupportedMediaType(RequestError):
    """A body that is not declared JSON (no ``Content-Type``, ``text/plain``, a form): 415. Such a POST is one a web
    page may send to any origin without asking first (a CORS "simple" request), so it is never read."""

    status = 415


class ModelNotFound(RequestError):
    status = 404
    type = "model_not_found"


class ContextLengthExceeded(RequestError):
    type = "context_length_exceeded"


class AuthenticationError(MlxdError):
    """No API key, or one that is not configured (401); the message never echoes the key sent."""

    status = 401
    type = "authentication_error"


class PermissionDenied(AuthenticationError):
    """A valid API key on an endpoint that needs an admin key (403)."""

    status = 403
    type = "permission_error"


class HostNotAllowed(MlxdError):
    """A request to a daemon bound to loopback whose ``Host`` is not a loopback name or an allowed one (403): a
    page of another origin reaching it through a name that resolves here (DNS rebinding)."""

    status = 403
    type = "permission_error"


class Overloaded(MlxdError):
    """Queues are full; the client should retry later (``retry_after`` reflects the queue)."""

    status = 429
    type = "rate_limit_error"
    retry_after = 1.0


class NotReady(MlxdError):
    """Loading, draining for shutdown, queued too long, or the engine is gone."""

    status = 503
    type = "service_unavailable"
    retry_after = 5.0


class EngineError(MlxdError):
    """A failure inside the engine while serving one request; ``status`` 503 when the server is going away."""

    type = "server_error"

    def __init__(self, message: str, *, status: int = 500, retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status
        if status == 503:
            self.type = "service_unavailable"


class DistributedFault(MlxdError):
    """The ranks of a tensor-parallel group can no longer be known to agree (a step failed on one of them, or their
    states differ): the job must end, and be restarted."""

    status = 503
    type = "service_unavailable"
