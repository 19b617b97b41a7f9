"""``create_app(daemon)``: the Litestar application. This layer never imports MLX."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from mlxd import __version__
from mlxd.api.errors import EXCEPTION_HANDLERS
from mlxd.api.openai import OpenAIController
from mlxd.api.ops import OpsController
from mlxd.daemon import Daemon


def create_app(daemon: Daemon, *, load: bool = True) -> Litestar:
    """Build the app. With ``load``, the model loads on a background thread when the app starts."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if load:
            daemon.start_loading()
        try:
            yield
        finally:
            daemon.close()

    server = daemon.config.server
    return Litestar(
        route_handlers=[OpenAIController, OpsController],
        dependencies={"daemon": Provide(lambda: daemon, use_cache=True, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=server.max_body_bytes,
        cors_config=CORSConfig(allow_origins=server.cors_origins) if server.cors_origins else None,
        openapi_config=OpenAPIConfig(title="mlxd", version=__version__, path="/docs"),
        debug=False,
    )
