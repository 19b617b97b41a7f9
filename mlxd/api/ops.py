"""Operational endpoints: /health, /v1/status, the prefix cache, /metrics and the status page at /.

None of them shows what a request says: ``/v1/status`` lists requests by id, phase, sizes and timings, and shows
rendered prompts only to a key from the admin keys, and only when ``[server] status_shows_prompts`` is on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from litestar import Controller, MediaType, Request, Response, delete, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from mlxd.api.auth import ADMIN, METRICS, OPEN, is_admin, matches, presented_keys
from mlxd.api.errors import redact
from mlxd.api.metrics import Metrics
from mlxd.api.origins import page_headers
from mlxd.daemon import Daemon
from mlxd.runtime.heap import PAUSES

STATUS_PAGE = resources.files("mlxd.api").joinpath("static", "status.html").read_bytes()
STATUS_PAGE_HEADERS = page_headers(STATUS_PAGE)
REQUEST_LISTS = ("running", "waiting")


@dataclass(frozen=True, slots=True)
class PromptViewers:
    """Digests of the keys that may see rendered prompts in ``/v1/status``: the admin keys when
    ``[server] status_shows_prompts`` is on, else none (with no admin keys, no one)."""

    admin: tuple[bytes, ...] = ()

    def may_see(self, request: Request) -> bool:
        return bool(self.admin) and matches(presented_keys(request), self.admin)


def _engine_status(daemon: Daemon, prompts: bool) -> dict[str, Any]:
    """The first model's engine status (limits, totals, memory; none while it is unloaded), with the running and
    waiting requests of every loaded model, each naming its model when several are configured."""
    several = len(daemon.models.slots) > 1
    status: dict[str, Any] = {}
    lists: dict[str, list[dict[str, Any]]] = {name: [] for name in REQUEST_LISTS}
    for slot in daemon.models.slots:
        engine = slot.engine
        if engine is None:
            continue
        each = engine.status(prompts=True) if prompts else engine.status()
        if slot is daemon.models.first:
            status = each
        for name in REQUEST_LISTS:
            lists[name] += [{**entry, "model": slot.name} if several else entry for entry in each[name]]
    return {**status, **lists}


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
    async def status(self, request: Request, daemon: NamedDependency[Daemon],
                     viewers: NamedDependency[PromptViewers]) -> dict[str, Any]:
        """Running and waiting requests of every loaded model (phase, tokens, tok/s, TTFT; with several models each
        names its ``model``), limits, engine totals and memory (of the first model), and ``models``: each configured
        model's state, memory and requests. With keys
        configured, the per-request lists (``running``, ``waiting``) need an admin key; the counts do not. Rendered
        prompts only for an admin key with ``[server] status_shows_prompts`` on."""
        daemon.require_loaded()
        prompts = viewers.may_see(request)
        status = _engine_status(daemon, prompts)
        body = {"model": daemon.name, "num_running": len(status["running"]), "num_waiting": len(status["waiting"]),
                **status, "gc": PAUSES.status(), "models": daemon.models.describe()}
        if not is_admin(request):
            del body["running"], body["waiting"]
        elif not prompts:  # whatever the engine put there
            for name in REQUEST_LISTS:
                body[name] = [{k: v for k, v in entry.items() if k != "prompt"} for entry in body[name]]
        return body

    @get("/v1/cache/stats")
    async def cache_stats(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Prefix-cache entries, bytes against the budget, hits by kind, misses and tokens reused (the first model's;
        with several models, each loaded model's under ``models``)."""
        daemon.require_loaded()
        stats = daemon.engine.cache_stats() if daemon.engine is not None else {"enabled": False}
        if len(daemon.models.slots) > 1:
            stats["models"] = {slot.name: slot.engine.cache_stats() for slot in daemon.models.slots
                               if slot.engine is not None}
        return stats

    @delete("/v1/cache", status_code=200, opt={"access": ADMIN})
    async def clear_cache(self, daemon: NamedDependency[Daemon]) -> dict[str, Any]:
        """Drop every prefix-cache entry of every loaded model (on each engine's thread, between steps); returns the
        stats before (the first model's; with several models, each cleared model's under ``models``)."""
        daemon.require_loaded()
        cleared = {slot.name: await slot.engine.clear_prefix_cache() for slot in daemon.models.slots
                   if slot.engine is not None}
        body = {"cleared": cleared.get(daemon.name, {"enabled": False})}
        return {**body, "models": cleared} if len(daemon.models.slots) > 1 else body

    @get("/metrics", opt={"access": METRICS}, media_type=CONTENT_TYPE_LATEST)
    async def metrics(self, metrics: NamedDependency[Metrics]) -> Response[bytes]:
        """Prometheus metrics (text format), every name prefixed ``mlxd_``."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @get("/", opt={"access": OPEN}, media_type=MediaType.HTML, include_in_schema=False)
    async def status_page(self) -> Response[bytes]:
        """The live status page. Its HTML holds no data: it polls the API with the admin key it asks for. Sent with
        a content security policy (its own inline script and style only), not to be framed or sniffed."""
        return Response(STATUS_PAGE, media_type=MediaType.HTML, headers=STATUS_PAGE_HEADERS)
