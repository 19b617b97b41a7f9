"""Operational endpoints: /health and /v1/status."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, delete, get
from litestar.di import NamedDependency

from mlxd.daemon import Daemon


class OpsController(Controller):
    tags = ["Operations"]

    @get("/health")
    async def health(self, daemon: NamedDependency[Daemon]) -> Response[dict[str, Any]]:
        """200 once the model is loaded and warmed up; 503 while loading or after a failed load."""
        body: dict[str, Any] = {"status": daemon.state, "model": daemon.name}
        if daemon.error:
            body["error"] = daemon.error
        return Response(body, status_code=200 if daemon.ready else 503)

    @get("/v1/status")
    async def status(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Running and waiting requests (phase, tokens, tok/s, TTFT), engine totals and memory."""
        daemon.require_ready()
        return {"model": daemon.name, **daemon.engine.status()}

    @get("/v1/cache/stats")
    async def cache_stats(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Prefix-cache entries, bytes against the budget, hits by kind, misses and tokens reused."""
        daemon.require_ready()
        return daemon.engine.cache_stats()

    @delete("/v1/cache", status_code=200)
    async def clear_cache(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Drop every prefix-cache entry (on the engine thread, between steps); returns the stats before."""
        daemon.require_ready()
        return {"cleared": await daemon.engine.clear_prefix_cache()}
