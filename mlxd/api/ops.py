"""Operational endpoints: /health and /v1/status."""

from __future__ import annotations

import math
from typing import Any

from litestar import Controller, Response, delete, get
from litestar.di import NamedDependency

from mlxd.api.errors import redact
from mlxd.daemon import Daemon


class OpsController(Controller):
    tags = ["Operations"]

    @get("/health")
    async def health(self, daemon: NamedDependency[Daemon]) -> Response[dict[str, Any]]:
        """200 while serving; 503 while loading, draining for shutdown, after a failed load or once the engine
        has stopped (with the reason and ``Retry-After``)."""
        status, body, retry_after = daemon.health()
        if "error" in body:
            body["error"] = redact(body["error"])  # the log has the paths; the page does not
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return Response(body, status_code=status, headers=headers)

    @get("/v1/status")
    async def status(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Running and waiting requests (phase, tokens, tok/s, TTFT), engine totals and memory."""
        daemon.require_loaded()
        return {"model": daemon.name, **daemon.engine.status()}

    @get("/v1/cache/stats")
    async def cache_stats(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Prefix-cache entries, bytes against the budget, hits by kind, misses and tokens reused."""
        daemon.require_loaded()
        return daemon.engine.cache_stats()

    @delete("/v1/cache", status_code=200)
    async def clear_cache(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Drop every prefix-cache entry (on the engine thread, between steps); returns the stats before."""
        daemon.require_loaded()
        return {"cleared": await daemon.engine.clear_prefix_cache()}
