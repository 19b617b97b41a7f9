"""Operational endpoints: /health and /v1/status."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
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
