"""Operational endpoints: /health, /v1/status, the prefix cache, /metrics and the status page at /."""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from litestar import Controller, MediaType, Request, Response, delete, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from mlxd.api.auth import ADMIN, METRICS, OPEN, is_admin
from mlxd.api.errors import redact
from mlxd.api.metrics import Metrics
from mlxd.daemon import Daemon
from mlxd.runtime.heap import PAUSES

STATUS_PAGE = resources.files("mlxd.api").joinpath("static", "status.html").read_bytes()


class OpsController(Controller):
    tags = ["Operations"]

    @get("/health", opt={"access": OPEN})
    async def health(self, daemon: NamedDependency[Daemon]) -> Response[dict[str, Any]]:
        """200 while serving; 503 while loading, draining for shutdown, after a failed load or once the engine
        has stopped (with the reason and ``Retry-After``)."""
        status, body, retry_after = daemon.health()
        if "error" in body:
            body["error"] = redact(body["error"])  # the log has the paths; the page does not
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return Response(body, status_code=status, headers=headers)

    @get("/v1/status")
    async def status(self, request: Request, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Running and waiting requests (phase, tokens, tok/s, TTFT), limits, engine totals and memory. With keys
        configured, the per-request lists (``running``, ``waiting``) need an admin key; the counts do not."""
        daemon.require_loaded()
        status = daemon.engine.status()
        body = {"model": daemon.name, "num_running": len(status["running"]), "num_waiting": len(status["waiting"]),
                **status, "gc": PAUSES.status()}
        if not is_admin(request):
            del body["running"], body["waiting"]
        return body

    @get("/v1/cache/stats")
    async def cache_stats(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Prefix-cache entries, bytes against the budget, hits by kind, misses and tokens reused."""
        daemon.require_loaded()
        return daemon.engine.cache_stats()

    @delete("/v1/cache", status_code=200, opt={"access": ADMIN})
    async def clear_cache(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Drop every prefix-cache entry (on the engine thread, between steps); returns the stats before."""
        daemon.require_loaded()
        return {"cleared": await daemon.engine.clear_prefix_cache()}

    @get("/metrics", opt={"access": METRICS}, media_type=CONTENT_TYPE_LATEST)
    async def metrics(self, metrics: NamedDependency[Metrics]) -> Response[bytes]:
        """Prometheus metrics (text format), every name prefixed ``mlxd_``."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @get("/", opt={"access": OPEN}, media_type=MediaType.HTML, include_in_schema=False)
    async def status_page(self) -> bytes:
        """The live status page. Its HTML holds no data: it polls the API with the admin key it asks for."""
        return STATUS_PAGE
